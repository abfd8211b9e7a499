"""The handle ``apply_later`` returns: a Celery ``AsyncResult`` that knows its job."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from celery import Celery, current_app
from celery.result import AsyncResult
from vine import promise

from .cancellation import cancel_job
from .errors import InvalidState, JobNotFound, StoreUnavailable
from .store import Store, get_store
from .timeutil import due_spec, from_ms
from .vocab import Field


class DelayedResult(AsyncResult):  # type: ignore[misc]
    """An ``AsyncResult`` for a delayed job.

    ``id`` is the Celery task id (also the job id); ``eta`` the due time (an
    aware UTC datetime, by the Redis server's clock); ``created`` is False
    when the job existed already (same ``idempotency_key``).

    Any process can make one from a job id, as with ``AsyncResult``:
    ``DelayedResult(job_id, app=app)`` (what it does not know, it reads from
    the store when asked), or :func:`celery_delayed.lookup`, which checks
    that the job exists.

    **A handle made inside the caller's transaction** (``apply_later(...,
    connection=session)``) names a job that does not exist yet for anyone
    else: its id, shard and due time are fixed, but its row is only in the
    open transaction and Redis has nothing. Until the commit, ``indexed`` is
    False and the job cannot be read, cancelled or rescheduled (``job()`` and
    ``job_state`` raise :class:`~celery_delayed.errors.JobNotFound` saying
    so; ``cancel()`` returns False). After the commit the job is indexed (a
    ``Session``'s commit or Django's ``on_commit`` at once, a Core
    ``Connection``'s by the scheduler's sweep within about a second) and the
    handle works as any other; ``indexed`` becomes True. Rolled back, the job
    never exists and ``indexed`` stays False.
    """

    def __init__(
        self, id: str, *, store: Store | None = None, shard: int | None = None, due_ms: int | None = None,
        created: bool = True, app: Celery | None = None, **kwargs: Any,
    ) -> None:
        if store is None:
            store = get_store(app if app is not None else current_app._get_current_object())
        if id is None or not kwargs.keys() <= {"backend", "parent"}:
            super().__init__(id, app=store.app, **kwargs)
        else:
            # AsyncResult.__init__, but for its vine promise (weak method refs,
            # ~10 us: most of what apply_later_many spent on 100,000 handles):
            # ``on_ready`` below makes it on first use.
            self.app = store.app
            self.id = id
            self.backend = kwargs.get("backend") or self.app.backend
            self.parent = kwargs.get("parent")
            self._cache = None
            self._ignored = False
        self.store = store
        self.shard = shard
        self.due_ms = due_ms
        self.created = created
        self._indexed = True
        #: Made inside the caller's transaction (``connection=``): see the class docstring.
        self.in_transaction = False

    @property
    def indexed(self) -> bool:
        """Whether the job is in Redis, the time index that releases it (always True without a database).

        With a database it is False while the job is only a row: before the
        caller's transaction commits, or when Redis could not be reached to
        index it (the scheduler indexes it when Redis is back). A handle that
        was not yet indexed asks the store when read (one lookup, until it is
        True); Redis unreachable reads as False.
        """
        if not self._indexed:
            try:
                self.shard = self.store.lookup.locate(self.id, self.shard)
                self._indexed = True
            except (JobNotFound, StoreUnavailable):
                return False
        return True

    @indexed.setter
    def indexed(self, value: bool) -> None:
        self._indexed = bool(value)

    @property
    def on_ready(self) -> Any:
        """AsyncResult's promise fulfilled when the result is ready (made on first use)."""
        p = self.__dict__.get("_delayed_on_ready")
        if p is None:
            p = self.__dict__["_delayed_on_ready"] = promise(self._on_fulfilled, weak=True)
        return p

    @on_ready.setter
    def on_ready(self, value: Any) -> None:
        self.__dict__["_delayed_on_ready"] = value

    @property
    def eta(self) -> datetime:
        """When the job is due (aware, UTC); read from the store when the handle does not know it."""
        if self.due_ms is None:
            rec = self.job()
            self.due_ms = int(float(rec[Field.DUE]))
        return from_ms(self.due_ms)

    def cancel(self, terminate: bool = False, signal: str = "SIGTERM") -> bool:
        """Cancel the job; return whether it was cancelled by this call.

        A scheduled job is removed from the schedule; a queued one (released,
        not started) is skipped by the worker. False when it runs, finished,
        was cancelled already or its record expired; with ``terminate`` a
        running job is cancelled and its process killed where Celery can
        (see :func:`celery_delayed.cancel`).
        """
        try:
            cancel_job(self.store, self.id, self.shard, terminate=terminate, signal=signal)
        except (InvalidState, JobNotFound):
            return False
        return True

    def reschedule(self, when: object) -> datetime:
        """Move the still-scheduled job to ``when``; return the new due time.

        Raises:
            InvalidState: it was released, cancelled or finished already.
        """
        self.due_ms = self.store.jobs.reschedule(self.id, due_spec(when, self.store.app.timezone), self.shard)
        return self.eta

    def job(self) -> dict[str, str]:
        """Return the job's record: state (``st``), due time, task, queue, timestamps.

        Raises:
            JobNotFound: no such job; or (a handle made in the caller's
                transaction) not yet, its transaction has not committed.
        """
        try:
            return self.store.lookup.get(self.id, self.shard)
        except JobNotFound:
            if self.in_transaction and not self._indexed:
                raise JobNotFound(self.id, "not in the store yet: it is a row of the caller's transaction, indexed "
                                           "once that commits; rolled back, it never exists") from None
            raise

    @property
    def job_state(self) -> str:
        """The job's state in the store (SCHEDULED, QUEUED, CANCELLED, ...)."""
        return self.job().get(Field.STATE, "")
