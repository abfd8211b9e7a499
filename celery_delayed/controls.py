"""The controls operators reach for: pause and resume release, run jobs now, cancel in bulk, rate limits.

Each works on every shard, one script call per shard (and per batch), so it
runs unchanged on Redis Cluster; bulk operations read the pending index
(by task and queue), so their cost is bounded by what matches.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from celery import Celery

from .announce import shared
from .errors import InvalidOption
from .store import get_store
from .store.shaping import Limit
from .timeutil import due_spec

__all__ = ["cancel_matching", "limits", "pause", "pause_flags", "paused", "promote", "promote_matching", "resume",
           "set_limit", "tenants"]


def pause_flags(queue: str | None = None, task: str | None = None) -> list[str]:
    """The pause flags for a queue and/or a task; neither: ``["all"]``."""
    for name, value in (("queue", queue), ("task", task)):
        if value is not None and (not isinstance(value, str) or not value):
            raise InvalidOption(f"{name} must be a non-empty string, got {value!r}")
    flags = ([f"queue:{queue}"] if queue else []) + ([f"task:{task}"] if task else [])
    return flags or ["all"]


def pause(app: Celery, *, queue: str | None = None, task: str | None = None) -> list[str]:
    """Stop releasing the jobs of a queue and/or a task (neither: every job); return the flags set.

    The jobs stay scheduled (listed, cancellable); a due one of a paused task
    or queue is held back until :func:`resume`.
    """
    flags = pause_flags(queue, task)
    get_store(app).jobs.pause(flags)
    return flags


def resume(app: Celery, *, queue: str | None = None, task: str | None = None) -> int:
    """Lift the pause of a queue and/or a task (neither: every pause); return how many held jobs go back.

    Held jobs keep their due time: they are released at once, and the
    misfire policy (``max_lateness`` with ``misfire``) applies to them as to
    any late job.
    """
    flags = pause_flags(queue, task) if queue or task else []
    return get_store(app).jobs.resume(flags)


def paused(app: Celery) -> dict[str, int]:
    """The pauses in force: flag (``all``, ``task:<name>``, ``queue:<name>``) -> since (epoch ms)."""
    return get_store(app).jobs.pauses()


def promote(app: Celery, job_id: str) -> int:
    """Run a scheduled job now (its due time becomes now); return that time, epoch ms.

    Raises:
        JobNotFound: no such job.
        InvalidState: it is not scheduled any more.
    """
    return get_store(app).jobs.promote(job_id)


def promote_matching(app: Celery, *, task: str | None = None, queue: str | None = None) -> int:
    """Run every scheduled job of a task and/or queue now; return how many."""
    return get_store(app).jobs.promote_matching(task, queue)


def _bound(when: Any, tz: Any) -> int | None:
    """An epoch-ms bound from a datetime (a naive one in the app's timezone) or an epoch-ms int; None: no bound."""
    if when is None:
        return None
    if isinstance(when, datetime):
        return int(due_spec(when, tz))
    if isinstance(when, int) and not isinstance(when, bool):
        return when
    raise InvalidOption(f"a due bound must be a datetime or epoch milliseconds, got {type(when).__name__} {when!r}")


def cancel_matching(
    app: Celery, *, task: str | None = None, queue: str | None = None, due_from: Any = None, due_to: Any = None,
) -> list[str]:
    """Cancel the scheduled jobs of a task and/or queue whose due time is in [due_from, due_to]; return their ids.

    ``due_from`` / ``due_to``: aware datetimes (or epoch-ms ints); None = no
    bound. Each cancelled job is reported as a revoked task (result backend,
    ``task-revoked`` event), as :func:`celery_delayed.cancel` does.
    """
    store = get_store(app)
    ids = store.jobs.cancel_matching(task, queue, _bound(due_from, app.timezone), _bound(due_to, app.timezone))
    announce = shared(app)
    for job_id in ids:
        announce.revoked(job_id, "cancelled")
    return ids


def set_limit(app: Celery, key: str, rate: str | float | None) -> None:
    """Change a rate limit on every shard at run time; the schedulers apply it on their next release.

    ``key``: a task name, ``queue:<name>``, ``tenant:<name>`` or ``tenant:*``;
    ``rate``: Celery's rate string (``"50/s"``, ``"10/m"``) wins over the
    app's ``delayed_rate_limits``; ``0`` lifts the limit; ``None`` puts the
    app's back (none when the app sets none).

    Raises:
        ConfigurationError: a bad key or rate (nothing is changed).
    """
    get_store(app).shaping.set_limit(key, rate)


def limits(app: Celery) -> list[Limit]:
    """Every limit in force or lifted (the app's and those set at run time), with the due jobs each holds back."""
    return get_store(app).shaping.limits()


def tenants(app: Celery) -> dict[str, int]:
    """Tenants with scheduled jobs -> how many, over every shard."""
    return get_store(app).shaping.tenants()
