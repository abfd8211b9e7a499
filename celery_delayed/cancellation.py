"""Cancelling a job: the store's cancel, then what Celery would report for a revoked task.

One function for every way in (:func:`celery_delayed.cancel`,
``DelayedResult.cancel``, ``celery -A proj delayed cancel``).
"""

from __future__ import annotations

from .announce import shared
from .store import Store
from .vocab import JobState


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
    prev = store.cancel(job_id, shard, running=terminate)
    if prev == JobState.RUNNING:
        store.app.control.revoke(job_id, terminate=True, signal=signal)
    else:
        shared(store.app).revoked(job_id, "cancelled")
    return prev
