"""Running a released job under its execution record: the part of the worker side every task shares.

:func:`run_tracked` is what ``DelayedTask.__call__`` does, and what every
other task does when its message came from the store (it names its shard):
``start.lua`` decides (run, skip a cancelled, done or superseded delivery,
wait while another execution holds the lease), a heartbeat keeps the lease,
and the attempt ends with one store call (:mod:`.ending`): ``finish.lua``
records the outcome, unless the body or its failure handling ended the
attempt already (a retry, a dead letter, a final failure). So a plain task
given to ``apply_later`` or intercepted from ``apply_async(countdown=)`` is
tracked too: the reconciler knows it started, a cancel after release skips
it, a redelivery of a completed one is a no-op.

:func:`track_plain_tasks` gives the tasks of an app that are not
``DelayedTask`` a ``__call__`` that does this for store messages only; a
message sent without the store runs exactly as before, unless it is an ETA
message the store holds as a job (:func:`held_by_store`: one absorbed from
the broker), which is dropped. It runs in worker
processes (``worker_init``, connected by the ``delayed`` entry point), before
Celery builds its tracers.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from celery import Celery, Task, signals
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Reject, Retry

from ..errors import StoreUnavailable
from ..store import Started, Store
from ..vocab import GENERATION_HEADER, JobState, request_header, request_shard
from .ending import REQUEST_ATTR, AttemptEnd, Ended
from .execution import Execution, LeaseKeeper, delivery_tag, execution_token, job_shard, job_store

logger = logging.getLogger("celery_delayed.worker")

#: The request attribute that carries the running execution (Celery copies the
#: request's attributes into the context the body sees).
EXECUTION_ATTR = "delayed_execution"
_TRACKED = "_celery_delayed_tracked"

Body = Callable[..., Any]
OnFailure = Callable[[BaseException, Any], Ended | None]


def from_store(request: Any) -> bool:
    """Whether a delivered message was released from a celery-delayed store (it names its shard)."""
    return request_shard(request) is not None


def held_by_store(task: Task) -> bool:
    """Whether the delivered message is an ETA message the store holds as a job: a copy to drop.

    ``delayed absorb`` stores a broker's ETA message as a job under its own
    task id before it takes the message from the broker, so a copy may still
    reach a worker (absorbing was stopped between the two, or a consumer took
    it meanwhile): the store releases the job when due, and this copy must
    not run too. Only a message with an eta that did not come from the store
    is asked about (one round trip); any other runs as it always did.
    """
    req = task.request
    if from_store(req) or not req.eta or not req.id:
        return False
    store = job_store(task._get_app(), req)
    return bool(store.lookup.locate_many([req.id]))


def _skip_held(task: Task) -> None:
    """Drop a copy of a message the store holds (see :func:`held_by_store`): acknowledged, never run."""
    logger.info("Skipping %s[%s]: an ETA message the store holds as a job (absorbed); the store releases it "
                "when due", task.name, task.request.id)
    raise Ignore()


def run_tracked(task: Task, body: Body, args: Any, kwargs: Any, on_failure: OnFailure | None = None) -> Any:
    """Run ``body(*args, **kwargs)`` for the job ``task.request`` delivers, under the job's execution record.

    ``on_failure(exc, einfo)`` (DelayedTask's retry / dead-letter / fail)
    runs when the body raises and has not ended the attempt itself; it ends
    the attempt and returns how (or raises ``Retry``). Without it, or when it
    returns None, the failure is recorded as FAILED.
    """
    req = task.request
    store = job_store(task._get_app(), req)
    shard = job_shard(store, req)
    tag = delivery_tag(req)
    owner = execution_token(req.hostname or "", tag)
    try:
        if held_by_store(task):
            _skip_held(task)
        started = _start(task, store, req.id, shard, owner, req.hostname or "")
    except StoreUnavailable as exc:
        return _store_down(task, exc, body, args, kwargs)
    if started.untracked:
        return body(*args, **kwargs)
    if started.cancelled:
        logger.info("Discarding cancelled job %s[%s]", task.name, req.id)
        announce_revoked(task)
        raise Ignore()
    if not started.run:
        why = ("completed already" if started.state == JobState.SUCCEEDED
               else "superseded by a later generation of its job" if started.superseded
               else f"its job moved to another shard (a reshard) and is {started.state} there"
               if started.why == "moved"
               else f"its job is {started.state}")
        logger.info("Skipping %s[%s]: %s (duplicate delivery)", task.name, req.id, why)
        raise Ignore()
    execution = Execution(req.id, shard, owner, started.attempt, tag)
    end = AttemptEnd(store, req.id, shard, owner, task.name)
    # The body's request context copies these attributes: retry_later finds the attempt there.
    setattr(req, EXECUTION_ATTR, execution)
    setattr(req, REQUEST_ATTR, end)
    try:
        return _run(task, store, execution, end, body, args, kwargs, on_failure)
    finally:
        setattr(req, EXECUTION_ATTR, None)
        setattr(req, REQUEST_ATTR, None)


def _start(task: Task, store: Store, job_id: str, shard: int, owner: str, hostname: str) -> Started:
    gen = request_header(task.request, GENERATION_HEADER)
    generation = int(gen) if isinstance(gen, int) and not isinstance(gen, bool) else 0
    started = store.executions.start(job_id, shard, owner, hostname, generation=generation)
    if started.busy:
        logger.info("Job %s[%s] is running elsewhere: waiting for it to end or its lease to pass", task.name, job_id)
    poll_s = max(store.config.exec_lease_ms / 3000.0, 0.05)
    while started.busy:
        time.sleep(poll_s)
        started = store.executions.start(job_id, shard, owner, hostname, generation=generation)
    return started


def _store_down(task: Task, exc: StoreUnavailable, body: Body, args: Any, kwargs: Any) -> Any:
    # With acks_late the message can go back to the queue: do that (after a
    # pause, so an outage does not become a hot loop) rather than run blind.
    # Acknowledged early, this delivery is the only copy left: run it untracked.
    if task.acks_late:
        logger.error("Store unavailable, requeueing %s[%s]: %s", task.name, task.request.id, exc)
        time.sleep(1.0)
        raise Reject(exc, requeue=True)
    logger.error("Store unavailable, running %s[%s] without the execution record: %s", task.name, task.request.id, exc)
    return body(*args, **kwargs)


def _run(task: Task, store: Store, ex: Execution, end: AttemptEnd, body: Body, args: Any, kwargs: Any,
         on_failure: OnFailure | None) -> Any:
    from billiard.einfo import ExceptionInfo

    # Every way out ends the attempt through `end`, which makes one store call: when the
    # body already ended it (a retry through the store, a dead letter when its retries ran
    # out), the finish below is not sent.
    keeper = LeaseKeeper(store, ex).start()
    try:
        result = body(*args, **kwargs)
    except Retry:  # through the store: ended; else Celery sent a new message, which may start it
        keeper.stop()
        end.finish(JobState.QUEUED)
        raise
    except Reject as exc:
        keeper.stop()
        end.finish(JobState.QUEUED if exc.requeue else JobState.FAILED, f"rejected: {exc.reason!r}")
        raise
    except Ignore:  # the body chose to end here: that is its completion
        keeper.stop()
        end.finish(JobState.SUCCEEDED)
        raise
    except Exception as exc:
        keeper.stop()
        try:
            if on_failure is not None and end.ended is None:
                on_failure(exc, ExceptionInfo())
        finally:
            # A failure nobody recorded must not hold the job RUNNING until the lease passes.
            end.finish(JobState.FAILED, f"{type(exc).__name__}: {exc}"[:1000])
        raise
    finally:
        keeper.stop()
    end.finish(JobState.SUCCEEDED)
    return result


def announce_revoked(task: Task) -> None:
    """Do what Celery's worker does for a revoked request (``Request._announce_revoked``)."""
    req = task.request
    if task.send_events:
        try:
            task.send_event("task-revoked", terminated=False, signum=None, expired=False)
        except Exception:  # monitoring is best effort; the skip itself stands
            logger.warning("could not send the task-revoked event of %s", req.id, exc_info=True)
    ignore_result = bool(req.ignore_result) or bool(task.ignore_result)
    store_errors = task.store_errors_even_if_ignored or not ignore_result
    if not isinstance(task.backend, DisabledBackend):
        task.backend.mark_as_revoked(req.id, "revoked", request=req, store_result=store_errors)
    signals.task_revoked.send(sender=task, request=req, terminated=False, signum=None, expired=False)


def _tracked_call(call: Body) -> Body:
    @functools.wraps(call)
    def __call__(self: Task, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        if req.called_directly or req.is_eager or not req.id:
            return call(self, *args, **kwargs)
        if not from_store(req):
            try:
                held = held_by_store(self)
            except StoreUnavailable as exc:
                return _store_down(self, exc, functools.partial(call, self), args, kwargs)
            if held:
                _skip_held(self)
            return call(self, *args, **kwargs)
        return run_tracked(self, functools.partial(call, self), args, kwargs)

    setattr(__call__, _TRACKED, True)
    return __call__


def track_plain_tasks(app: Celery) -> int:
    """Give every task of ``app`` that is not a ``DelayedTask`` the store's execution record for store messages.

    Returns how many task classes it changed (idempotent).
    """
    n = 0
    for task in list(app.tasks.values()):
        cls = type(task)
        if getattr(cls, "delayed_tracks_itself", False) or getattr(cls.__call__, _TRACKED, False):
            continue
        cls.__call__ = _tracked_call(cls.__call__)
        n += 1
    return n


def on_worker_init(sender: Any = None, **_: Any) -> None:
    """``worker_init`` receiver: track the plain tasks of the worker's app (before its tracers are built)."""
    app = getattr(sender, "app", None)
    if app is not None:
        track_plain_tasks(app)
