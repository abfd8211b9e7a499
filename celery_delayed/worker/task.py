"""``DelayedTask``: the Celery task base class of celery-delayed (scheduling and the worker side).

Before the body of a delivered task runs, one script (``lua/start.lua``)
re-reads the job's record (found through the message's ``delayed_shard``
header) and decides, atomically:

==========================  ==============================================
record                      this delivery
==========================  ==============================================
none (plain ``apply_async``  runs, without the execution record
or an expired record)
CANCELLED                   skipped and acknowledged, announced as revoked
                            exactly as Celery's own revoke does: a
                            ``task-revoked`` event, REVOKED in the result
                            backend, the ``task_revoked`` signal
SUCCEEDED (the done marker) skipped and acknowledged (a redelivery of a
                            completed job is a no-op)
RUNNING, live lease         waits, holding its message, until that
                            execution ends (then skipped) or its lease
                            passes (then it takes over and runs)
QUEUED / CLAIMED, or        takes the execution lease: RUNNING, ``att`` + 1,
RUNNING with a passed lease and runs the body; a heartbeat thread extends
                            the lease every third of ``delayed_exec_lease_ms``
FAILED, DEAD, EXPIRED,      skipped and acknowledged (SCHEDULED: a stale
SKIPPED, SCHEDULED          delivery of a job scheduled again for a retry)
==========================  ==============================================

On success ``lua/finish.lua`` marks the job SUCCEEDED; the record stays as
its done marker for ``delayed_done_ttl_s`` (``delayed_idempotency_ttl_s``
when longer and the job has an idempotency key). When the body raises,
:class:`~celery_delayed.worker.failures.Failures` decides (retry through the
store, dead-letter, or FAILED).

Why a duplicate delivery waits instead of being dropped: with the Redis
broker, a message redelivered after ``visibility_timeout`` has the same
delivery tag as the one still running, so acknowledging the duplicate also
drops the running one's safety net; a worker that then died would lose the
job. The waiting duplicate keeps it, and runs the job itself if the lease
passes.

What is guaranteed (see docs/guarantees-worker.md, each case tested with
real worker processes):

- The body of a job runs to a successful end at most once, however many
  times its message is delivered (redelivery after ``visibility_timeout``,
  at-least-once publish, a copy pushed by hand), as long as the done marker
  lives (``delayed_done_ttl_s``).
- Two executions of one job never overlap while the running one's worker is
  alive (its heartbeat keeps the lease).
- A crash inside the body (worker killed, lost connection) may repeat it:
  once the lease passes, a redelivery (``acks_late`` with the Redis broker's
  visibility timeout, or ``task_reject_on_worker_lost``) takes over and runs
  the body again from the start; ``att`` counts the executions begun.
- A job cancelled before its execution began never runs; a RUNNING job is
  not cancelled (``cancel`` raises InvalidState, ``h.cancel()`` is False)
  unless ``terminate=True``, which Celery honours in the prefork pool only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from celery import Task
from celery.exceptions import Ignore, MaxRetriesExceededError, Reject, Retry
from celery.utils.log import get_task_logger

from .. import api
from ..config import get_config
from ..errors import InvalidOption
from ..producer.message import MESSAGE_OPTIONS
from ..result import DelayedResult
from ..store import Store
from ..timeutil import from_ms
from ..vocab import DELAY_HEADER, Reply, request_header
from .ending import AttemptEnd, End, Ended, of_request
from .execution import Execution, job_shard, job_store
from .failures import BACKOFF_OPTIONS, Attempt, Failures, RetryPolicy
from .tracking import EXECUTION_ATTR, run_tracked

logger = get_task_logger(__name__)

_RETRY_LATER_OPTIONS = ("eta", "throw", "args", "kwargs", "max_attempts", *BACKOFF_OPTIONS)


class DelayedTask(Task):  # type: ignore[misc]
    """Base class for tasks scheduled with ``apply_later``; safe under at-least-once delivery.

    Example::

        @app.task(base=DelayedTask, bind=True, acks_late=True, autoretry_for=(IOError,),
                  max_attempts=5, backoff="equal", backoff_base_s=2)
        def remind(self, user_id): ...

        h = remind.apply_later(args=(42,), when=timedelta(minutes=5))
        h.cancel()

    Task attributes read by celery-delayed: ``max_lateness`` and ``misfire``
    (see :mod:`celery_delayed.producer.misfire`), and the retry options below
    (see :mod:`celery_delayed.worker.failures`). The worker side is described
    in this module's docstring.
    """

    abstract = True
    #: Its ``__call__`` runs the execution record itself (``tracking.track_plain_tasks`` leaves it alone).
    delayed_tracks_itself = True
    #: Seconds a job may be released after its due time before ``misfire`` applies (None: no limit).
    max_lateness: float | None = None
    #: What to do with a job released later than ``max_lateness``: "run", "skip" or "dead".
    misfire: str | None = None
    #: Attempts in all (None: ``delayed_max_attempts``).
    max_attempts: int | None = None
    #: Backoff policy and its parameters (None: the ``delayed_backoff*`` settings).
    backoff: str | None = None
    backoff_base_s: float | None = None
    backoff_factor: float | None = None
    backoff_cap_s: float | None = None
    #: Dead-letter every final failure, not only exhausted retries (None: setting).
    dlq_all_failures: bool | None = None
    #: Seconds after its due time in which each job of this task is placed, at an offset its id decides
    #: (``spread=`` of ``apply_later``; None: none).
    delayed_spread: float | None = None

    # -- scheduling --------------------------------------------------------------

    def apply_later(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        when: object = 0,
        **options: Any,
    ) -> DelayedResult:
        """Schedule this task for ``when``; see :func:`celery_delayed.apply_later`."""
        return api.apply_later(self._get_app(), self.name, args, kwargs, when, **options)

    def apply_later_on_commit(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        when: object = 0,
        *,
        using: str | None = None,
        **options: Any,
    ) -> DelayedResult | None:
        """Schedule this task when the current Django transaction commits (as Celery's ``apply_async_on_commit``).

        With ``delayed_database_url`` (the same database as Django's
        ``using`` connection) the job's row is written in the transaction now
        and indexed in Redis at its ``on_commit``: a rolled-back transaction
        leaves no job, a committed one always gets it (a process that dies
        right after the commit leaves the row to the scheduler). The handle is
        returned (``indexed`` False until the commit: see ``DelayedResult``).
        Without a database the whole ``apply_later`` runs at ``on_commit`` and
        None is returned, as Celery's ``delay_on_commit`` does.
        """
        from django.db import DEFAULT_DB_ALIAS, connections, transaction

        alias = using or DEFAULT_DB_ALIAS
        app = self._get_app()
        if get_config(app).database_url:
            return api.apply_later(app, self.name, args, kwargs, when, connection=connections[alias], **options)
        transaction.on_commit(lambda: self.apply_later(args, kwargs, when, **options), using=alias)
        return None

    def apply_later_many(self, calls: Iterable[Mapping[str, Any]], *,
                         spread: float | timedelta | None = None,
                         tenant: str | None = None) -> list[DelayedResult]:
        """Schedule many calls of this task in few round trips.

        Each item is a mapping of ``apply_later`` keyword arguments::

            remind.apply_later_many({"args": (uid,), "when": 60} for uid in users)

        ``spread``: a window after each call's ``when`` in which its job is
        placed; ``tenant``: every call's tenant (a call's own wins; see
        :func:`celery_delayed.apply_later`).
        """
        return api.apply_later_many(self._get_app(), self.name, calls, spread=spread, tenant=tenant)

    # -- worker side -------------------------------------------------------------

    @property
    def delayed_execution(self) -> Execution | None:
        """The execution of this job running in this thread (its lease owner), or None."""
        return getattr(self.request, EXECUTION_ATTR, None)

    def _delayed_store(self) -> Store:
        return job_store(self._get_app(), self.request)

    def _delayed_in_worker(self) -> bool:
        req = self.request
        return not (req.called_directly or req.is_eager) and bool(req.id)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body under the job's execution record (see the module docstring and :mod:`.tracking`)."""
        if not self._delayed_in_worker():
            return super().__call__(*args, **kwargs)
        return run_tracked(self, super().__call__, args, kwargs, on_failure=self.delayed_handle_failure)

    # -- retries and failures -------------------------------------------------------

    def _delayed_attempt(self, store: Store, args: Any = None, kwargs: Any = None, **options: Any) -> Attempt:
        """The running attempt, with what Celery's ``Task.retry`` would send next (explicit options win)."""
        req = self.request
        sig = self.signature_from_request(req, args, kwargs, **options)
        prev = request_header(req, DELAY_HEADER)
        return Attempt(
            job_id=req.id, shard=job_shard(store, req), task_name=self.name, number=int(req.retries or 0) + 1,
            args=sig.args, kwargs=sig.kwargs, options=dict(sig.options), hostname=str(req.hostname or ""),
            prev_delay_ms=int(prev) if isinstance(prev, (int, float)) and not isinstance(prev, bool) else None,
            task_type=self,
        )

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
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
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
        own = {k: options.pop(k, None) for k in _RETRY_LATER_OPTIONS}
        throw = own["throw"] is not False
        unknown = set(options) - MESSAGE_OPTIONS
        if unknown:
            raise InvalidOption(
                f"retry_later got unknown option(s) {sorted(unknown)}; it accepts exc, countdown, eta, args, "
                f"kwargs, max_attempts, backoff, backoff_base_s, backoff_factor, backoff_cap_s, throw "
                f"and the message options {sorted(MESSAGE_OPTIONS)}"
            )
        if not self._delayed_in_worker():
            attempts = own["max_attempts"]
            return super().retry(own["args"], own["kwargs"], exc, throw, own["eta"], countdown,
                                 None if attempts is None else attempts - 1, **options)
        store = self._delayed_store()
        policy = RetryPolicy.resolve(self, store.config, own["max_attempts"],
                                     **{k: own[k] for k in BACKOFF_OPTIONS})
        attempt = self._delayed_attempt(store, own["args"], own["kwargs"], **options)
        end = self._delayed_end(store, attempt)
        failures = Failures(self._get_app(), store)
        if attempt.number >= policy.max_attempts:
            final = exc if exc is not None else MaxRetriesExceededError(
                f"can't retry {self.name}[{attempt.job_id}]: {attempt.number} attempts used"
            )
            # The dead letter keeps the request's own message (the one requeue sends again).
            failures.dead_letter(self._delayed_attempt(store), end, final)
            raise final
        ended = failures.retry(attempt, end, policy, exc, countdown=countdown, eta=own["eta"])
        outcome = ended.outcome if ended.by is End.RETRY else None
        if outcome is None or outcome.code in (Reply.WRONG_STATE, Reply.NOT_OWNER):
            # cancelled, finished, running elsewhere, or this attempt had ended otherwise
            state = outcome.state if outcome is not None else f"{ended.state} ({ended.by.value})"
            logger.warning("not retrying %s[%s]: the job is %s", self.name, attempt.job_id, state)
            raise Ignore()
        logger.info("retry %s of %s[%s] scheduled for %s", attempt.number, self.name, attempt.job_id,
                    from_ms(outcome.due_ms))
        ret = Retry(exc=exc, when=from_ms(outcome.due_ms))
        if throw:
            raise ret
        return ret

    def delayed_handle_failure(self, exc: BaseException, einfo: Any) -> Ended | None:
        """Called when the body raised: end the attempt with a retry through the store, a dead letter, or FAILED.

        Returns how the attempt ended when the failure is final (the job is
        DEAD or FAILED; the caller re-raises ``exc``); None when ``exc`` is
        not a failure this decides (``Retry``, ``Ignore``, ``Reject``) or the
        task runs outside a worker. Raises ``Retry`` when the job is retried
        through the store (the attempt has ended then too).
        """
        if isinstance(exc, (Retry, Ignore, Reject)) or not self._delayed_in_worker():
            return None
        store = self._delayed_store()
        policy = RetryPolicy.resolve(self, store.config)
        if policy.retryable(exc) and int(self.request.retries or 0) + 1 < policy.max_attempts:
            self.retry_later(exc=exc)  # raises Retry (or Ignore when the job cannot be retried)
        attempt = self._delayed_attempt(store)
        end = self._delayed_end(store, attempt)
        failures = Failures(self._get_app(), store)
        if policy.retryable(exc) or policy.dlq_all_failures:
            return failures.dead_letter(attempt, end, exc, _traceback(einfo))
        return failures.fail(attempt, end, exc, _traceback(einfo))

    def _delayed_end(self, store: Store, attempt: Attempt) -> AttemptEnd:
        """What ends the running attempt: the tracked execution's, else one for this call (no lease)."""
        end = of_request(self.request)
        if end is not None and end.job_id == attempt.job_id and end.store is store:
            return end
        return AttemptEnd(store, attempt.job_id, attempt.shard, task_name=self.name)


def _traceback(einfo: Any) -> str | None:
    """The formatted traceback of Celery's ``ExceptionInfo`` (None: format the exception's own)."""
    tb = getattr(einfo, "traceback", None)
    return tb if isinstance(tb, str) else None
