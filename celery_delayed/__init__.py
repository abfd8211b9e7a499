"""celery-delayed: a real delayed-task system for Celery.

Delayed tasks stay out of the broker, in sharded Redis sorted sets, until
they are due; a scheduler then moves them onto their Celery queues
atomically with Lua scripts. Importing this package changes nothing in
Celery; :func:`install` wires an app (see :mod:`celery_delayed.plugin`).
"""

from __future__ import annotations

# Recurring schedules (celery_delayed.schedules.list / get / add / remove / pause / resume / run_now)
from . import schedules

# Scheduling and job operations
from .api import apply_later, apply_later_many, cancel, cancel_by_key, job_id_for_key, lookup, reschedule

# Settings
from .config import DelayedConfig, get_config

# Operators' controls
from .controls import cancel_matching, pause, paused, promote, promote_matching, resume

# Errors
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    DelayedError,
    DuplicateJob,
    InvalidOption,
    InvalidState,
    InvalidWhen,
    JobNotFound,
    LeaseLost,
    Misfired,
    PayloadTooLarge,
    ReplicationTimeout,
    SerializationError,
    StoreFull,
    StoreUnavailable,
    UnknownTask,
    Unpublishable,
)

# Wiring an app into Celery
from .plugin import install
from .result import DelayedResult

# The store
from .store import Store, get_store
from .vocab import JobState

# The worker side
from .worker.backoff import Backoff, compute_backoff
from .worker.task import DelayedTask

__all__ = [
    "Backoff",
    "ConfigurationError",
    "DatabaseUnavailable",
    "DelayedConfig",
    "DelayedError",
    "DelayedResult",
    "DelayedTask",
    "DuplicateJob",
    "InvalidOption",
    "InvalidState",
    "InvalidWhen",
    "JobNotFound",
    "JobState",
    "LeaseLost",
    "Misfired",
    "PayloadTooLarge",
    "ReplicationTimeout",
    "SerializationError",
    "Store",
    "StoreFull",
    "StoreUnavailable",
    "UnknownTask",
    "Unpublishable",
    "apply_later",
    "apply_later_many",
    "cancel",
    "cancel_by_key",
    "cancel_matching",
    "compute_backoff",
    "get_config",
    "get_store",
    "install",
    "job_id_for_key",
    "lookup",
    "pause",
    "paused",
    "promote",
    "promote_matching",
    "reschedule",
    "resume",
    "schedules",
]
__version__ = "0.1.0"
