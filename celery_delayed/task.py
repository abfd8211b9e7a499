"""``DelayedTask``: the Celery task base class of celery-delayed (scheduling and the worker side).

Before the body of a delivered task runs, one script (``lua/start.lua``)
re-reads the job's record (found through the message's ``delayed_shard``
header) and decides, atomically:

==========================  ==============================================
record                      this delivery
==========================  ==============================================
none (plain ``apply_async``  runs, without the ledger
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
:meth:`~celery_delayed.retrying.RetryMixin.delayed_handle_failure` decides
(retry through the store, dead-letter, or FAILED).

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

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from billiard.einfo import ExceptionInfo
from celery import Task, signals
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Reject, Retry
from celery.utils.log import get_task_logger
from redis.exceptions import RedisError

from . import api
from .errors import DelayedError, StoreUnavailable
from .ledger import BUSY, CANCELLED, DONE, RUN, UNTRACKED, Execution, LeaseKeeper, Ledger, owner_token
from .result import DelayedResult
from .retrying import RetryMixin
from .store import get_store

logger = get_task_logger(__name__)

_local = threading.local()  # the running execution, per thread (thread pools share task objects)


def _header_shard(request: Any) -> int | None:
    value = getattr(request, "delayed_shard", None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get("delayed_shard")
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


class DelayedTask(RetryMixin, Task):  # type: ignore[misc]
    """Base class for tasks scheduled with ``apply_later``; safe under at-least-once delivery.

    Example::

        @app.task(base=DelayedTask, acks_late=True)
        def remind(user_id): ...

        h = remind.apply_later(args=(42,), when=timedelta(minutes=5))
        h.cancel()

    Task attributes read by celery-delayed: ``max_lateness`` (seconds) and
    ``misfire`` ("run", "skip", "dead"), see :mod:`celery_delayed.misfire`.
    The worker side is described in this module's docstring.
    """

    abstract = True
    #: Seconds a job may be released after its due time before ``misfire`` applies (None: no limit).
    max_lateness: float | None = None
    #: What to do with a job released later than ``max_lateness``: "run", "skip" or "dead".
    misfire: str | None = None

    def apply_later(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        when: object = 0,
        **options: Any,
    ) -> DelayedResult:
        """Schedule this task for ``when``; see :func:`celery_delayed.apply_later`."""
        return api.apply_later(self._get_app(), self.name, args, kwargs, when, **options)

    def apply_later_many(self, calls: Iterable[Mapping[str, Any]]) -> list[DelayedResult]:
        """Schedule many calls of this task in few round trips.

        Each item is a mapping of ``apply_later`` keyword arguments::

            remind.apply_later_many({"args": (uid,), "when": 60} for uid in users)
        """
        return api.apply_later_many(self._get_app(), self.name, calls)

    # -- worker side -----------------------------------------------------------

    @property
    def delayed_execution(self) -> Execution | None:
        """The execution of this job running in this thread (its lease owner), or None."""
        return getattr(_local, "execution", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body under the job's ledger (see the module docstring)."""
        req = self.request
        if req.called_directly or req.is_eager or not req.id:
            return super().__call__(*args, **kwargs)
        ledger = Ledger(get_store(self._get_app()))
        shard = _header_shard(req)
        if shard is None:  # not sent by the store; a retry may still have given it a record
            shard = ledger.store.shard_of(req.id)
        props = getattr(req, "properties", None) or {}
        tag = props.get("delivery_tag") or (req.delivery_info or {}).get("delivery_tag") or ""
        owner = owner_token(req.hostname or "", tag)
        try:
            started = self._delayed_start(ledger, req.id, shard, owner, req.hostname or "")
        except StoreUnavailable as exc:
            return self._delayed_store_down(exc, args, kwargs)
        if started.code == UNTRACKED:
            return super().__call__(*args, **kwargs)
        if started.code == CANCELLED:
            logger.info("Discarding cancelled job %s[%s]", self.name, req.id)
            self._delayed_announce_revoked()
            raise Ignore()
        if started.code != RUN:
            why = "completed already" if started.code == DONE else f"its job is {started.state}"
            logger.info("Skipping %s[%s]: %s (duplicate delivery)", self.name, req.id, why)
            raise Ignore()
        execution = Execution(req.id, shard, owner, started.attempt, str(tag))
        req.delayed_owner = owner  # retrying.py passes it to its scripts, which check the lease
        return self._delayed_run(ledger, execution, args, kwargs)

    def _delayed_store_down(self, exc: StoreUnavailable, args: Any, kwargs: Any) -> Any:
        # With acks_late the message can go back to the queue: do that (after a
        # pause, so an outage does not become a hot loop) rather than run blind.
        # Acknowledged early, this delivery is the only copy left: run it untracked.
        if self.acks_late:
            logger.error("Store unavailable, requeueing %s[%s]: %s", self.name, self.request.id, exc)
            time.sleep(1.0)
            raise Reject(exc, requeue=True)
        logger.error("Store unavailable, running %s[%s] without the ledger: %s", self.name, self.request.id, exc)
        return super().__call__(*args, **kwargs)

    def _delayed_finish(self, ledger: Ledger, ex: Execution, outcome: str, reason: str = "") -> tuple[int, str]:
        # The body's outcome stands even if it cannot be recorded; the lease then
        # passes and a later redelivery may run the body again (documented).
        try:
            return ledger.finish(ex, outcome, reason)
        except (DelayedError, RedisError) as exc:
            logger.error("Could not record %s of %s[%s]: %s", outcome, self.name, ex.job_id, exc)
            return 0, ""

    def _delayed_start(self, ledger: Ledger, job_id: str, shard: int, owner: str, hostname: str) -> Any:
        started = ledger.start(job_id, shard, owner, hostname)
        if started.code == BUSY:
            logger.info("Job %s[%s] is running elsewhere: waiting for it to end or its lease to pass",
                        self.name, job_id)
        poll_s = max(ledger.lease_ms / 3000.0, 0.05)
        while started.code == BUSY:
            time.sleep(poll_s)
            started = ledger.start(job_id, shard, owner, hostname)
        return started

    def _delayed_run(self, ledger: Ledger, ex: Execution, args: Any, kwargs: Any) -> Any:
        keeper = LeaseKeeper(ledger, ex).start()
        _local.execution = ex
        try:
            result = super().__call__(*args, **kwargs)
        except Retry:  # Celery's own retry sent a new message: the next delivery may start it
            keeper.stop()
            self._delayed_finish(ledger, ex, "QUEUED")
            raise
        except Reject as exc:
            keeper.stop()
            self._delayed_finish(ledger, ex, "QUEUED" if exc.requeue else "FAILED", reason=f"rejected: {exc.reason!r}")
            raise
        except Ignore:  # the body chose to end here: that is its completion
            keeper.stop()
            self._delayed_finish(ledger, ex, "SUCCEEDED")
            raise
        except Exception as exc:
            keeper.stop()
            try:
                self.delayed_handle_failure(exc, ExceptionInfo())
            finally:
                # A failure nobody handled must not hold the job RUNNING until the lease passes.
                self._delayed_finish(ledger, ex, "FAILED", reason=f"{type(exc).__name__}: {exc}"[:1000])
            raise
        finally:
            keeper.stop()
            _local.execution = None
        code, state = self._delayed_finish(ledger, ex, "SUCCEEDED")
        if code < 0:
            logger.warning("Job %s[%s] finished, but its record says %s: not marked SUCCEEDED",
                           self.name, ex.job_id, state)
        return result

    def _delayed_announce_revoked(self) -> None:
        """Do what Celery's worker does for a revoked request (``Request._announce_revoked``)."""
        req = self.request
        if self.send_events:
            try:
                self.send_event("task-revoked", terminated=False, signum=None, expired=False)
            except Exception:  # monitoring is best effort; the skip itself stands
                logger.warning("could not send the task-revoked event of %s", req.id, exc_info=True)
        ignore_result = bool(req.ignore_result) or bool(self.ignore_result)
        store_errors = self.store_errors_even_if_ignored or not ignore_result
        if not isinstance(self.backend, DisabledBackend):
            self.backend.mark_as_revoked(req.id, "revoked", request=req, store_result=store_errors)
        signals.task_revoked.send(sender=self, request=req, terminated=False, signum=None, expired=False)
