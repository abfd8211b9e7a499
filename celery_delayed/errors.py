"""The exceptions celery-delayed raises; all derive from :class:`DelayedError`."""

from __future__ import annotations


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

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job with id {job_id!r} (never scheduled, or its record expired)")
        self.job_id = job_id


class InvalidState(DelayedError):
    """The job is in a state that does not allow the operation."""

    def __init__(self, job_id: str, state: str, operation: str) -> None:
        super().__init__(f"cannot {operation} job {job_id!r}: it is {state}")
        self.job_id = job_id
        self.state = state
        self.operation = operation


class StoreUnavailable(DelayedError, ConnectionError):
    """Redis could not be reached; nothing was written."""


class LeaseLost(DelayedError):
    """The scheduler no longer holds the shard's lease."""
