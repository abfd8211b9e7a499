"""Opt-in: route every ``apply_async(eta=/countdown=)`` and ``Task.retry`` through the store.

With ``delayed_intercept_eta = True`` an app adopts celery-delayed without
changing its call sites: a task sent with a delay of at least
``delayed_intercept_min_delay_s`` is stored (and released by the scheduler
when due) instead of being published at once as a broker ETA message.

The seam is the app's ``send_task``: ``Task.apply_async``,
``Signature.apply_async``, ``Task.retry`` (which re-sends its signature) and
``app.send_task`` by name all end there, with the delay still as
``countdown``/``eta`` arguments and before any message exists.
(``before_task_publish`` comes too late: a signal handler cannot drop the
message; a task base class would miss ``send_task`` by name and tasks that do
not use it.) :func:`install` wraps ``send_task`` on one app instance (never
on the ``Celery`` class); :func:`celery_delayed.install` calls it, and so do
``celery`` commands (worker, ``delayed run``) for every app they load, through
the ``delayed`` command's entry point. A producer process calls
``celery_delayed.install(app)`` once::

    app.conf.delayed_intercept_eta = True
    celery_delayed.install(app)

A call with ``retries`` > 0 (``Task.retry``) keeps its task id: the store
schedules the next attempt on the job's record (``retry.lua``), whatever
state a previous attempt left it in, unless the job was cancelled. Other
calls become new jobs (``apply_later``); a task id that is still pending in
the store raises ``DuplicateJob``. Options that only say how to publish
(producer, connection, retry_policy, ...) do not apply to a stored job and
are dropped; a call with any option celery-delayed cannot store is sent to
the broker as before, with a warning.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery import Celery

from ..api import apply_later
from ..config import get_config
from ..errors import InvalidState
from ..producer.message import MESSAGE_OPTIONS
from ..result import DelayedResult
from ..store import get_store
from ..timeutil import due_spec, localize
from ..vocab import SHARD_HEADER, Reply
from .execution import job_shard
from .failures import Attempt, Failures

logger = logging.getLogger("celery_delayed.intercept")

#: send_task options that only concern publishing; a stored job has no use for them.
PUBLISH_ONLY = frozenset({
    "producer", "connection", "router", "result_cls", "publisher", "add_to_parent", "route_name",
    "replaced_task_nesting", "retry", "retry_policy", "mandatory", "immediate", "declare", "origin",
    "redelivered", "stamped_headers",
})
_WRAPPED = "_celery_delayed_send_task"


def installed(app: Celery) -> bool:
    """Whether ``app.send_task`` is wrapped (see :func:`install`)."""
    return _WRAPPED in app.__dict__


def install(app: Celery) -> None:
    """Wrap ``app.send_task`` so its delayed sends go through the store while ``delayed_intercept_eta`` is on.

    Idempotent. The wrapper looks at a call only when it carries
    ``countdown`` or ``eta``, and stores it only while the app's
    ``delayed_intercept_eta`` is True.
    """
    if installed(app):
        return
    original = app.send_task  # bound to this app

    @functools.wraps(original)
    def send_task(name: str, args: Any = None, kwargs: Any = None, countdown: Any = None,
                  eta: Any = None, task_id: str | None = None, *more: Any, **options: Any) -> Any:
        # (`more`: the rarely used positional producer, connection, ...: such a call passes through.)
        if (countdown is not None or eta is not None) and not more:
            stored = _maybe_store(app, name, args, kwargs, countdown, eta, task_id, options)
            if stored is not None:
                return stored
        return original(name, args, kwargs, countdown, eta, task_id, *more, **options)

    app.send_task = send_task
    app.__dict__[_WRAPPED] = original


def delay_of(app: Celery, countdown: float | None, eta: Any) -> float | None:
    """Seconds from now (this host's clock) until the call's eta/countdown, or None for none."""
    if eta is not None:
        when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
        if not isinstance(when, datetime):
            return None
        if when.tzinfo is None or when.utcoffset() is None:
            when = localize(when, app.timezone)
        return (when - datetime.now(tz=when.tzinfo)).total_seconds()
    if countdown is None:
        return None
    try:
        return float(countdown)
    except (TypeError, ValueError):
        return None


def _maybe_store(app: Celery, name: str, args: Any, kwargs: Any, countdown: float | None, eta: Any,
                 task_id: str | None, options: Mapping[str, Any]) -> Any:
    if not app.conf.get("delayed_intercept_eta", False):
        return None
    delay = delay_of(app, countdown, eta)
    if delay is None:
        return None
    cfg = get_config(app)
    if not cfg.intercept_eta or delay < cfg.intercept_min_delay_s:
        return None
    unknown = set(options) - MESSAGE_OPTIONS - PUBLISH_ONLY - {"retries", "task_type", "task_id"}
    if unknown:
        logger.warning("%s sent to the broker with its eta: celery-delayed cannot store option(s) %s",
                       name, sorted(unknown))
        return None
    opts = {k: v for k, v in options.items() if k in MESSAGE_OPTIONS and v is not None}
    task_type = options.get("task_type") or app.tasks.get(name)
    when: Any = eta if eta is not None else countdown
    if isinstance(when, str):
        when = datetime.fromisoformat(when)
    retries = int(options.get("retries") or 0)
    if retries <= 0:
        return apply_later(app, name, args, kwargs, when, task_id=task_id, strict=False, **opts)
    return _store_retry(app, name, args or (), kwargs or {}, when, str(task_id), retries, opts, task_type)


def _store_retry(app: Celery, name: str, args: Any, kwargs: Any, when: Any, task_id: str, retries: int,
                 opts: dict[str, Any], task_type: Any) -> DelayedResult:
    """Task.retry(countdown=) of any task: the next attempt on the job's record."""
    store = get_store(app)
    headers = opts.get("headers") or {}
    shard = headers.get(SHARD_HEADER) if isinstance(headers, Mapping) else None
    running = app.current_worker_task
    if shard is None and running is not None and running.request.id == task_id:
        s = job_shard(store, running.request)
    else:
        s = _valid_shard(shard, store.config.shards, store.shard_of(task_id))
    attempt = Attempt(task_id, s, name, retries, args, kwargs, opts, task_type=task_type)
    fields = Failures(app, store).attempt_fields(attempt, retries)
    outcome = store.retry(task_id, s, due_spec(when, app.timezone), retries, fields)
    if outcome.code < 0:
        raise InvalidState(task_id, outcome.state, "retry")
    return DelayedResult(task_id, store=store, shard=s, due_ms=outcome.due_ms, created=outcome.code == Reply.OK)


def _valid_shard(value: Any, shards: int, default: int) -> int:
    try:
        s = int(value)
    except (TypeError, ValueError):
        return default
    return s if 0 <= s < shards else default
