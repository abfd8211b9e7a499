"""Cancelling a job: the store's cancel, then what Celery would report for a revoked task.

One function for every way in (:func:`celery_delayed.cancel`,
``DelayedResult.cancel``, ``celery -A proj delayed cancel``), and Celery's
own revoke made durable for stored jobs (:func:`revoke_in_store`): the
caller's ``app.control.revoke`` (:func:`install_revoke`) and the workers'
``revoke`` command (:mod:`celery_delayed.worker.control`) cancel the job in
the store too, so it is never released, whatever the workers remember.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from celery import Celery
from celery.app.control import Control
from celery.utils.functional import maybe_list
from celery.utils.imports import symbol_by_name

from .announce import shared
from .errors import DelayedError, InvalidOption, InvalidState, JobNotFound
from .store import Store, get_store
from .vocab import JobState

logger = logging.getLogger("celery_delayed.cancel")


def cancel_job(store: Store, job_id: str, shard: int | None = None, *, terminate: bool = False,
               signal: str = "SIGTERM") -> str:
    """Cancel a job; return the state it had (SCHEDULED, CLAIMED, QUEUED, or RUNNING with ``terminate``).

    A job that had not started is reported as Celery reports a revoked task:
    REVOKED in the result backend (``AsyncResult.get()`` raises
    ``TaskRevokedError`` at once) and a ``task-revoked`` event. A RUNNING one
    (``terminate``) is revoked through Celery's ``control.revoke(terminate=True)``,
    whose worker reports it.

    Raises:
        JobNotFound: no such job (or its record expired).
        InvalidState: it is finished or cancelled already, or running (without ``terminate``).
    """
    prev = store.jobs.cancel(job_id, shard, running=terminate)
    if prev == JobState.RUNNING:
        store.app.control.revoke(job_id, terminate=True, signal=signal)
    else:
        shared(store.app).revoked(job_id, "cancelled")
    return prev


def revoke_in_store(app: Celery, task_ids: Any, *, terminate: bool = False) -> dict[str, str]:
    """Celery's revoke of ``task_ids`` (an id or a list), in the store: cancel those that are jobs.

    A job not started yet (SCHEDULED, CLAIMED, QUEUED) is cancelled as
    :func:`cancel_job` cancels it, durably: a scheduled one is never released,
    a released ``DelayedTask`` is skipped at start; and reported REVOKED. With
    ``terminate`` a RUNNING one is cancelled too (the worker running it
    terminates it and reports it). Ids that are no job (a task sent to the
    broker), or a job that ended, are left to Celery's revoke; so is
    everything when the store cannot be reached (logged). Never raises.

    Returns:
        ``{job id: the state it had}`` of the jobs this call cancelled.
    """
    ids: Iterable[Any] = maybe_list(task_ids) or []
    out: dict[str, str] = {}
    try:
        store = get_store(app)
        # One round trip finds which ids are jobs (most revokes name tasks sent to the broker).
        found = store.lookup.locate_many([i for i in dict.fromkeys(ids) if isinstance(i, str) and i])
        for job_id, shard in found.items():
            try:
                prev = store.jobs.cancel(job_id, shard, running=terminate)
            except (JobNotFound, InvalidState, InvalidOption):
                continue
            if prev != JobState.RUNNING:
                shared(app).revoked(job_id, "revoked")
            out[job_id] = str(prev)
    except DelayedError as exc:  # the store is down, or misconfigured: Celery's revoke still goes out
        logger.warning("revoke of %s: could not cancel it in the celery-delayed store: %s", task_ids, exc)
    if out:
        logger.info("revoke: cancelled in the store: %s", ", ".join(f"{k} ({v})" for k, v in out.items()))
    return out


class DurableRevoke:
    """Mixed into an app's ``control_cls``: ``revoke`` cancels stored jobs before Celery broadcasts it."""

    app: Celery

    def revoke(self, task_id: Any, destination: Any = None, terminate: bool = False, signal: Any = None,
               **kwargs: Any) -> Any:
        revoke_in_store(self.app, task_id, terminate=terminate)
        if signal is not None:
            kwargs["signal"] = signal
        return super().revoke(task_id, destination=destination, terminate=terminate, **kwargs)  # type: ignore[misc]


def install_revoke(app: Celery) -> None:
    """Make ``app.control.revoke`` (and so ``AsyncResult.revoke``) cancel stored jobs in the store (idempotent).

    Celery's broadcast still goes out as before (a running task is
    terminated by its worker). Changes this app's ``control_cls`` (or, when
    ``app.control`` exists already, its ``revoke`` method); never the class.
    """
    if "control" in app.__dict__:  # created already: wrap this instance's method
        control = app.__dict__["control"]
        if not isinstance(control, DurableRevoke) and not getattr(control.revoke, "_celery_delayed", False):
            original = control.revoke

            def revoke(task_id: Any, destination: Any = None, terminate: bool = False, **kwargs: Any) -> Any:
                revoke_in_store(app, task_id, terminate=terminate)
                return original(task_id, destination=destination, terminate=terminate, **kwargs)

            revoke._celery_delayed = True  # type: ignore[attr-defined]
            control.revoke = revoke
        return
    base = symbol_by_name(app.control_cls)
    if issubclass(base, DurableRevoke):
        return
    if base is Control:  # by name: an app that is pickled (Celery.__reduce_keys__) names its classes
        app.control_cls = "celery_delayed.cancellation:DurableControl"
    else:
        app.control_cls = type(f"Durable{base.__name__}", (DurableRevoke, base), {"__module__": base.__module__})


class DurableControl(DurableRevoke, Control):  # type: ignore[misc]
    """Celery's ``Control`` whose ``revoke`` also cancels stored jobs (see :func:`install_revoke`)."""
