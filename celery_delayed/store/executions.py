"""The worker's side: the execution record of each job (start, lease, finish) and how an attempt ends.

:meth:`Executions.start` takes a job's execution lease before its task runs;
:meth:`Executions.finish` records the outcome of an attempt that succeeded;
an attempt that failed ends in exactly one of :meth:`Executions.retry`,
:meth:`Executions.dead` or :meth:`Executions.fail`, each of which also gives
the lease back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import JobNotFound, ReplicationTimeout
from ..vocab import Field, Reply
from .facet import Facet
from .layout import ShardLayout
from .loader import Arg, Script
from .lookup import Lookup
from .records import Outcome, Started
from .runner import Runner

logger = logging.getLogger("celery_delayed.worker")

#: After the replicas failed to acknowledge a record in time, the worker writes its records without
#: ``WAIT`` for this long: a master left with no replica (a failover) must not slow every run by the bound.
RECORD_WAIT_PAUSE_S = 10.0


def _flatten(fields: Mapping[str, str]) -> list[str]:
    """Record fields as the scripts take them: count, names, values."""
    names = list(fields)
    return [str(len(names)), *names, *(str(fields[n]) for n in names)]


class Executions(Facet):
    """Each job's execution: its lease while it runs, and how each attempt ended."""

    SCRIPTS = ("start", "extend_lease", "finish", "retry", "fail", "dead")

    def __init__(self, redis: Runner, layout: ShardLayout, lookup: Lookup) -> None:
        super().__init__(redis, layout)
        self.lookup = lookup
        self._unwaited_until = 0.0  # monotonic: till then the records are written without WAIT

    def _write(self, script: Script, keys: Sequence[str], args: Sequence[Arg], what: str) -> Any:
        """One execution-record write; with ``delayed_wait_replicas``, followed by ``WAIT``.

        A run's records must survive a failover as the schedule did: a start
        or finish the promoted replica never received would let the job run
        again. When the replicas do not acknowledge in time, the write stands
        on the master (the attempt goes on), a warning says so, and for
        :data:`RECORD_WAIT_PAUSE_S` the records are written without ``WAIT``.
        """
        if not self.config.wait_replicas or time.monotonic() < self._unwaited_until:
            return self.redis.run(script, keys, args)
        try:
            return self.redis.run_many(script, [(keys, args)], wait=what)[0]
        except ReplicationTimeout as exc:
            if exc.results is None:
                raise
            self._unwaited_until = time.monotonic() + RECORD_WAIT_PAUSE_S
            logger.warning("%s; the worker writes its records without waiting for the replicas for the next %.0f s",
                           exc, RECORD_WAIT_PAUSE_S)
            return exc.results[0]

    def start(
        self, job_id: str, shard: int, owner: str, hostname: str = "", now_ms: int | None = None,
        generation: int = 0,
    ) -> Started:
        """Take the job's execution lease if it may run now (``start.lua``).

        ``generation`` is the delivered message's (its ``delayed_gen`` header).
        """
        shard_keys = self.keys.shard(shard)
        keys = [shard_keys.job(job_id), shard_keys.released, shard_keys.changes]
        args: list[Arg] = [self.redis.now_arg(now_ms), owner, self.config.exec_lease_ms, hostname, generation or "",
                           job_id, self.redis.logs_changes]
        if self.config.wait_replicas:
            reply = self._write(self.redis.scripts.start, keys, args, f"recording the start of job {job_id}")
        else:
            reply = self.redis.lane().call(self.redis.scripts.start, keys, args)
        code, state, attempt, until, why = reply
        if int(code) == Reply.NOT_FOUND:
            moved = self._moved_record(job_id, shard)
            if moved is not None:  # an old message of a job a reshard moved: not this delivery's to run
                return Started(Reply.WRONG_STATE, moved, 0, 0, "moved")
        return Started(Reply(int(code)), str(state), int(attempt), int(until), str(why))

    def _moved_record(self, job_id: str, shard: int) -> str | None:
        """The state of ``job_id``'s record in a shard other than ``shard`` (a reshard moved it), or None.

        A job moves only while it is scheduled or finished, and a moved job is
        released again from its new shard with a message that names it: so a
        message naming the old shard is never the one to run.
        """
        try:
            found = self.lookup.locate(job_id)
        except JobNotFound:
            return None
        if found == shard:
            return None
        state = self.redis.client.hget(self.keys.shard(found).job(job_id), Field.STATE)
        return None if state is None else str(state)

    def extend_lease(
        self, job_id: str, shard: int, owner: str, delivery_tag: str = "", now_ms: int | None = None,
    ) -> bool:
        """Push a running job's lease deadline on (``extend_lease.lua``); False when the lease is lost.

        On the direct path it also refreshes the message's entry in kombu's
        unacked index, so a task running longer than ``visibility_timeout`` is
        not redelivered while its lease is alive.
        """
        keys = [self.keys.shard(shard).job(job_id)]
        args: list[Arg] = [self.redis.now_arg(now_ms), owner, self.config.exec_lease_ms]
        if self.broker.unacked_index and delivery_tag:
            keys.append(self.broker.unacked_index)
            args += [delivery_tag, repr(time.time())]  # kombu scores with the worker's own clock
        code, _state, _until = self.redis.run(self.redis.scripts.extend_lease, keys, args)
        return int(code) == Reply.OK

    def finish(
        self, job_id: str, shard: int, owner: str, outcome: str, reason: str = "", now_ms: int | None = None,
    ) -> Outcome:
        """Record an execution's ``outcome`` (SUCCEEDED, FAILED or QUEUED) and give the lease back (``finish.lua``).

        The outcome's code is OK, NOT_FOUND (no record) or NOT_OWNER (the
        lease is not this owner's any more; state = the job's state).
        """
        code, state = self._write(*self._finish(job_id, shard, owner, outcome, reason, now_ms),
                                  f"recording the end of job {job_id}")
        return Outcome(Reply(int(code)), str(state))

    def finish_later(
        self, job_id: str, shard: int, owner: str, outcome: str, reason: str = "",
        on_outcome: Callable[[Outcome | Exception], None] | None = None,
    ) -> None:
        """:meth:`finish` without waiting for the reply: the script is sent at once (Redis runs it
        as it reads it), its reply is read with this thread's next store call and passed
        to ``on_outcome`` (an :class:`Outcome`, or the exception the call raised).

        With ``delayed_wait_replicas`` it is :meth:`finish` (written, then
        ``WAIT``), before this returns: the record must reach the replicas."""
        if self.config.wait_replicas:
            try:
                result: Outcome | Exception = self.finish(job_id, shard, owner, outcome, reason)
            except Exception as exc:  # the caller logs what could not be recorded
                result = exc
            if on_outcome is not None:
                on_outcome(result)
            return

        def reply(raw: Any) -> None:
            if on_outcome is None:
                return
            if isinstance(raw, Exception):
                on_outcome(raw)
            else:
                on_outcome(Outcome(Reply(int(raw[0])), str(raw[1])))

        self.redis.lane().send(*self._finish(job_id, shard, owner, outcome, reason, None), on_reply=reply)

    def drain_replies(self) -> None:
        """Read the replies of this thread's :meth:`finish_later` calls now."""
        self.redis.lane().drain()

    def _finish(
        self, job_id: str, shard: int, owner: str, outcome: str, reason: str, now_ms: int | None,
    ) -> tuple[Script, list[str], list[Arg]]:
        """``finish.lua`` with its keys and arguments."""
        cfg = self.config
        shard_keys = self.keys.shard(shard)
        return (self.redis.scripts.finish, [shard_keys.job(job_id), shard_keys.changes],
                [self.redis.now_arg(now_ms), owner, outcome, cfg.done_ttl_s * 1000, cfg.idempotency_ttl_s * 1000,
                 reason, job_id, self.redis.logs_changes])

    # -- failures and the dead-letter queue ------------------------------------------------

    def retry(
        self, job_id: str, shard: int, due: str, retries: int, fields: Mapping[str, str], *,
        owner: str = "", started_ms: int | None = None, now_ms: int | None = None,
    ) -> Outcome:
        """Store the next attempt and index it at ``due`` ('<ms>' or '+<ms>', ``retry.lua``).

        The outcome's code is OK, UNCHANGED (scheduled already), WRONG_STATE
        (cancelled or finished) or NOT_OWNER (running under another lease).
        """
        shard_keys = self.keys.shard(shard)
        code, state, due_ms = self._write(
            self.redis.scripts.retry,
            [shard_keys.due, shard_keys.buckets, shard_keys.next, shard_keys.inflight, shard_keys.job(job_id),
             shard_keys.released, shard_keys.changes],
            [self.redis.now_arg(now_ms), job_id, due, self.config.bucket_ms, self.keys.wake, shard, retries,
             self.redis.now_arg(started_ms), owner, self.redis.logs_changes, *_flatten(fields)],
            f"scheduling the next attempt of job {job_id}",
        )
        return Outcome(Reply(int(code)), str(state), due_ms=int(due_ms))

    def fail(
        self, job_id: str, shard: int, fields: Mapping[str, str], *,
        owner: str = "", started_ms: int | None = None, now_ms: int | None = None,
    ) -> Outcome:
        """Mark the job FAILED (``fail.lua``); its record expires after the record ttl."""
        shard_keys = self.keys.shard(shard)
        code, state = self._write(
            self.redis.scripts.fail, [shard_keys.inflight, shard_keys.job(job_id), shard_keys.released,
                                      shard_keys.changes],
            [self.redis.now_arg(now_ms), job_id, self.config.record_ttl_ms, self.redis.now_arg(started_ms), owner,
             self.redis.logs_changes, *_flatten(fields)],
            f"recording the failure of job {job_id}",
        )
        return Outcome(Reply(int(code)), str(state))

    def dead(
        self, job_id: str, shard: int, fields: Mapping[str, str], *,
        owner: str = "", started_ms: int | None = None, now_ms: int | None = None,
    ) -> Outcome:
        """Move the job to the dead-letter queue (``dead.lua``), trimmed by age and count."""
        cfg = self.config
        shard_keys = self.keys.shard(shard)
        code, state, dropped = self._write(
            self.redis.scripts.dead, [shard_keys.job(job_id), shard_keys.dlq, shard_keys.inflight,
                                      shard_keys.released, shard_keys.changes],
            [self.redis.now_arg(now_ms), job_id, shard_keys.job_prefix, cfg.dlq_max_age_s * 1000,
             cfg.dlq_max_len_per_shard,
             self.redis.now_arg(started_ms), owner, self.redis.logs_changes, *_flatten(fields)],
            f"dead-lettering job {job_id}",
        )
        return Outcome(Reply(int(code)), str(state), dropped=int(dropped))
