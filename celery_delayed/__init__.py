"""celery-delayed: a real delayed-task system for Celery.

Delayed tasks stay out of the broker, in sharded Redis sorted sets, until
they are due; a scheduler then moves them onto their Celery queues
atomically with Lua scripts.
"""

from __future__ import annotations

from . import intercept  # noqa: F401  (wraps Celery.send_task for delayed_intercept_eta)
from .api import apply_later, apply_later_many, cancel, cancel_by_key, job_id_for_key, reschedule
from .backoff import Backoff, compute_backoff
from .config import DelayedConfig, get_config
from .errors import (
    ConfigurationError,
    DelayedError,
    DuplicateJob,
    InvalidOption,
    InvalidState,
    InvalidWhen,
    JobNotFound,
    LeaseLost,
    PayloadTooLarge,
    SerializationError,
    StoreUnavailable,
    UnknownTask,
)
from .result import DelayedResult
from .retrying import RetryMixin
from .store import Store, get_store
from .task import DelayedTask

__all__ = [
    "Backoff",
    "ConfigurationError",
    "DelayedConfig",
    "DelayedError",
    "DelayedResult",
    "DelayedTask",
    "DuplicateJob",
    "InvalidOption",
    "InvalidState",
    "InvalidWhen",
    "JobNotFound",
    "LeaseLost",
    "PayloadTooLarge",
    "RetryMixin",
    "SerializationError",
    "Store",
    "StoreUnavailable",
    "UnknownTask",
    "apply_later",
    "apply_later_many",
    "cancel",
    "cancel_by_key",
    "compute_backoff",
    "get_config",
    "get_store",
    "job_id_for_key",
    "reschedule",
]
__version__ = "0.1.0"
