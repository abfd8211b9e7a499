"""celery-delayed: a real delayed-task system for Celery.

Delayed tasks stay out of the broker, in sharded Redis sorted sets, until
they are due; a scheduler then moves them onto their Celery queues
atomically with Lua scripts. Importing this package changes nothing in
Celery; :func:`install` wires an app (see :mod:`celery_delayed.plugin`).
"""

from __future__ import annotations

from . import schedules
from .api import apply_later, apply_later_many, cancel, cancel_by_key, job_id_for_key, lookup, reschedule
from .config import get_config
from .controls import cancel_matching, pause, paused, promote, promote_matching, resume
from .errors import (
    ConfigurationError,
    DelayedError,
    DuplicateJob,
    InvalidOption,
    InvalidState,
    InvalidWhen,
    JobNotFound,
    StoreFull,
    StoreUnavailable,
)
from .plugin import install
from .result import DelayedResult
from .store import get_store
from .vocab import JobState
from .worker.backoff import Backoff, compute_backoff
from .worker.task import DelayedTask

# The public API, by what it is for. Everything else lives in its module (every error in
# celery_delayed.errors, the store's classes in celery_delayed.store, the settings in celery_delayed.config).
__all__ = [  # noqa: RUF022  (grouped, not sorted)
    # Wiring an app into Celery
    "install",
    "get_config",
    "get_store",
    # Scheduling a job, and the handle of one
    "apply_later",
    "apply_later_many",
    "DelayedResult",
    "JobState",
    "lookup",
    "job_id_for_key",
    # Changing a job that waits
    "cancel",
    "cancel_by_key",
    "reschedule",
    # Operators' controls over many jobs
    "pause",
    "paused",
    "resume",
    "promote",
    "promote_matching",
    "cancel_matching",
    # Recurring schedules (celery_delayed.schedules.add / remove / list / get / pause / resume / run_now)
    "schedules",
    # The worker side
    "DelayedTask",
    "Backoff",
    "compute_backoff",
    # Errors a caller handles (all of them: celery_delayed.errors)
    "DelayedError",
    "ConfigurationError",
    "DuplicateJob",
    "InvalidOption",
    "InvalidState",
    "InvalidWhen",
    "JobNotFound",
    "StoreFull",
    "StoreUnavailable",
]
__version__ = "0.1.0"
