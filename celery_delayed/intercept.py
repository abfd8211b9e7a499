"""Opt-in: route every ``apply_async(eta=/countdown=)`` and ``Task.retry`` through the store.

With ``delayed_intercept_eta = True`` an app adopts celery-delayed without
changing its call sites: a task sent with a delay of at least
``delayed_intercept_min_delay_s`` is stored (and released by the scheduler
when due) instead of being published at once as a broker ETA message.

The seam is ``Celery.send_task``: ``Task.apply_async``, ``Signature.apply_async``,
``Task.retry`` (which re-sends its signature) and ``app.send_task`` by name
all end there, with the delay still as ``countdown``/``eta`` arguments and
before any message exists. (``before_task_publish`` comes too late: a signal
handler cannot drop the message; a task base class would miss ``send_task``
by name and tasks that do not use it.) Importing ``celery_delayed`` wraps
``Celery.send_task`` once for the process (:func:`install`); the wrapper
looks at a call only when it carries ``countdown`` or ``eta``, and stores it
only for an app whose ``delayed_intercept_eta`` is True. So the process that
sends the tasks must import ``celery_delayed`` (e.g. in the module that
creates the app); ``celery`` commands (worker, beat) import it through the
``delayed`` command's entry point::

    import celery_delayed  # noqa: F401
    app.conf.delayed_intercept_eta = True

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

from .api import apply_later
from .config import get_config
from .errors import InvalidState
from .message import MESSAGE_OPTIONS
from .result import DelayedResult
from .retrying import SHARD_HEADER, build_attempt, store_retry
from .store import get_store
from .timeutil import due_spec

logger = logging.getLogger("celery_delayed.intercept")

#: send_task options that only concern publishing; a stored job has no use for them.
PUBLISH_ONLY = frozenset({
    "producer", "connection", "router", "result_cls", "publisher", "add_to_parent", "route_name",
    "replaced_task_nesting", "retry", "retry_policy", "mandatory", "immediate", "declare", "origin",
    "redelivered", "stamped_headers",
})
_original_send_task: Any = None


def installed(app: Celery | None = None) -> bool:
    """Whether the ``send_task`` wrapper is in place (and, given an app, enabled for it)."""
    if _original_send_task is None:
        return False
    return app is None or bool(app.conf.get("delayed_intercept_eta", False))


def install() -> None:
    """Wrap ``Celery.send_task`` so delayed sends of opted-in apps go through the store.

    Idempotent; runs when ``celery_delayed`` is imported. An app without
    ``delayed_intercept_eta`` is not affected.
    """
    global _original_send_task
    if _original_send_task is not None:
        return
    original = _original_send_task = Celery.send_task

    @functools.wraps(original)
    def send_task(self: Celery, name: str, args: Any = None, kwargs: Any = None, countdown: Any = None,
                  eta: Any = None, task_id: str | None = None, *more: Any, **options: Any) -> Any:
        # (`more`: the rarely used positional producer, connection, ...: such a call passes through.)
        if (countdown is not None or eta is not None) and not more:
            stored = _maybe_store(self, name, args, kwargs, countdown, eta, task_id, options)
            if stored is not None:
                return stored
        return original(self, name, args, kwargs, countdown, eta, task_id, *more, **options)

    Celery.send_task = send_task


def delay_of(app: Celery, countdown: float | None, eta: Any) -> float | None:
    """Seconds from now (this host's clock) until the call's eta/countdown, or None for none."""
    if eta is not None:
        when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
        if not isinstance(when, datetime):
            return None
        if when.tzinfo is None or when.utcoffset() is None:
            from .timeutil import _localize

            when = _localize(when, app.timezone)
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
    if app.current_worker_task is not None and shard is None:
        shard = getattr(app.current_worker_task.request, SHARD_HEADER, None)
    try:
        s = int(shard) if shard is not None else store.shard_of(task_id)
    except (TypeError, ValueError):
        s = store.shard_of(task_id)
    if not 0 <= s < store.config.shards:
        s = store.shard_of(task_id)
    due = due_spec(when, app.timezone)
    fields = build_attempt(app, store, name, args, kwargs, task_id, s, opts, task_type, retries)
    code, state, due_ms = store_retry(store, task_id, s, due, retries, fields)
    if code < 0:
        raise InvalidState(task_id, state, "retry")
    return DelayedResult(task_id, store=store, shard=s, due_ms=due_ms, created=code == 1)


install()
