"""Tell Celery's result backend and event consumers what happened to a job outside a worker.

A job cancelled in the store, or not sent at release (expired, skipped or
dead-lettered by the misfire policy), never reaches a worker, so no worker
reports it. This module does what Celery's worker does for such a task, from
the process that changed the job (a producer's ``cancel``, the scheduler):

- the result backend gets REVOKED (cancelled, expired, skipped: Celery's
  ``mark_as_revoked``, so ``AsyncResult.get()`` raises ``TaskRevokedError``
  at once) or FAILURE with :class:`~celery_delayed.errors.Misfired` (dead by
  the misfire policy);
- with ``task_send_sent_event`` on (the switch Celery uses for events from
  non-worker processes), a ``task-revoked`` event, and ``task-sent`` when a
  job is released.

Reporting is best effort: the store's state is the truth, and a backend or
broker that cannot be reached is logged, never raised.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterable
from typing import Any

from celery import Celery
from celery.backends.base import DisabledBackend

from .errors import Misfired
from .vocab import JobState

logger = logging.getLogger("celery_delayed.announce")

#: The hostname celery-delayed's events carry (never a worker's).
HOSTNAME = f"celery-delayed@{socket.gethostname()}"


class Announcer:
    """Reports jobs to one app's result backend and event consumers (see the module docstring)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.events_enabled = bool(app.conf.task_send_sent_event)
        self._dispatcher: Any = None
        self._lock = threading.Lock()  # one dispatcher, shared by the threads of a process (see shared())

    # -- the result backend ------------------------------------------------------

    def _backend(self) -> Any:
        backend = self.app.backend
        return None if isinstance(backend, DisabledBackend) else backend

    def revoked(self, job_id: str, reason: str = "cancelled", *, expired: bool = False) -> None:
        """The job ends without running: REVOKED in the backend, a ``task-revoked`` event."""
        try:
            backend = self._backend()
            if backend is not None:
                backend.mark_as_revoked(job_id, reason)
        except Exception:
            logger.warning("could not record job %s as revoked in the result backend", job_id, exc_info=True)
        self.event("task-revoked", uuid=job_id, terminated=False, signum=None, expired=expired)

    def misfired(self, job_id: str, reason: str) -> None:
        """The misfire policy dead-lettered the job: FAILURE (:class:`Misfired`) in the backend, ``task-failed``."""
        self.failed(job_id, Misfired(reason))

    def failed(self, job_id: str, exc: Exception) -> None:
        """The job was dead-lettered without running: FAILURE with ``exc`` in the backend, ``task-failed``."""
        try:
            backend = self._backend()
            if backend is not None:
                backend.mark_as_failure(job_id, exc, traceback=None, call_errbacks=False)
        except Exception:
            logger.warning("could not record job %s as failed in the result backend", job_id, exc_info=True)
        self.event("task-failed", uuid=job_id, exception=repr(exc), traceback="")

    def not_sent(self, jobs: Iterable[tuple[str, str, str]]) -> None:
        """Report the jobs a release did not send: (id, state, reason) with state EXPIRED, SKIPPED or DEAD."""
        for job_id, state, reason in jobs:
            if state == JobState.DEAD:
                self.misfired(job_id, reason)
            else:
                self.revoked(job_id, reason, expired=state == JobState.EXPIRED)

    # -- events --------------------------------------------------------------------

    def sent(self, events: Iterable[dict[str, Any] | None]) -> None:
        """Send the stored ``task-sent`` event of each released job that has one."""
        for fields in events:
            if fields:
                self.event("task-sent", **fields)

    def scheduled(self, events: Iterable[tuple[dict[str, Any], str]]) -> None:
        """Announce jobs just scheduled: ``task-sent`` with the eta (an ISO date), as ``apply_async(eta=)`` does.

        Each item is a job's stored task-sent fields and its eta; monitors
        (Flower) then list the task as pending with that eta until it runs.
        """
        for fields, eta in events:
            self.event("task-sent", **{**fields, "eta": eta})

    def event(self, kind: str, **fields: Any) -> None:
        """Send one task event when the app enables events from non-worker processes."""
        if not self.events_enabled:
            return
        with self._lock:
            try:
                if self._dispatcher is None:
                    conn = self.app.connection_for_write()
                    self._dispatcher = self.app.events.Dispatcher(conn, hostname=HOSTNAME, enabled=True)
                self._dispatcher.send(kind, **fields)
            except Exception:  # events are best effort: the store holds the truth
                logger.warning("could not send the %s event", kind, exc_info=True)
                self._close()

    def close(self) -> None:
        """Release the event connection (the next event opens a new one)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._dispatcher is not None:
            try:
                self._dispatcher.close()
                self._dispatcher.connection.release()
            except Exception:
                logger.debug("closing the event dispatcher failed", exc_info=True)
            self._dispatcher = None


_SHARED = "_celery_delayed_announcer"


def shared(app: Celery) -> Announcer:
    """The app's process-wide announcer for producers (one event connection, opened on first use)."""
    announcer: Announcer | None = app.__dict__.get(_SHARED)
    if announcer is None:
        announcer = app.__dict__.setdefault(_SHARED, Announcer(app))
    return announcer
