"""The exceptions celery-delayed raises; all derive from :class:`DelayedError`."""

from __future__ import annotations

from typing import Any


class DelayedError(Exception):
    """Base class of every celery-delayed error."""


class ConfigurationError(DelayedError, ValueError):
    """A ``delayed_*`` setting has a wrong type or value."""


class InvalidWhen(DelayedError, ValueError):
    """``when`` is not an aware datetime, a timedelta or a number of seconds."""


class InvalidOption(DelayedError, TypeError):
    """An option ``apply_later`` does not accept, or a value it cannot use."""


class SerializationError(DelayedError, ValueError):
    """The task's arguments cannot be serialized with its serializer."""


class PayloadTooLarge(DelayedError, ValueError):
    """The built message exceeds ``delayed_max_payload_bytes``."""


class UnknownTask(DelayedError, LookupError):
    """No task of that name is registered with the app."""


class DuplicateJob(DelayedError):
    """A job with this id exists already (scheduled, queued or recently finished)."""

    def __init__(self, job_id: str, state: str) -> None:
        super().__init__(
            f"a job with id {job_id!r} exists already (state {state}); "
            "pass another task_id, or use idempotency_key to get the existing job back"
        )
        self.job_id = job_id
        self.state = state


class JobNotFound(DelayedError, LookupError):
    """No job record under that id (never scheduled, or its record expired)."""

    def __init__(self, job_id: str, why: str = "never scheduled, or its record expired") -> None:
        super().__init__(f"no job with id {job_id!r} ({why})")
        self.job_id = job_id


class InvalidState(DelayedError):
    """The job is in a state that does not allow the operation."""

    def __init__(self, job_id: str, state: str, operation: str) -> None:
        super().__init__(f"cannot {operation} job {job_id!r}: it is {state}")
        self.job_id = job_id
        self.state = state
        self.operation = operation


class StoreUnavailable(DelayedError, ConnectionError):
    """Redis could not be reached (the message says whether a write may have happened)."""


class LeaseLost(DelayedError):
    """The scheduler no longer holds the shard's lease."""


class StoreFull(StoreUnavailable):
    """Redis refused a write because it reached ``maxmemory`` (policy ``noeviction``).

    Nothing was written, except on a Redis Cluster, where a batch's shards
    live on several nodes and one full node refuses only its own, or in a
    batch that took a second round trip (a shard whose template Redis lost,
    jobs a reshard moved) when Redis filled up in between: then ``written``
    maps the position (in the calls given) of each job stored anyway to its
    handle (:class:`~celery_delayed.result.DelayedResult` from
    ``apply_later_many``; a :class:`~celery_delayed.store.records.Scheduled`
    from ``Store.schedule``). It is empty when nothing was written.

    A subclass of :class:`StoreUnavailable`, so callers that retry an
    unreachable store retry a full one the same way.
    """

    def __init__(self, message: str, written: dict[int, Any] | None = None) -> None:
        super().__init__(message)
        self.written: dict[int, Any] = dict(written or {})


class ReplicationTimeout(DelayedError):
    """Fewer than ``delayed_wait_replicas`` replicas acknowledged a write in time (Redis ``WAIT``).

    The write was made on the master and answered there; only its copy on
    the replicas is not confirmed, so a failover now could lose it.
    ``acked`` replicas had it, ``wanted`` were asked for; ``results``: the
    replies of the calls the master made (set by the store's runner).
    """

    def __init__(self, message: str, acked: int = 0, wanted: int = 0) -> None:
        super().__init__(message)
        self.acked = acked
        self.wanted = wanted
        self.results: list[Any] | None = None


def raise_for(code: int, job_id: str, state: str, operation: str) -> None:
    """Raise the exception a script's negative reply code stands for (see :class:`~celery_delayed.vocab.Reply`).

    Does nothing for a non-negative code other than ``NOT_FOUND``.

    Raises:
        JobNotFound: ``NOT_FOUND``.
        InvalidState: ``WRONG_STATE``, ``BUSY`` or ``NO_MESSAGE``.
        LeaseLost: ``NOT_OWNER``.
    """
    from .vocab import Reply

    if code == Reply.NOT_FOUND:
        raise JobNotFound(job_id)
    if code == Reply.NOT_OWNER:
        raise LeaseLost(f"cannot {operation} job {job_id!r}: the caller does not hold its lease (it is {state})")
    if code == Reply.NO_MESSAGE:
        raise InvalidState(job_id, f"{state} without a stored message", operation)
    if code < 0:
        raise InvalidState(job_id, state, operation)


class Misfired(DelayedError):
    """The job was released later than its ``max_lateness`` and the misfire policy dead-lettered it.

    Stored in the result backend as the job's failure, so ``AsyncResult.get()``
    raises it.
    """


class Unpublishable(DelayedError):
    """The broker refused the job's message ``delayed_publish_max_refusals`` times (publish path).

    For example no such exchange, or a message over the broker's size limit;
    the job is dead-lettered with the broker's reason.
    """


class DatabaseUnavailable(DelayedError, ConnectionError):
    """The database of ``delayed_database_url`` could not be used; nothing was written anywhere."""


class ScheduleNotFound(DelayedError, LookupError):
    """No recurring schedule has that name (``celery_delayed.schedules``)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no recurring schedule named {name!r}")
        self.name = name
