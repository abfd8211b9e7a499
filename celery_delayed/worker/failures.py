"""What a failed attempt becomes: a retry through the store, a dead letter, or FAILED.

:class:`Failures` is the object ``DelayedTask`` calls when its body fails or
asks for a retry; it works on an :class:`Attempt` (what it needs to know of
the failing execution) and a :class:`RetryPolicy` (the task's options), so it
can be used and tested without a Celery task.

A retry is never a broker ETA message: the next attempt's message (same task
id, same arguments, ``retries`` raised) is stored in the job's record and the
job is indexed in its shard's due set again, in one script (``retry.lua``);
the scheduler releases it when it is due. A job that runs out of attempts goes
to the dead-letter queue (``dead.lua``; see
:class:`~celery_delayed.store.DeadLetters`).

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
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery
from celery.utils.saferepr import saferepr

from ..config import DelayedConfig, resolve
from ..errors import ConfigurationError
from ..producer.message import build_message, split_options
from ..store import Store
from ..timeutil import due_spec, eta_iso
from ..vocab import DELAY_HEADER, Field, job_headers
from .backoff import Backoff, rng_for
from .ending import AttemptEnd, End, Ended

logger = logging.getLogger("celery_delayed.retrying")

#: Protocol-2 headers that Celery writes itself; a retry must not copy them
#: from the failing request's headers (they would override the new values).
PROTOCOL_HEADERS = frozenset({
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
    "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
    "replaced_task_nesting", "stamped_headers", "stamps", "compression",
})
#: The backoff options a retry call may override.
BACKOFF_OPTIONS = ("backoff", "backoff_base_s", "backoff_factor", "backoff_cap_s")

_TB_MAX = 32_768  # characters of traceback kept; the tail, where the error is
_MSG_MAX = 4_096
_REPR_MAX = 4_096


@dataclass(frozen=True)
class RetryPolicy:
    """How one task retries: attempts, backoff, which exceptions, what is dead-lettered."""

    max_attempts: int
    backoff: Backoff
    dlq_all_failures: bool = False
    retry_for: tuple[type[BaseException], ...] = ()
    dont_retry_for: tuple[type[BaseException], ...] = ()
    seed: int | None = None

    @classmethod
    def resolve(cls, task: Any, config: DelayedConfig, max_attempts: int | None = None,
                **backoff: Any) -> RetryPolicy:
        """The policy of ``task`` (any object with the task attributes): call > task > setting > default.

        Raises:
            ConfigurationError: a bad value, naming the task.
        """
        name = getattr(task, "name", task)
        try:
            policy = Backoff(*(resolve(backoff.get(k), task, k, config) for k in BACKOFF_OPTIONS))
        except ConfigurationError as exc:
            raise ConfigurationError(f"task {name!r}: {exc}") from exc
        attempts = resolve(max_attempts, task, "max_attempts", config)
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ConfigurationError(f"task {name!r}: max_attempts must be an int >= 1, got {attempts!r}")
        return cls(
            max_attempts=attempts,
            backoff=policy,
            dlq_all_failures=bool(resolve(None, task, "dlq_all_failures", config)),
            retry_for=tuple(getattr(task, "autoretry_for", ()) or ()),
            dont_retry_for=tuple(getattr(task, "dont_autoretry_for", ()) or ()),
            seed=config.backoff_seed,
        )

    def retryable(self, exc: BaseException) -> bool:
        """Whether ``exc`` is retried automatically (``autoretry_for`` minus ``dont_autoretry_for``)."""
        return bool(self.retry_for) and isinstance(exc, self.retry_for) and not (
            self.dont_retry_for and isinstance(exc, self.dont_retry_for))

    def delay_s(self, job_id: str, retry: int, prev_delay_ms: int | None) -> float:
        """The backoff delay before retry number ``retry`` of a job (reproducible with a seed)."""
        prev_s = prev_delay_ms / 1000 if prev_delay_ms is not None else None
        return self.backoff.delay(retry, prev_s, rng_for(self.seed, job_id, retry))


@dataclass(frozen=True)
class Attempt:
    """The failing attempt of a job, as the failure handler needs it.

    ``args``, ``kwargs`` and ``options`` are what the next attempt's message
    is built from (Celery's ``signature_from_request``: the request's own
    arguments and execution options, explicit overrides applied).
    """

    job_id: str
    shard: int
    task_name: str
    number: int  # 1 for the first run (Celery's request.retries + 1)
    args: Sequence[Any]
    kwargs: Mapping[str, Any]
    options: Mapping[str, Any]
    hostname: str = ""
    prev_delay_ms: int | None = None  # the backoff delay before this attempt (decorrelated jitter)
    task_type: Any = None


def exception_fields(exc: BaseException, tb: str | None = None) -> dict[str, str]:
    """Record fields describing an exception: type, message, traceback (bounded)."""
    cls = type(exc)
    if tb is None:
        tb = "".join(traceback.format_exception(cls, exc, exc.__traceback__))
    return {
        Field.ERROR_TYPE: f"{cls.__module__}.{cls.__qualname__}",
        Field.ERROR_MESSAGE: str(exc)[:_MSG_MAX],
        Field.TRACEBACK: tb[-_TB_MAX:],
    }


class Failures:
    """Retries through the store, the dead-letter queue and FAILED, for one app's store."""

    def __init__(self, app: Celery, store: Store) -> None:
        self.app = app
        self.store = store

    def attempt_fields(self, attempt: Attempt, retries: int, extra_headers: Mapping[str, Any] | None = None,
                       eta: str | None = None, properties: Mapping[str, Any] | None = None,
                       **overrides: Any) -> dict[str, str]:
        """Build the message of an attempt of the job and return its record fields.

        ``eta``: the attempt's due time as Celery writes an eta (the task's
        ``request.eta``); ``properties``: more message properties (see
        :func:`~celery_delayed.producer.message.build_message`).
        """
        kept, _ = split_options({**attempt.options, **overrides})  # stamps included
        opts = {k: v for k, v in kept.items() if v is not None}
        headers = {k: v for k, v in dict(opts.pop("headers", None) or {}).items() if k not in PROTOCOL_HEADERS}
        headers.update(extra_headers or {})
        headers.update(job_headers(attempt.shard, self.store.config.key_prefix, eta))
        built = build_message(
            self.app, attempt.task_name, attempt.args, attempt.kwargs, attempt.job_id,
            opts | {"headers": headers}, attempt.task_type, retries=retries,
            max_bytes=self.store.config.max_payload_bytes, properties=properties,
        )
        return {Field.TASK: attempt.task_name, **built.record_fields(self.store.broker)}

    def retry(
        self, attempt: Attempt, end: AttemptEnd, policy: RetryPolicy, exc: BaseException | None = None, *,
        countdown: float | None = None, eta: Any = None,
    ) -> Ended:
        """End the attempt by scheduling the next one at ``eta``, ``countdown`` seconds from now, or
        the backoff delay.

        Returns how the attempt ended: by ``retry.lua`` with its outcome, OK
        (``due_ms`` says when), UNCHANGED (another delivery scheduled it
        already), WRONG_STATE or NOT_OWNER (cancelled, finished, or running
        elsewhere: nothing changed); or as it had ended already.
        """
        delay_ms: int | None = None
        tz = self.app.timezone
        if eta is not None:
            due = due_spec(eta, tz)
            when = eta
        else:
            if countdown is None:
                countdown = policy.delay_s(attempt.job_id, attempt.number, attempt.prev_delay_ms)
            due = due_spec(countdown, tz)
            delay_ms = int(due[1:])
            when = countdown
        extra = {DELAY_HEADER: delay_ms} if delay_ms is not None else {}
        fields = self.attempt_fields(attempt, attempt.number, extra, eta_iso(when, tz))
        if exc is not None:
            fields.update(exception_fields(exc))
            fields.pop(Field.TRACEBACK)  # the traceback is kept for the dead letter only
        fields[Field.HOST] = attempt.hostname
        fields[Field.DELAY] = "" if delay_ms is None else str(delay_ms)
        return end.retry(due, attempt.number, fields)

    def dead_letter(self, attempt: Attempt, end: AttemptEnd, exc: BaseException, tb: str | None = None) -> Ended:
        """End the attempt by moving the job to the dead-letter queue with its arguments, exception and
        traceback; return how the attempt ended."""
        # The dead letter keeps a message ready to requeue: retries back to 0.
        fields = self.attempt_fields(attempt, 0)
        fields.update(exception_fields(exc, tb))
        fields.update({Field.HOST: attempt.hostname, Field.ARGS: saferepr(attempt.args, _REPR_MAX),
                       Field.KWARGS: saferepr(attempt.kwargs, _REPR_MAX), Field.ATTEMPTS: str(attempt.number),
                       Field.DELAY: ""})
        ended = end.dead(fields)
        if ended.by is not End.DEAD or ended.outcome is None or not ended.outcome.ok:
            logger.warning("%s[%s] ran out of attempts but %s: not dead-lettered", attempt.task_name,
                           attempt.job_id, _not_done(ended, End.DEAD))
            return ended
        logger.error("%s[%s] dead-lettered after %s attempt(s): %s", attempt.task_name, attempt.job_id,
                     attempt.number, fields[Field.ERROR_TYPE])
        if self.store.config.dlq_queue:
            self._publish_dead_letter(attempt, fields)
        return ended

    def fail(self, attempt: Attempt, end: AttemptEnd, exc: BaseException, tb: str | None = None) -> Ended:
        """End the attempt by marking the job FAILED (a final failure that is not dead-lettered);
        return how the attempt ended."""
        fields = exception_fields(exc, tb)
        fields[Field.HOST] = attempt.hostname
        ended = end.fail(fields)
        if ended.by is not End.FAIL or ended.outcome is None or not ended.outcome.ok:
            logger.info("%s[%s] failed; %s", attempt.task_name, attempt.job_id, _not_done(ended, End.FAIL))
        return ended

    def _publish_dead_letter(self, attempt: Attempt, fields: Mapping[str, str]) -> None:
        cfg = self.store.config
        letter = {k: fields.get(k, "") for k in (Field.TASK, Field.QUEUE, Field.ERROR_TYPE, Field.ERROR_MESSAGE,
                                                  Field.TRACEBACK, Field.HOST, Field.ARGS, Field.KWARGS,
                                                  Field.ATTEMPTS)}
        letter.update(id=attempt.job_id, shard=str(attempt.shard))
        try:
            self.app.send_task(cfg.dlq_task, kwargs={"letter": json.loads(json.dumps(letter))}, queue=cfg.dlq_queue)
        except Exception:  # the dead letter is stored; the notification is best effort
            logger.exception("could not publish the dead letter of %s to %s", attempt.job_id, cfg.dlq_queue)


def _not_done(ended: Ended, wanted: End) -> str:
    """Why ``ended`` is not the ``wanted`` end done, for a log line."""
    if ended.by is not wanted:
        return f"the attempt had ended already ({ended.by.value}: {ended.state})"
    return f"its record is {ended.outcome.state if ended.outcome is not None else 'unknown'}"
