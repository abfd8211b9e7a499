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
state a previous attempt left it in, unless the job was cancelled. Made by
the job's own running attempt, it ends that attempt (under its execution
lease, :mod:`~celery_delayed.worker.ending`). Other
calls become new jobs (``apply_later``); a task id that is still pending in
the store raises ``DuplicateJob``.

The stored message is the one Celery would have sent, without ``eta`` (it
leaves the store when due): stamps (``stamped_headers`` and one option per
stamp) become its ``stamps`` headers; options Celery does not know itself
become message properties, as kombu's ``publish`` makes them; options that
only say how to publish (producer, connection, retry_policy, ...) do not
apply to a stored job and are dropped. The eta Celery would have written is
kept in the ``delayed_eta`` header, which the worker side copies into
``request.eta`` (:mod:`celery_delayed.worker.eta`).

A delayed call the store cannot take (a message celery-delayed refuses to
build, positional publish arguments) is sent to the broker as before, as an
ETA message: the producer logs a warning and counts it in the store, where
``delayed status`` shows it (:meth:`ShardStatus.eta_fallbacks
<celery_delayed.store.ShardStatus.eta_fallbacks>`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from celery import Celery
from celery.utils.time import maybe_make_aware

from ..api import store_prepared
from ..config import get_config
from ..errors import InvalidOption, InvalidState, InvalidWhen, PayloadTooLarge, SerializationError
from ..producer.message import split_options, stamp_names, task_defaults
from ..producer.prepare import lookup_task, prepare
from ..result import DelayedResult
from ..store import Store, get_store
from ..timeutil import due_spec, localize
from ..vocab import ETA_HEADER, SHARD_HEADER, Reply
from .ending import AttemptEnd, End, of_request
from .execution import job_shard
from .failures import Attempt, Failures

logger = logging.getLogger("celery_delayed.intercept")

#: send_task options that only concern publishing; a stored job has no use for them.
PUBLISH_ONLY = frozenset({
    "producer", "connection", "router", "result_cls", "publisher", "add_to_parent", "route_name",
    "retry", "retry_policy", "mandatory", "immediate", "declare", "redelivered", "timeout",
    "confirm_timeout", "expiration",
})
#: send_task arguments the wrapper handles itself.
_OWN = frozenset({"retries", "task_type", "task_id"})
#: Errors of a message celery-delayed refuses to build (Celery may still send it).
_UNSTORABLE = (InvalidOption, InvalidWhen, SerializationError, PayloadTooLarge)
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
        # (`more`: the rarely used positional producer, connection, ...)
        if countdown is not None or eta is not None:
            stored = _maybe_store(app, name, args, kwargs, countdown, eta, task_id, more, options)
            if stored is not None:
                return stored
        headers = options.get("headers")
        if isinstance(headers, Mapping) and ETA_HEADER in headers:
            # A retry's copy of a released job's headers: that eta is not this message's.
            options["headers"] = {k: v for k, v in headers.items() if k != ETA_HEADER}
        return original(name, args, kwargs, countdown, eta, task_id, *more, **options)

    app.send_task = send_task
    app.__dict__[_WRAPPED] = original


def _when(app: Celery, countdown: Any, eta: Any) -> Any:
    """The call's due time as Celery reads it (a countdown wins over an eta): seconds, a datetime, or None."""
    if countdown:
        try:
            return float(countdown)
        except (TypeError, ValueError):
            return None
    if eta is None or eta == "":
        return 0.0 if countdown is not None else None
    when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
    if not isinstance(when, datetime):
        return None
    if when.tzinfo is None or when.utcoffset() is None:
        when = localize(when, app.timezone)
    return when


def delay_of(app: Celery, countdown: Any, eta: Any) -> float | None:
    """Seconds from now (this host's clock) until the call's eta/countdown, or None for none."""
    try:
        when = _when(app, countdown, eta)
    except ValueError:  # an eta string that is not ISO 8601: Celery's to refuse
        return None
    if isinstance(when, datetime):
        return (when - datetime.now(tz=when.tzinfo)).total_seconds()
    return when  # type: ignore[no-any-return]


def celery_eta(app: Celery, countdown: Any, eta: Any) -> str | None:
    """The ``eta`` header Celery would write for this call (``amqp.as_task_v2``)."""
    if countdown:
        eta = maybe_make_aware(app.now() + timedelta(seconds=float(countdown)), tz=app.timezone)
    if isinstance(eta, datetime):
        return eta.isoformat()
    return eta if isinstance(eta, str) and eta else None


def _maybe_store(app: Celery, name: str, args: Any, kwargs: Any, countdown: Any, eta: Any,
                 task_id: str | None, more: tuple[Any, ...], options: dict[str, Any]) -> Any:
    if not app.conf.get("delayed_intercept_eta", False):
        return None
    delay = delay_of(app, countdown, eta)
    if delay is None:
        return None
    cfg = get_config(app)
    if not cfg.intercept_eta or delay < cfg.intercept_min_delay_s:
        return None
    if more:
        return _fall_back(app, name, task_id, "positional send_task arguments after task_id")
    try:
        kept, rest = split_options(options)
        stamps = set(stamp_names(kept))
        opts = {k: v for k, v in kept.items() if v is not None or k in stamps}
        # What Celery does with the options it does not know: kombu's publish makes them message properties.
        properties = {k: v for k, v in rest.items() if k not in PUBLISH_ONLY and k not in _OWN and v is not None}
        when = _when(app, countdown, eta)
        header_eta = celery_eta(app, countdown, eta)
        retries = int(options.get("retries") or 0)
        if retries > 0:
            return _store_retry(app, name, args or (), kwargs or {}, when, str(task_id), retries, opts,
                                options.get("task_type") or app.tasks.get(name), header_eta, properties)
        task = lookup_task(app, name, strict=False)
        store = get_store(app)
        p = prepare(app, store, name, args, kwargs, when, task_id=task_id, task_type=task,
                    options=(task_defaults(task) if task is not None else {}) | opts, eta=header_eta,
                    properties=properties)
        return store_prepared(app, store, [p])[0]
    except _UNSTORABLE as exc:
        return _fall_back(app, name, task_id, f"{type(exc).__name__}: {exc}")


def _fall_back(app: Celery, name: str, task_id: str | None, reason: str) -> None:
    """Let Celery send this delayed call as an ETA message: warn, and count it in the store."""
    logger.warning("%s sent to the broker as an ETA message, not stored by celery-delayed: %s", name, reason)
    try:
        store = get_store(app)
        store.jobs.note_fallback(store.layout.shard_of(task_id or name), name, reason)
    except Exception as exc:  # counting is best effort: the call goes out either way
        logger.warning("could not count the ETA fallback of %s in the store: %s", name, exc)


def _store_retry(app: Celery, name: str, args: Any, kwargs: Any, when: Any, task_id: str, retries: int,
                 opts: dict[str, Any], task_type: Any, eta: str | None,
                 properties: Mapping[str, Any]) -> DelayedResult:
    """Task.retry(countdown=) of any task: the next attempt on the job's record."""
    store = get_store(app)
    headers = opts.get("headers") or {}
    shard = headers.get(SHARD_HEADER) if isinstance(headers, Mapping) else None
    running = app.current_worker_task
    if shard is None and running is not None and running.request.id == task_id:
        s = job_shard(store, running.request)
    else:
        s = _valid_shard(shard, store, store.layout.shard_of(task_id))
    attempt = Attempt(task_id, s, name, retries, args, kwargs, opts, task_type=task_type)
    fields = Failures(app, store).attempt_fields(attempt, retries, eta=eta, properties=properties)
    # The retry of the attempt running here ends that attempt (under its lease): the run then sends no finish.
    end = of_request(running.request) if running is not None and running.request.id == task_id else None
    if end is None or end.store is not store or end.shard != s:
        end = AttemptEnd(store, task_id, s, task_name=name)
    ended = end.retry(due_spec(when, app.timezone), retries, fields)
    outcome = ended.outcome
    if ended.by is not End.RETRY or outcome is None or outcome.code < 0:
        raise InvalidState(task_id, outcome.state if outcome is not None else ended.state, "retry")
    return DelayedResult(task_id, store=store, shard=s, due_ms=outcome.due_ms, created=outcome.code == Reply.OK)


def _valid_shard(value: Any, store: Store, default: int) -> int:
    try:
        s = int(value)
    except (TypeError, ValueError):
        return default
    return s if store.layout.valid_shard(s) else default
