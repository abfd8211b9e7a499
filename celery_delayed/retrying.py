"""Retries through the store and the dead-letter queue (worker side).

Interface shared with ``task.py``: ``DelayedTask`` inherits :class:`RetryMixin`
and calls :meth:`RetryMixin.delayed_handle_failure` when the task body raises.

A retry is never a broker ETA message: the next attempt's message (same task
id, same arguments, ``retries`` raised) is stored in the job's record and the
job is indexed in its shard's due set again, in one script (``retry.lua``);
the scheduler releases it when it is due. A job that runs out of attempts goes
to the dead-letter queue (``dead.lua``, see :mod:`celery_delayed.dlq`).

Options resolve as Celery's ``Task.from_config`` does: call option > task
attribute > ``delayed_*`` setting > default.

======================== ============================== ======================================
task attribute           setting                        meaning
======================== ============================== ======================================
``max_attempts``         ``delayed_max_attempts``       attempts in all (first run + retries)
``backoff``              ``delayed_backoff``            policy: exponential, equal,
                                                        decorrelated, fixed
``backoff_base_s``       ``delayed_backoff_base_s``     first delay before jitter
``backoff_factor``       ``delayed_backoff_factor``     growth per retry
``backoff_cap_s``        ``delayed_backoff_cap_s``      longest delay
``dlq_all_failures``     ``delayed_dlq_all_failures``   dead-letter non-retryable failures too
======================== ============================== ======================================

Celery's ``max_retries`` given to ``retry()`` (or in ``retry_kwargs``) means
``max_attempts = max_retries + 1``; Celery's ``autoretry_for`` and
``dont_autoretry_for`` choose which exceptions are retried.
"""

from __future__ import annotations

import json
import logging
import threading
import traceback
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from celery import Celery, Task
from celery.exceptions import Ignore, MaxRetriesExceededError, Reject, Retry
from celery.utils.saferepr import saferepr

from .backoff import Backoff, rng_for
from .errors import ConfigurationError, InvalidOption
from .message import MESSAGE_OPTIONS, BuiltMessage, build_message
from .store import Store, get_store
from .timeutil import due_spec, from_ms

logger = logging.getLogger("celery_delayed.retrying")

#: Protocol-2 headers that Celery writes itself; a retry must not copy them
#: from the failing request's headers (they would override the new values).
PROTOCOL_HEADERS = frozenset({
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
    "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
    "replaced_task_nesting", "stamped_headers", "stamps", "compression",
})
#: Headers celery-delayed adds to a job's message.
SHARD_HEADER = "delayed_shard"
DELAY_HEADER = "delayed_backoff_ms"  # the delay before this attempt (decorrelated jitter)

_TB_MAX = 32_768  # characters of traceback kept; the tail, where the error is
_MSG_MAX = 4_096
_REPR_MAX = 4_096
_RETRY_FAILED = (-1, -3)
_handled = threading.local()  # (job id, exception) that retry_later dead-lettered already


def header(request: Any, name: str) -> Any:
    """A custom message header of the running request, or None."""
    value = getattr(request, name, None)
    if value is None:
        headers = getattr(request, "headers", None)
        if isinstance(headers, Mapping):
            value = headers.get(name)
    return value


def _setting(task: Any, call: Any, attr: str, default: Any) -> Any:
    if call is not None:
        return call
    value = getattr(task, attr, None)
    return default if value is None else value


def resolve_backoff(task: Any, config: Any, **call: Any) -> Backoff:
    """The backoff policy of one retry: call option > task attribute > setting > default."""
    try:
        return Backoff(
            policy=_setting(task, call.get("backoff"), "backoff", config.backoff),
            base_s=_setting(task, call.get("backoff_base_s"), "backoff_base_s", config.backoff_base_s),
            factor=_setting(task, call.get("backoff_factor"), "backoff_factor", config.backoff_factor),
            cap_s=_setting(task, call.get("backoff_cap_s"), "backoff_cap_s", config.backoff_cap_s),
        )
    except ConfigurationError as exc:
        raise ConfigurationError(f"task {getattr(task, 'name', task)!r}: {exc}") from exc


def resolve_max_attempts(task: Any, config: Any, max_attempts: int | None = None) -> int:
    """Attempts in all for one job: call option > task attribute > setting > default."""
    value = _setting(task, max_attempts, "max_attempts", config.max_attempts)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"task {getattr(task, 'name', task)!r}: max_attempts must be an int >= 1, got {value!r}"
        )
    return int(value)


def exception_fields(exc: BaseException, tb: str | None = None) -> dict[str, str]:
    """Record fields describing an exception: type, message, traceback (bounded)."""
    cls = type(exc)
    if tb is None:
        tb = "".join(traceback.format_exception(cls, exc, exc.__traceback__))
    return {
        "etype": f"{cls.__module__}.{cls.__qualname__}",
        "emsg": str(exc)[:_MSG_MAX],
        "tb": tb[-_TB_MAX:],
    }


def message_fields(store: Store, built: BuiltMessage) -> dict[str, str]:
    """Record fields for a (re)built message: routing, envelope, push destination."""
    fields = {
        "task": "", "q": built.route.queue, "ex": built.route.exchange, "rk": built.route.routing_key,
        "msg": built.body, "lk": "", "bx": "", "ps": "", "ev": "",
    }
    if store.direct:
        fields.update(built.destination(store.app.conf))
    if built.sent_event is not None:
        from kombu.utils.json import dumps

        fields["ev"] = dumps(built.sent_event)
    return fields


def build_attempt(
    app: Celery, store: Store, name: str, args: Sequence[Any], kwargs: Mapping[str, Any],
    task_id: str, shard: int, options: Mapping[str, Any], task_type: Any, retries: int,
    extra_headers: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Build the message of one attempt of a job and return its record fields."""
    opts = {k: v for k, v in options.items() if k in MESSAGE_OPTIONS and v is not None}
    headers = {k: v for k, v in dict(opts.pop("headers", None) or {}).items() if k not in PROTOCOL_HEADERS}
    headers.update(extra_headers or {})
    headers[SHARD_HEADER] = shard
    built = build_message(
        app, name, args, kwargs, task_id, opts | {"headers": headers}, task_type,
        retries=retries, max_bytes=store.config.max_payload_bytes,
    )
    fields = message_fields(store, built)
    fields["task"] = name
    return fields


def _flatten(fields: Mapping[str, str]) -> list[str]:
    names = list(fields)
    return [str(len(names)), *names, *(str(fields[n]) for n in names)]


def store_retry(
    store: Store, job_id: str, shard: int, due: str, retries: int, fields: Mapping[str, str],
    *, owner: str = "", started_ms: int | None = None, now_ms: int | None = None,
) -> tuple[int, str, int]:
    """Run ``retry.lua``: store the next attempt and index it at ``due`` ('<ms>' or '+<ms>').

    Returns (code, previous state, due ms); codes as documented in ``retry.lua``.
    """
    sk = store.keys.shard(shard)
    reply = store._run(
        store.scripts.retry,
        [sk.due, sk.buckets, sk.next, sk.inflight, sk.job(job_id)],
        [job_id, due, store.config.bucket_ms, store.keys.wake, shard,
         "" if now_ms is None else now_ms, retries, "" if started_ms is None else started_ms, owner,
         *_flatten(fields)],
    )
    return int(reply[0]), str(reply[1]), int(reply[2])


def store_dead(
    store: Store, job_id: str, shard: int, fields: Mapping[str, str],
    *, owner: str = "", started_ms: int | None = None, now_ms: int | None = None,
) -> tuple[int, str, int]:
    """Run ``dead.lua``: the job becomes DEAD and enters the dead-letter queue (trimmed).

    Returns (code, previous state, letters trimmed); codes as in ``dead.lua``.
    """
    cfg = store.config
    sk = store.keys.shard(shard)
    per_shard = -(-cfg.dlq_max_len // cfg.shards)  # ceil: the bound is over all shards
    reply = store._run(
        store.scripts.dead,
        [sk.job(job_id), sk.dlq, sk.inflight],
        [job_id, "" if now_ms is None else now_ms, sk.job_prefix, cfg.dlq_max_age_s * 1000, per_shard,
         "" if started_ms is None else started_ms, owner, *_flatten(fields)],
    )
    return int(reply[0]), str(reply[1]), int(reply[2])


def store_fail(
    store: Store, job_id: str, shard: int, fields: Mapping[str, str],
    *, owner: str = "", started_ms: int | None = None, now_ms: int | None = None,
) -> tuple[int, str]:
    """Run ``fail.lua``: the job becomes FAILED (its record expires after the record ttl)."""
    sk = store.keys.shard(shard)
    reply = store._run(
        store.scripts.fail,
        [sk.inflight, sk.job(job_id)],
        [job_id, "" if now_ms is None else now_ms, store.config.record_ttl_ms,
         "" if started_ms is None else started_ms, owner, *_flatten(fields)],
    )
    return int(reply[0]), str(reply[1])


class RetryMixin:
    """Adds ``retry_later`` and failure handling (backoff, dead-letter queue) to a task.

    Example::

        @app.task(base=DelayedTask, bind=True, autoretry_for=(IOError,),
                  max_attempts=5, backoff="equal", backoff_base_s=2)
        def fetch(self, url): ...

        @app.task(base=DelayedTask, bind=True)
        def pay(self, order_id):
            try:
                charge(order_id)
            except Busy as exc:
                self.retry_later(exc=exc)            # backoff delay
            except RateLimited as exc:
                self.retry_later(exc=exc, countdown=exc.retry_after)
    """

    #: Attempts in all (None: ``delayed_max_attempts``).
    max_attempts: int | None = None
    #: Backoff policy and its parameters (None: the ``delayed_backoff*`` settings).
    backoff: str | None = None
    backoff_base_s: float | None = None
    backoff_factor: float | None = None
    backoff_cap_s: float | None = None
    #: Dead-letter every final failure, not only exhausted retries (None: setting).
    dlq_all_failures: bool | None = None

    # -- helpers ---------------------------------------------------------------

    def _delayed_store(self) -> Store:
        task: Any = self
        return get_store(task._get_app())

    def _delayed_shard(self, store: Store) -> int:
        task: Any = self
        shard = header(task.request, SHARD_HEADER)
        try:
            s = int(shard)
        except (TypeError, ValueError):
            return store.shard_of(task.request.id)
        return s if 0 <= s < store.config.shards else store.shard_of(task.request.id)

    def _delayed_in_worker(self) -> bool:
        req = self.request  # type: ignore[attr-defined]
        return not (req.called_directly or req.is_eager)

    def _delayed_owner(self) -> str:
        # The worker side's execution token, when DelayedTask took a lease.
        return str(getattr(self.request, "delayed_owner", "") or "")  # type: ignore[attr-defined]

    def _delayed_options(self, args: Any, kwargs: Any, **options: Any) -> tuple[Any, Any, dict[str, Any]]:
        # What Celery's Task.retry would send: the request's execution options,
        # its queue/exchange, its priority; explicit options win.
        task: Any = self
        sig = task.signature_from_request(task.request, args, kwargs, **options)
        return sig.args, sig.kwargs, dict(sig.options)

    # -- retries ---------------------------------------------------------------

    def retry(
        self, args: Any = None, kwargs: Any = None, exc: BaseException | None = None, throw: bool = True,
        eta: datetime | None = None, countdown: float | None = None, max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``Task.retry``, through the store: same arguments, no ETA message.

        ``max_retries`` (as Celery counts: retries after the first run) sets
        ``max_attempts = max_retries + 1`` for this call. Without ``countdown``
        or ``eta`` the delay comes from the backoff policy (not
        ``default_retry_delay``).
        """
        if not self._delayed_in_worker():
            return Task.retry(self, args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        if max_retries is not None and options.get("max_attempts") is None:
            options["max_attempts"] = max_retries + 1
        return self.retry_later(exc=exc, countdown=countdown, eta=eta, args=args, kwargs=kwargs,
                                throw=throw, **options)

    def retry_later(
        self, exc: BaseException | None = None, countdown: float | None = None, **options: Any
    ) -> Any:
        """Schedule the next attempt of the running job through the store (not as an ETA message).

        Raises Celery's ``Retry`` (the run ends as RETRY, as with
        ``Task.retry``). When the job has used its attempts, it goes to the
        dead-letter queue and ``exc`` (or ``MaxRetriesExceededError``) is raised.

        Args:
            exc: the exception that caused the retry (kept in the record).
            countdown: seconds until the next attempt (default: the backoff
                policy's delay for this retry).
            **options: ``eta`` (a datetime, instead of countdown), ``args``,
                ``kwargs`` (change the next attempt's arguments), ``max_attempts``,
                ``backoff``, ``backoff_base_s``, ``backoff_factor``,
                ``backoff_cap_s``, ``throw`` (False: return the Retry instead of
                raising it), and message options (queue, priority, ...).
        """
        task: Any = self
        eta = options.pop("eta", None)
        throw = options.pop("throw", True)
        new_args, new_kwargs = options.pop("args", None), options.pop("kwargs", None)
        policy = {k: options.pop(k, None) for k in ("backoff", "backoff_base_s", "backoff_factor", "backoff_cap_s")}
        max_attempts = options.pop("max_attempts", None)
        unknown = set(options) - MESSAGE_OPTIONS
        if unknown:
            raise InvalidOption(
                f"retry_later got unknown option(s) {sorted(unknown)}; it accepts exc, countdown, eta, args, "
                f"kwargs, max_attempts, backoff, backoff_base_s, backoff_factor, backoff_cap_s, throw "
                f"and the message options {sorted(MESSAGE_OPTIONS)}"
            )
        if not self._delayed_in_worker():
            return Task.retry(task, new_args, new_kwargs, exc, throw, eta, countdown,
                              None if max_attempts is None else max_attempts - 1, **options)
        request = task.request
        store = self._delayed_store()
        cfg = store.config
        attempt = int(request.retries or 0) + 1  # the attempt that is failing now
        if attempt >= resolve_max_attempts(task, cfg, max_attempts):
            final = exc if exc is not None else MaxRetriesExceededError(
                f"can't retry {task.name}[{request.id}]: {attempt} attempts used"
            )
            self._delayed_bury(final, None, attempt)
            raise final
        shard = self._delayed_shard(store)
        delay_ms: int | None = None
        if eta is not None:
            due = due_spec(eta, task._get_app().timezone)
        else:
            if countdown is None:
                prev = header(request, DELAY_HEADER)
                prev_s = float(prev) / 1000 if isinstance(prev, (int, float)) else None
                countdown = resolve_backoff(task, cfg, **policy).delay(
                    attempt, prev_s, rng_for(cfg.backoff_seed, request.id, attempt))
            due = due_spec(countdown, task._get_app().timezone)
            delay_ms = int(due[1:])
        args, kwargs, opts = self._delayed_options(new_args, new_kwargs, **options)
        extra = {DELAY_HEADER: delay_ms} if delay_ms is not None else {}
        fields = build_attempt(task._get_app(), store, task.name, args, kwargs, request.id, shard,
                               opts, task, attempt, extra)
        if exc is not None:
            fields.update(exception_fields(exc))
            fields.pop("tb")  # the traceback is kept for the dead letter only
        fields["host"] = str(request.hostname or "")
        fields["delay"] = "" if delay_ms is None else str(delay_ms)
        code, state, due_ms = store_retry(store, request.id, shard, due, attempt, fields,
                                          owner=self._delayed_owner())
        if code in _RETRY_FAILED:
            logger.warning("not retrying %s[%s]: the job is %s", task.name, request.id, state)
            raise Ignore()
        logger.info("retry %s of %s[%s] scheduled for %s", attempt, task.name, request.id, from_ms(due_ms))
        ret = Retry(exc=exc, when=from_ms(due_ms))
        if throw:
            raise ret
        return ret

    # -- failures ----------------------------------------------------------------

    def delayed_retryable(self, exc: BaseException) -> bool:
        """Whether ``exc`` is retried automatically (Celery's ``autoretry_for`` minus ``dont_autoretry_for``)."""
        retry_for = tuple(getattr(self, "autoretry_for", ()) or ())
        dont = tuple(getattr(self, "dont_autoretry_for", ()) or ())
        return bool(retry_for) and isinstance(exc, retry_for) and not (dont and isinstance(exc, dont))

    def delayed_handle_failure(self, exc: BaseException, einfo: Any) -> None:
        """Called by ``DelayedTask`` when the body raised: retry, dead-letter, or mark FAILED.

        Raises ``Retry`` when the job is retried through the store; returns
        None when the failure is final (the job is DEAD or FAILED), and the
        caller re-raises ``exc``.
        """
        task: Any = self
        if isinstance(exc, (Retry, Ignore, Reject)) or not self._delayed_in_worker():
            return
        handled = getattr(_handled, "last", None)
        _handled.last = None
        if handled is not None and handled[0] == task.request.id and handled[1] is exc:
            return  # retry_later dead-lettered it already
        store = self._delayed_store()
        retryable = self.delayed_retryable(exc)
        if retryable:
            attempt = int(task.request.retries or 0) + 1
            if attempt < resolve_max_attempts(task, store.config):
                self.retry_later(exc=exc)
            self._delayed_bury(exc, einfo, attempt)
            return
        if _setting(task, None, "dlq_all_failures", store.config.dlq_all_failures):
            self._delayed_bury(exc, einfo, int(task.request.retries or 0) + 1)
            return
        self._delayed_fail(exc, einfo)

    def _failure_fields(self, exc: BaseException, einfo: Any) -> dict[str, str]:
        tb = getattr(einfo, "traceback", None)
        fields = exception_fields(exc, tb if isinstance(tb, str) else None)
        fields["host"] = str(self.request.hostname or "")  # type: ignore[attr-defined]
        return fields

    def _delayed_fail(self, exc: BaseException, einfo: Any) -> None:
        task: Any = self
        store = self._delayed_store()
        code, state = store_fail(store, task.request.id, self._delayed_shard(store),
                                 self._failure_fields(exc, einfo), owner=self._delayed_owner())
        if code < 0:
            logger.info("%s[%s] failed; its record stays %s", task.name, task.request.id, state)

    def _delayed_bury(self, exc: BaseException, einfo: Any, attempts: int) -> None:
        """Dead-letter the running job (idempotent for one request)."""
        task: Any = self
        request = task.request
        # Task.__call__ pushes its own request context and pops it before the
        # caller sees the exception: remember it per thread, not on the request.
        _handled.last = (request.id, exc)
        store = self._delayed_store()
        shard = self._delayed_shard(store)
        # The dead letter keeps a message ready to requeue: retries back to 0.
        args, kwargs, opts = self._delayed_options(None, None)
        fields = build_attempt(task._get_app(), store, task.name, args, kwargs, request.id, shard,
                               opts, task, 0)
        fields.update(self._failure_fields(exc, einfo))
        fields.update(args=saferepr(args, _REPR_MAX), kwargs=saferepr(kwargs, _REPR_MAX),
                      attempts=str(attempts), delay="")
        code, state, _trimmed = store_dead(store, request.id, shard, fields, owner=self._delayed_owner())
        if code < 0:
            logger.warning("%s[%s] ran out of attempts but its record is %s: not dead-lettered",
                           task.name, request.id, state)
            return
        logger.error("%s[%s] dead-lettered after %s attempt(s): %s", task.name, request.id, attempts,
                     fields["etype"])
        if store.config.dlq_queue:
            self._publish_dead_letter(store, shard, fields)

    def _publish_dead_letter(self, store: Store, shard: int, fields: Mapping[str, str]) -> None:
        task: Any = self
        cfg = store.config
        letter = {k: fields.get(k, "") for k in ("task", "q", "etype", "emsg", "tb", "host", "args",
                                                  "kwargs", "attempts")}
        letter.update(id=task.request.id, shard=str(shard))
        try:
            task._get_app().send_task(cfg.dlq_task, kwargs={"letter": json.loads(json.dumps(letter))},
                                      queue=cfg.dlq_queue)
        except Exception:  # the dead letter is stored; the notification is best effort
            logger.exception("could not publish the dead letter of %s to %s", task.request.id, cfg.dlq_queue)
