"""The store: jobs in sharded Redis sorted sets, changed only by Lua scripts.

A job record (``{p}:{s}:job:<id>``, a hash) holds:

=========  ==============================================================
st         SCHEDULED, CLAIMED (publish path, in flight), QUEUED, CANCELLED
           (later states are written by the worker side)
due        due time, epoch ms
created    when it was scheduled, epoch ms (Redis clock)
released   when it was pushed or published, epoch ms
cancelled  when it was cancelled, epoch ms
task       task name
q, ex, rk  queue, exchange and routing key
msg        the kombu envelope, until the job is released
lk         direct path: the list key to push to (anonymous exchange)
bx, ps     direct path, named exchange: its binding set, priority suffix
ev         the task-sent event fields (JSON) when the app sends them
sk         the shard key, when one was given
ik         the idempotency key, when one was given
claims     publish path: how many times it was claimed
exp        Celery's ``expires``, epoch ms: not sent when released at or after it
ml, mf     max lateness (ms) and misfire policy ('skip' or 'dead'; absent =
           run anyway), checked at release (``misfire.py``)
reason     why it was not sent or did not finish (EXPIRED, SKIPPED, DEAD ...)
att        executions begun (start.lua increments it; 1 = the first run)
lo, lu     execution lease of a RUNNING job: owner token
           ("<hostname>|<pid>|<delivery tag>|<nonce>") and deadline, epoch ms;
           the worker's heartbeat (extend_lease.lua) pushes the deadline on
started    when the latest execution began, epoch ms
wk         hostname of the worker that ran it last
finished   when it SUCCEEDED / FAILED / was EXPIRED or SKIPPED, epoch ms
retries    retries scheduled (the ``retries`` header of its message; retry.lua)
first_at,  when the first and the latest failed attempt began, epoch ms
last_at
etype,     the last failure: exception type (module.Class), message, and (FAILED
emsg, tb   / DEAD only) traceback
host       hostname of the worker where it last failed
delay      the backoff delay of the pending retry, ms
died       when it was dead-lettered, epoch ms (DEAD; indexed in the dlq set)
args,      DEAD: the arguments (saferepr), and the attempts made
kwargs,
attempts
requeued,  how often it was requeued from the dead-letter queue, and when last
requeued_at
=========  ==============================================================

Worker-side states (task.py): QUEUED or CLAIMED -> RUNNING (start.lua takes
the execution lease) -> SUCCEEDED (finish.lua; the record is the done
marker) | FAILED | DEAD | SCHEDULED again for a retry (retrying.py). At
release: EXPIRED (``expires`` passed), SKIPPED or DEAD (released later than
``max_lateness`` with misfire 'skip' or 'dead').

A released or cancelled record expires after ``delayed_record_ttl_s``; a
SUCCEEDED one after ``delayed_done_ttl_s`` (``delayed_idempotency_ttl_s``
when longer and the job has an idempotency key).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import Celery
from kombu.transport.virtual.base import Channel as VirtualChannel
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .config import DelayedConfig, get_config
from .errors import ConfigurationError, InvalidOption, InvalidState, JobNotFound, LeaseLost, StoreUnavailable
from .keys import Keys, shard_for
from .scripts import Script, scripts

#: Record fields a new job may carry, in the order schedule.lua receives them.
RECORD_FIELDS = ("task", "q", "ex", "rk", "msg", "lk", "bx", "ps", "ev", "sk", "ik", "exp", "ml", "mf")
_STATES_CANCELLABLE = ("SCHEDULED", "CLAIMED", "QUEUED")


@dataclass(frozen=True)
class NewJob:
    """One job to schedule: its id, shard, due spec ('<ms>' or '+<ms>') and record fields."""

    id: str
    shard: int
    due: str
    fields: Mapping[str, str]
    #: fields this job shares with others (the same object for all of them):
    #: a hint that lets :meth:`Store.schedule` send them once per call.
    common: Mapping[str, str] | None = None


@dataclass(frozen=True)
class Scheduled:
    """The outcome of scheduling one job."""

    id: str
    shard: int
    due_ms: int
    created: bool  # False: a record with this id was there already
    state: str


@dataclass
class Batch:
    """The outcome of one release or claim call on a shard."""

    ok: bool
    count: int = 0
    skipped: int = 0
    next_due_ms: int | None = None
    now_ms: int = 0
    ids: list[str] = field(default_factory=list)
    events: list[dict[str, Any] | None] = field(default_factory=list)
    # publish path only: per job (msg, exchange, routing_key, queue)
    messages: list[tuple[str, str, str, str]] = field(default_factory=list)


def _errors_as_unavailable(exc: Exception, url: str) -> StoreUnavailable:
    # Refused or timed out while connecting: the command never left. Lost while
    # reading the reply: it may have run (a frozen server wakes up and runs it).
    sent = "connecting" not in str(exc).lower()
    outcome = (
        "the command may have reached Redis, so it may or may not have been written; calling "
        "again with the same task_id (DuplicateJob: it was) or idempotency_key is safe"
        if sent else "nothing was written"
    )
    return StoreUnavailable(
        f"cannot reach the celery-delayed store at {_redact(url)}: {exc}; {outcome}. "
        "Check that Redis is running and delayed_redis_url (or broker_url) points at it"
    )


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@")
    return url


def _same_redis(a: str, b: str) -> bool:
    pa, pb = urlsplit(a), urlsplit(b)
    if pa.scheme in ("unix", "socket") or pb.scheme in ("unix", "socket"):
        return pa.path == pb.path
    if pa.scheme not in ("redis", "rediss") or pb.scheme not in ("redis", "rediss"):
        return False

    def db(p: Any) -> str:
        return (p.path or "/0").lstrip("/") or "0"

    host = {"localhost": "127.0.0.1"}
    return (
        host.get(pa.hostname or "localhost", pa.hostname) == host.get(pb.hostname or "localhost", pb.hostname)
        and (pa.port or 6379) == (pb.port or 6379)
        and db(pa) == db(pb)
    )


class Store:
    """The delayed-job store of one Celery app."""

    def __init__(
        self, app: Celery, config: DelayedConfig | None = None, client: redis.Redis | None = None
    ) -> None:
        self.app = app
        self.config = config or get_config(app)
        self.client: redis.Redis = client or redis.Redis.from_url(
            self.config.redis_url, decode_responses=True, health_check_interval=30
        )
        self.keys = Keys(self.config.key_prefix)
        self.scripts = scripts()
        self.direct = self._resolve_direct()
        self._layout_ok = False

    def check_layout(self) -> None:
        """Refuse a store created with other ``delayed_shards`` or ``delayed_bucket_ms``.

        Both decide which keys hold a job: a producer and a scheduler that
        disagree would leave jobs where no scheduler looks. The first user of a
        prefix records them; later ones must match. Checked once per Store.

        Raises:
            ConfigurationError: the settings differ from the store's.
            StoreUnavailable: Redis cannot be reached.
        """
        if self._layout_ok:
            return
        want = {"shards": str(self.config.shards), "bucket_ms": str(self.config.bucket_ms)}
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, value in want.items():
                pipe.hsetnx(self.keys.layout, name, value)
            pipe.hmget(self.keys.layout, list(want))
            got = pipe.execute()[-1]
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _errors_as_unavailable(exc, self.config.redis_url) from exc
        for (name, value), held in zip(want.items(), got, strict=True):
            if held != value:
                raise ConfigurationError(
                    f"delayed_{name} is {value}, but the store under prefix {self.config.key_prefix!r} "
                    f"was created with {held}: every producer and scheduler of one store must use the "
                    "same delayed_shards and delayed_bucket_ms (use another delayed_key_prefix to change them)"
                )
        self._layout_ok = True

    def _resolve_direct(self) -> bool:
        mode = self.config.release_mode
        if mode != "auto":
            return mode == "direct"
        broker = self.app.conf.broker_url or ""
        if isinstance(broker, (list, tuple)):
            broker = broker[0] if broker else ""
        return bool(broker) and _same_redis(broker, self.config.redis_url)

    # -- helpers -------------------------------------------------------------

    def shard_of(self, job_id: str, shard_key: str | None = None) -> int:
        """The shard a job lives in: ``crc32(shard_key or job_id) % delayed_shards``."""
        return shard_for(shard_key or job_id, self.config.shards)

    def _run(self, script: Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return script(self.client, keys, args)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _errors_as_unavailable(exc, self.config.redis_url) from exc

    def now_ms(self) -> int:
        """The Redis server's clock, epoch ms."""
        try:
            sec, usec = self.client.time()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _errors_as_unavailable(exc, self.config.redis_url) from exc
        return int(sec) * 1000 + int(usec) // 1000

    # -- scheduling ----------------------------------------------------------

    def schedule(self, jobs: Sequence[NewJob], now_ms: int | None = None) -> list[Scheduled]:
        """Store jobs: one script call per shard, all shards in one round trip.

        Returns one :class:`Scheduled` per job, in order. A job whose id is
        taken keeps the record that was there (``created`` is False).
        """
        self.check_layout()
        # One call per shard and set of shared fields; the shared fields go
        # once per call, the others once per job.
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            groups[(job.shard, id(job.common))].append(i)
        calls: list[tuple[int, list[str], list[str]]] = []
        order: list[list[int]] = []
        for (shard, _), idx in groups.items():
            sk = self.keys.shard(shard)
            common = jobs[idx[0]].common or {}
            shared = [x for f in RECORD_FIELDS if common.get(f) for x in (f, common[f])]
            present = set().union(*(jobs[i].fields.keys() for i in idx))
            own = [f for f in RECORD_FIELDS
                   if f in present and f not in common and any(jobs[i].fields.get(f) for i in idx)]
            args = [sk.job_prefix, str(self.config.bucket_ms), self.keys.wake, str(shard),
                    "" if now_ms is None else str(now_ms), str(len(shared) // 2), *shared, str(len(own)), *own]
            if own == ["msg"]:
                for i in idx:
                    job = jobs[i]
                    args += (job.id, job.due, job.fields["msg"])
            else:
                for i in idx:
                    job = jobs[i]
                    args += [job.id, job.due, *(job.fields.get(f, "") for f in own)]
            calls.append((shard, [sk.due, sk.buckets, sk.next], args))
            order.append(idx)
        replies = self._run_many(self.scripts.schedule, [(k, a) for _, k, a in calls])
        out: list[Scheduled | None] = [None] * len(jobs)
        for (shard, _, _), idx, reply in zip(calls, order, replies, strict=True):
            for i, entry in zip(idx, reply, strict=True):
                if entry.startswith("="):
                    out[i] = Scheduled(jobs[i].id, shard, int(entry[1:]), True, "SCHEDULED")
                else:
                    state, _, due = entry.partition("|")
                    out[i] = Scheduled(jobs[i].id, shard, int(float(due or 0)), False, state)
        return [s for s in out if s is not None]

    def _run_many(self, script: Script, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]) -> list[Any]:
        if len(calls) == 1:
            return [self._run(script, *calls[0])]
        try:
            results: list[Any] = [None] * len(calls)
            todo = list(range(len(calls)))
            for _attempt in range(2):
                pipe = self.client.pipeline(transaction=False)
                for i in todo:
                    script.queue(pipe, *calls[i])
                replies = pipe.execute(raise_on_error=False)
                retry = []
                for i, reply in zip(todo, replies, strict=True):
                    if isinstance(reply, NoScriptError):
                        retry.append(i)
                    elif isinstance(reply, Exception):
                        raise reply
                    else:
                        results[i] = reply
                if not retry:
                    return results
                script.ensure_loaded(self.client)
                todo = retry
            raise RuntimeError(f"script {script.name} could not be loaded")
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _errors_as_unavailable(exc, self.config.redis_url) from exc

    # -- single-job operations ----------------------------------------------

    def locate(self, job_id: str, shard: int | None = None) -> int:
        """Return the shard holding ``job_id``; raise :class:`JobNotFound`.

        Tries the given shard, then the id's own shard, then (a job scheduled
        with a ``shard_key``) every shard in one round trip.

        Raises:
            InvalidOption: ``job_id`` is not a non-empty string.
        """
        if not isinstance(job_id, str) or not job_id:
            raise InvalidOption(f"a job id must be a non-empty string, got {type(job_id).__name__} {job_id!r}")
        tried = []
        for s in (shard, self.shard_of(job_id)):
            if s is not None and s not in tried:
                tried.append(s)
                if self.client.exists(self.keys.shard(s).job(job_id)):
                    return s
        pipe = self.client.pipeline(transaction=False)
        for s in range(self.config.shards):
            pipe.exists(self.keys.shard(s).job(job_id))
        for s, hit in enumerate(pipe.execute()):
            if hit:
                return s
        raise JobNotFound(job_id)

    def states(self, jobs: Sequence[NewJob]) -> list[str | None]:
        """The state of each job's record (None: there is none), in one round trip."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for job in jobs:
                pipe.hget(self.keys.shard(job.shard).job(job.id), "st")
            return [None if st is None else str(st) for st in pipe.execute()]
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _errors_as_unavailable(exc, self.config.redis_url) from exc

    def get(self, job_id: str, shard: int | None = None) -> dict[str, str]:
        """Return the job's record (without its message) or raise :class:`JobNotFound`."""
        try:
            s = self.locate(job_id, shard)
            rec = {str(k): str(v) for k, v in self.client.hgetall(self.keys.shard(s).job(job_id)).items()}
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _errors_as_unavailable(exc, self.config.redis_url) from exc
        if not rec:
            raise JobNotFound(job_id)
        rec.pop("msg", None)
        rec["id"], rec["shard"] = job_id, str(s)
        return rec

    def cancel(
        self, job_id: str, shard: int | None = None, now_ms: int | None = None, running: bool = False,
    ) -> str:
        """Cancel a job; return the state it had (SCHEDULED, CLAIMED or QUEUED).

        ``running=True`` cancels a RUNNING job too (returns "RUNNING"): for a
        caller that also terminates the execution.

        Raises:
            JobNotFound: no such job.
            InvalidState: it is running, finished or cancelled already.
        """
        try:
            s = self.locate(job_id, shard)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _errors_as_unavailable(exc, self.config.redis_url) from exc
        sk = self.keys.shard(s)
        code, state = self._run(
            self.scripts.cancel,
            [sk.due, sk.buckets, sk.inflight, sk.job(job_id)],
            [job_id, self.config.bucket_ms, "" if now_ms is None else now_ms, self.config.record_ttl_ms,
             "1" if running else ""],
        )
        if code == 0:
            raise JobNotFound(job_id)
        if code < 0:
            raise InvalidState(job_id, state, "cancel")
        return str(state)

    def reschedule(self, job_id: str, due: str, shard: int | None = None, now_ms: int | None = None) -> int:
        """Move a scheduled job to ``due`` ('<ms>' or '+<ms>'); return the new due ms."""
        try:
            s = self.locate(job_id, shard)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _errors_as_unavailable(exc, self.config.redis_url) from exc
        sk = self.keys.shard(s)
        reply = self._run(
            self.scripts.reschedule,
            [sk.due, sk.buckets, sk.next, sk.job(job_id)],
            [job_id, due, self.config.bucket_ms, self.keys.wake, s, "" if now_ms is None else now_ms],
        )
        if reply[0] == 0:
            raise JobNotFound(job_id)
        if reply[0] < 0:
            raise InvalidState(job_id, reply[1], "reschedule")
        return int(reply[2])

    # -- release (scheduler side) ---------------------------------------------

    def release_due(
        self, shard: int, owner: str = "", fence: str = "", now_ms: int | None = None,
        limit: int | None = None,
    ) -> Batch:
        """Direct path: push up to ``limit`` due jobs of ``shard`` onto their queues."""
        self.check_layout()
        sk = self.keys.shard(shard)
        opts = self.app.conf.broker_transport_options or {}
        gkp = opts.get("global_keyprefix", "") or ""
        # Where kombu puts a message no queue is bound for (None: it drops it).
        dead = opts.get("deadletter_queue", VirtualChannel.deadletter_queue) or ""
        reply = self._run(
            self.scripts.release_due,
            [sk.due, sk.buckets, sk.next, sk.lease, sk.dlq],
            [sk.job_prefix, "" if now_ms is None else now_ms, limit or self.config.batch_size,
             self.config.bucket_ms, owner, fence, self.config.record_ttl_ms, gkp, dead, *self._dlq_bounds()],
        )
        batch = self._batch(reply)
        rest = reply[5:]
        for i in range(0, len(rest), 2):
            batch.ids.append(rest[i])
            batch.events.append(json.loads(rest[i + 1]) if rest[i + 1] else None)
        return batch

    def claim_due(
        self, shard: int, owner: str = "", fence: str = "", now_ms: int | None = None,
        limit: int | None = None,
    ) -> Batch:
        """Publish path: lease up to ``limit`` due (or stale in-flight) jobs of ``shard``."""
        self.check_layout()
        sk = self.keys.shard(shard)
        reply = self._run(
            self.scripts.claim_due,
            [sk.due, sk.buckets, sk.next, sk.lease, sk.inflight, sk.dlq],
            [sk.job_prefix, "" if now_ms is None else now_ms, limit or self.config.batch_size,
             self.config.bucket_ms, owner, fence, self.config.claim_lease_ms, self.config.record_ttl_ms,
             *self._dlq_bounds()],
        )
        batch = self._batch(reply)
        rest = reply[5:]
        for i in range(0, len(rest), 6):
            jid, msg, ex, rk, q, ev = rest[i:i + 6]
            batch.ids.append(jid)
            batch.messages.append((msg, ex, rk, q))
            batch.events.append(json.loads(ev) if ev else None)
        return batch

    def _dlq_bounds(self) -> tuple[int, int]:
        """The dead-letter set's bounds per shard: max age (ms), max length."""
        cfg = self.config
        return cfg.dlq_max_age_s * 1000, -(-cfg.dlq_max_len // cfg.shards)

    @staticmethod
    def _batch(reply: Sequence[Any]) -> Batch:
        if reply[0] == -1:
            raise LeaseLost("the shard's lease is held by another scheduler")
        nxt = int(reply[3])
        return Batch(True, int(reply[1]), int(reply[2]), None if nxt < 0 else nxt, int(reply[4]))

    def ack_claimed(self, shard: int, ids: Iterable[str], now_ms: int | None = None) -> int:
        """Publish path: confirm published jobs; return how many were still in flight."""
        ids = list(ids)
        if not ids:
            return 0
        sk = self.keys.shard(shard)
        return int(self._run(
            self.scripts.ack_claimed, [sk.inflight],
            [sk.job_prefix, "" if now_ms is None else now_ms, self.config.record_ttl_ms, *ids],
        ))

    # -- scheduler membership ------------------------------------------------

    def heartbeat(self, owner: str, leave: bool = False, now_ms: int | None = None) -> tuple[int, list[str]]:
        """Renew (or give up) ``owner``'s membership; return (now ms, live members)."""
        reply = self._run(
            self.scripts.heartbeat, [self.keys.schedulers],
            [owner, self.config.lease_ms, "" if now_ms is None else now_ms, "1" if leave else ""],
        )
        return int(reply[0]), [str(m) for m in reply[1:]]

    def rebalance(self, owner: str, now_ms: int | None = None) -> dict[int, str]:
        """Hand the shards out over the live schedulers; return ``owner``'s shards and fences."""
        n = self.config.shards
        keys = [self.keys.schedulers]
        keys += [self.keys.shard(s).lease for s in range(n)]
        keys += [self.keys.shard(s).fence for s in range(n)]
        reply = self._run(self.scripts.rebalance, keys, [owner, "" if now_ms is None else now_ms])
        return {int(reply[i]): str(reply[i + 1]) for i in range(0, len(reply), 2)}

    # -- inspection ----------------------------------------------------------

    def shard_status(self, now_ms: int | None = None) -> list[dict[str, Any]]:
        """Per shard: pending jobs, in-flight claims, next due time and oldest overdue (ms)."""
        now = self.now_ms() if now_ms is None else now_ms
        out = []
        for s in range(self.config.shards):
            sk = self.keys.shard(s)
            due_keys = self._due_keys(s)
            pipe = self.client.pipeline(transaction=False)
            for k in due_keys:
                pipe.zcard(k)
                pipe.zrange(k, 0, 0, withscores=True)
                pipe.zcount(k, "-inf", now)
            pipe.zcard(sk.inflight)
            replies = pipe.execute()
            pending = sum(replies[i] for i in range(0, len(replies) - 1, 3))
            overdue = sum(replies[i + 2] for i in range(0, len(replies) - 1, 3))
            firsts = [int(r[0][1]) for r in replies[1:-1:3] if r]
            nxt = min(firsts) if firsts else None
            out.append({
                "shard": s, "pending": pending, "overdue": overdue, "inflight": replies[-1],
                "next_due_ms": nxt,
                "oldest_overdue_ms": (now - nxt) if nxt is not None and nxt <= now else 0,
            })
        return out

    def _due_keys(self, shard: int) -> list[str]:
        sk = self.keys.shard(shard)
        if self.config.bucket_ms <= 0:
            return [sk.due]
        return [str(k) for k in self.client.zrange(sk.buckets, 0, -1)]

    def pending(
        self, task: str | None = None, offset: int = 0, limit: int = 50
    ) -> list[dict[str, str]]:
        """List scheduled jobs (earliest first within each shard), optionally of one task."""
        out: list[dict[str, str]] = []
        skipped = 0
        for s in range(self.config.shards):
            sk = self.keys.shard(s)
            for k in self._due_keys(s):
                start = 0
                while True:
                    ids: list[Any] = list(self.client.zrange(k, start, start + 499, withscores=True))
                    if not ids:
                        break
                    start += len(ids)
                    pipe = self.client.pipeline(transaction=False)
                    for jid, _ in ids:
                        pipe.hmget(sk.job(jid), "task", "q", "st")
                    rows: list[Any] = pipe.execute()
                    for (jid, score), (tname, q, st) in zip(ids, rows, strict=True):
                        if task and tname != task:
                            continue
                        if skipped < offset:
                            skipped += 1
                            continue
                        out.append({"id": jid, "shard": str(s), "due": str(int(score)),
                                    "task": tname or "", "queue": q or "", "st": st or ""})
                        if len(out) >= limit:
                            return out
        return out


_STORE_ATTR = "_celery_delayed_store"


def get_store(app: Celery) -> Store:
    """Return the app's store, creating it on first use."""
    store: Store | None = getattr(app, _STORE_ATTR, None)
    if store is None:
        store = Store(app)
        setattr(app, _STORE_ATTR, store)
    return store
