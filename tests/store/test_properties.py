"""Property-based test of the store's Lua scripts against a small Python model.

A hypothesis ``RuleBasedStateMachine`` drives every script through its
gateway method, on the real scripts in a private redis-server, with synthetic
time (every script takes ``now_ms``):

- scheduling: schedule (with ``expires``, ``max_lateness`` and ``misfire``),
  cancel (also of a running job), reschedule; debounce and throttle keys
  (schedule_keyed);
- the scheduler side: heartbeat and hold_shards (membership, shard leases
  held while their holder is a live member, and fences), release_due and claim_due called by the lease holder, by a
  stale holder (refused) or without a lease, ack_claimed, claim leases that
  run out; misfire and expiry decided at release;
- the worker side: start, extend_lease, finish (SUCCEEDED, FAILED, QUEUED);
- failures and the dead-letter queue: retry, fail, dead (with and without a
  message, trimmed by age and count), requeue, purge_dead;
- the operators' controls: pause and resume release, promote ("run now").

Time moves forward and also jumps backwards (a Redis failover to a replica
whose clock is slower). After every step the whole store of the run must
equal what the model says: each record's state, due time, message, TTL,
execution lease, attempts, retries and claims; the due index (and its
buckets: none empty, none unlisted); the in-flight set with its deadlines;
the dead-letter sets with their times of death; the scheduler set, shard
leases and fences; the queue's list in push order; the next-due hint (never
later than the earliest scheduled job, so a wake-up cannot be missed); and no
orphan records; and the pending index by task and queue, and the shard's
counters of released, cancelled and promoted jobs (issue 12).

The runs are random (a new seed each run, printed with any failure, and
reproduced with ``STORE_MODEL_SEED=<seed>``); CI runs a larger profile.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timezone

import hypothesis
import pytest
import redis
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    invariant,
    precondition,
    rule,
)
from support import IN_CI, RedisServer, make_app, need

from celery_delayed import InvalidState, JobNotFound
from celery_delayed.errors import LeaseLost
from celery_delayed.producer.prepare import prepare
from celery_delayed.scheduler.loop import share
from celery_delayed.store import Store
from celery_delayed.store.keys import index_part
from celery_delayed.vocab import Reply

T0 = 1_800_000_000_000  # synthetic epoch ms the runs start at
CLAIM_LEASE_MS = 1000
EXEC_LEASE_MS = 1500
LEASE_MS = 2000  # scheduler membership
DLQ_MAX_AGE_MS = 8000
DLQ_MAX_LEN = 6  # over both shards: 3 per shard
SHARDS = 2
TASK = "prop.task"
IDS = [f"j{i}" for i in range(8)] + ["{b}", "ü 1"]
LIVE = ("SCHEDULED", "CLAIMED", "QUEUED")
FAILABLE = ("QUEUED", "CLAIMED", "RUNNING")
SHARD_KEYS = {i: "entity-a" if n % 3 == 0 else "entity-b" for n, i in enumerate(IDS) if n % 3 != 2}
SCHEDULERS = ["sched-a", "sched-b"]
#: Debounce and throttle keys (schedule_keyed.lua); the jobs they create get ids "d<n>" / "t<n>".
KEYED_KEYS = ["key-a", "key-b"]
WORKERS = ["w1|1|tag|n1", "w2|2|tag|n2"]
#: Who calls release / claim: no lease check (twice as likely), the lease holder, a stale holder.
CALLERS = ["", "", "holder", "stale"]

#: Examples of up to ``stateful_step_count`` steps, per bucket width.
PROFILES = {
    "dev": {"max_examples": 30, "stateful_step_count": 50},
    "ci": {"max_examples": 60, "stateful_step_count": 60},
}


@dataclass
class Job:
    shard: int
    due: int | None
    st: str = "SCHEDULED"
    msg: bool = True  # the record holds a message
    ttl: bool = False  # the record expires
    exp: int | None = None
    ml: int | None = None
    mf: str | None = None
    lo: str | None = None  # execution lease: owner, deadline
    lu: int | None = None
    att: int = 0
    retries: str | None = None
    claims: int = 0


def machine(redis_url: str, bucket_ms: int) -> type[RuleBasedStateMachine]:
    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            uid = uuid.uuid4().hex[:10]
            self.app = make_app(redis_url, uid, delayed_shards=SHARDS, delayed_bucket_ms=bucket_ms,
                                delayed_claim_lease_ms=CLAIM_LEASE_MS, delayed_exec_lease_ms=EXEC_LEASE_MS,
                                delayed_lease_ms=LEASE_MS, delayed_dlq_max_age_s=DLQ_MAX_AGE_MS // 1000,
                                delayed_dlq_max_len=DLQ_MAX_LEN)
            self.store = Store(self.app)
            assert self.store.broker.direct
            self.client: redis.Redis = self.store.redis.client
            self.queue = self.app.conf.task_default_queue
            self.now = T0
            self.jobs: dict[str, Job] = {}
            self.inflight: dict[int, dict[str, int]] = {s: {} for s in range(SHARDS)}
            self.dlq: dict[int, dict[str, int]] = {s: {} for s in range(SHARDS)}
            self.pushed: list[str] = []  # ids in push order (the list holds them reversed)
            self.members: dict[str, int] = {}  # scheduler -> membership deadline
            self.leases: dict[int, tuple[str, int]] = {}  # shard -> (owner, fence)
            self.fences: dict[int, int] = {s: 0 for s in range(SHARDS)}
            self._fields: dict[str, dict[str, str]] = {}
            self.paused = False
            self.counts = {"released": 0, "cancelled": 0, "promoted": 0}
            self.entries: dict[tuple[str, str], tuple[str, int]] = {}  # (mode, key) -> (job id, first call)
            self.keyed: dict[str, str] = {}  # id of a job a key created -> the key (its shard key)

        def teardown(self) -> None:
            keys = list(self.client.scan_iter(match=f"{self.store.keys.prefix}*", count=1000))
            keys += [self.queue]
            self.client.delete(*keys)

        # -- helpers ---------------------------------------------------------------------

        def _due_in(self, shard: int) -> list[tuple[str, int]]:
            """Model: the shard's scheduled jobs, in release order (score, then id)."""
            rows = [(j.due, i) for i, j in self.jobs.items() if j.shard == shard and j.st == "SCHEDULED"]
            return [(i, d) for d, i in sorted(rows, key=lambda r: (r[0], r[1].encode()))]

        def _shard_key(self, i: str) -> str | None:
            return self.keyed.get(i) or SHARD_KEYS.get(i)

        def _shard_of(self, i: str) -> int:
            return self.store.layout.shard_of(i, self._shard_key(i))

        def _message_fields(self, i: str) -> dict[str, str]:
            """The record fields of a message of job ``i`` (what the worker side stores for a retry)."""
            if i not in self._fields:
                p = prepare(self.app, self.store, TASK, (i,), {}, 0, task_id=i, shard_key=self._shard_key(i))
                self._fields[i] = {k: v for k, v in p.job.full_fields().items() if v}
            return self._fields[i]

        def _pick(self, data: st.DataObject, *states: str) -> str:
            """A job id: mostly one of the jobs in ``states`` (any job when none given), else any id."""
            hot = sorted(i for i, j in self.jobs.items() if not states or j.st in states)
            if hot and data.draw(st.integers(0, 3), label="hot") > 0:
                return data.draw(st.sampled_from(hot), label="id")
            known = sorted(self.jobs)
            if known and data.draw(st.booleans(), label="known"):
                return data.draw(st.sampled_from(known), label="id")
            return data.draw(st.sampled_from(IDS), label="id")

        def _worker(self, data: st.DataObject, i: str, choices: list[str]) -> str:
            """An execution owner: mostly the one holding ``i``'s lease, else any of ``choices``."""
            job = self.jobs.get(i)
            if job is not None and job.lo is not None and data.draw(st.integers(0, 2), label="own") > 0:
                return job.lo
            return data.draw(st.sampled_from(choices), label="owner")

        def _spec(self, delta: int, relative: bool) -> tuple[str, int]:
            if relative:
                return f"+{max(delta, 0)}", self.now + max(delta, 0)
            return str(self.now + delta), self.now + delta

        def _unsendable(self, job: Job) -> str | None:
            """misfire.lua: the state a due job gets instead of being sent."""
            if job.exp is not None and self.now >= job.exp:
                return "EXPIRED"
            if job.ml is not None and job.mf in ("skip", "dead") and job.due is not None \
                    and self.now - job.due > job.ml:
                return "SKIPPED" if job.mf == "skip" else "DEAD"
            return None

        def _mark_unsent(self, i: str, state: str) -> None:
            job = self.jobs[i]
            job.st = state
            if state == "DEAD":
                self.dlq[job.shard][i] = self.now  # keeps its message, no ttl
            else:
                job.msg, job.ttl = False, True

        def _dlq_trim(self, shard: int) -> None:
            """dlq.lua: drop letters that died at or before now - max age, then the oldest beyond max len."""
            letters = self.dlq[shard]

            def order() -> list[str]:
                return [i for _, _, i in sorted((d, i.encode(), i) for i, d in letters.items())]

            for i in [i for i in order() if letters[i] <= self.now - DLQ_MAX_AGE_MS][:1000]:
                self._dlq_drop(shard, i)
            over = len(letters) - -(-DLQ_MAX_LEN // SHARDS)
            if over > 0:
                for i in order()[:over]:
                    self._dlq_drop(shard, i)

        def _dlq_drop(self, shard: int, i: str) -> None:
            del self.dlq[shard][i]
            job = self.jobs.get(i)
            if job is not None and job.shard == shard and job.st == "DEAD":
                del self.jobs[i]  # the record is deleted with its letter

        def _caller(self, shard: int, who: str) -> tuple[str, str, bool]:
            """(owner, fence, allowed) of a release call: no lease check, the holder, or a stale holder."""
            if who == "":
                return "", "", True
            lease = self.leases.get(shard)
            if who == "holder":
                if lease is None:
                    return SCHEDULERS[0], "1", False
                return lease[0], str(lease[1]), True
            if lease is None:
                return SCHEDULERS[1], "0", False
            owner, fence = lease
            if fence > 1:
                return owner, str(fence - 1), False  # its lease was handed over and back since
            other = SCHEDULERS[1] if owner == SCHEDULERS[0] else SCHEDULERS[0]
            return other, str(fence), False

        # -- scheduling --------------------------------------------------------------------

        @initialize()
        def start_run(self) -> None:
            self.check()

        @rule(i=st.sampled_from(IDS), delta=st.integers(-3000, 4000), relative=st.booleans(),
              kind=st.sampled_from(["plain", "plain", "plain", "expires", "skip", "dead"]),
              exp_ms=st.integers(-1000, 6000), ml=st.integers(0, 3000))
        def schedule(self, i: str, delta: int, relative: bool, kind: str, exp_ms: int, ml: int) -> None:
            exp = exp_ms if kind == "expires" else None
            misfire = kind if kind in ("skip", "dead") else None
            # An id keeps one shard key: the same id under two shard keys lands in two
            # shards, which no script can see (test_bad_input.py marks that xfail).
            opts: dict[str, object] = {}
            if exp is not None:
                opts["expires"] = datetime.fromtimestamp((self.now + exp) / 1000, tz=timezone.utc)
            if misfire is not None:
                opts.update(misfire=misfire, max_lateness=ml / 1000)
            p = prepare(self.app, self.store, TASK, (i,), {}, 0, task_id=i, shard_key=SHARD_KEYS.get(i), options=opts)
            spec, due = self._spec(delta, relative)
            res = self.store.jobs.schedule([replace(p.job, due=spec)], now_ms=self.now)[0]
            if i in self.jobs:
                assert not res.created and res.state == self.jobs[i].st
                return
            assert res.created and res.due_ms == due
            f = p.job.fields
            self.jobs[i] = Job(res.shard, due, exp=int(f["exp"]) if f.get("exp") else None,
                               ml=int(f["ml"]) if f.get("ml") else None, mf=f.get("mf") or None)
            if exp is not None:
                assert self.jobs[i].exp == self.now + exp
            if misfire is not None and misfire != "run":
                assert (self.jobs[i].ml, self.jobs[i].mf) == (ml, misfire)

        @rule(key=st.sampled_from(KEYED_KEYS), delta=st.integers(-1000, 4000), relative=st.booleans(),
              max_wait=st.sampled_from([None, 1500, 3000]))
        def debounce(self, key: str, delta: int, relative: bool, max_wait: int | None) -> None:
            self._keyed("debounce", key, delta, relative, max_wait)

        @rule(delta=st.integers(-1000, 4000), relative=st.booleans(), window=st.sampled_from([1500, 3000]))
        def throttle(self, delta: int, relative: bool, window: int) -> None:
            self._keyed("throttle", KEYED_KEYS[0], delta, relative, window)

        def _keyed(self, mode: str, key: str, delta: int, relative: bool, limit: int | None) -> None:
            """schedule_keyed.lua: a debounced or throttled call."""
            new_id = f"{mode[0]}{len(self.keyed)}"
            p = prepare(self.app, self.store, TASK, (new_id,), {}, 0, task_id=new_id, shard_key=key)
            spec, due = self._spec(delta, relative)
            res = self.store.jobs.schedule_keyed(replace(p.job, due=spec), mode, key, limit, now_ms=self.now)
            entry = self.entries.get((mode, key))
            held = self.jobs.get(entry[0]) if entry is not None else None
            if mode == "throttle" and entry is not None and self.now < entry[1] + (limit or 0):
                event("schedule_keyed: throttled")
                assert (res.created, res.id) == (False, entry[0])  # the window's job, unchanged
                assert (res.state, res.due_ms) == ((held.st, held.due or 0) if held is not None else ("", 0))
                return
            replaces = mode == "debounce" and held is not None and held.st == "SCHEDULED" and held.att == 0
            first = entry[1] if replaces and entry is not None else self.now
            if mode == "debounce" and limit is not None:
                due = min(due, first + limit)
            if replaces:
                event("schedule_keyed: debounce replaced the job")
                assert held is not None and entry is not None
                assert (res.created, res.id, res.due_ms) == (False, entry[0], due)
                # the record is written anew: the call's fields, no claims, retries or lease
                held.due, held.msg, held.ttl, held.claims, held.retries = due, True, False, 0, None
                held.exp = held.ml = held.mf = held.lo = held.lu = None
                return
            event(f"schedule_keyed: {mode} created a job")
            assert (res.created, res.id, res.due_ms) == (True, new_id, due)
            self.jobs[new_id] = Job(res.shard, due)
            self.keyed[new_id] = key
            self.entries[(mode, key)] = (new_id, self.now)

        @rule(data=st.data(), running=st.booleans())
        def cancel(self, data: st.DataObject, running: bool) -> None:
            i = self._pick(data)
            job = self.jobs.get(i)
            if job is None:
                with pytest.raises(JobNotFound):
                    self.store.jobs.cancel(i, now_ms=self.now, running=running)
                return
            if job.st not in LIVE and not (running and job.st == "RUNNING"):
                with pytest.raises(InvalidState) as err:
                    self.store.jobs.cancel(i, now_ms=self.now, running=running)
                assert err.value.state == job.st
                return
            assert self.store.jobs.cancel(i, now_ms=self.now, running=running) == job.st
            self.counts["cancelled"] += 1
            job.st, job.msg, job.ttl, job.lo, job.lu = "CANCELLED", False, True, None, None
            self.inflight[job.shard].pop(i, None)

        @rule(data=st.data(), delta=st.integers(-2000, 6000))
        def reschedule(self, data: st.DataObject, delta: int) -> None:
            i = self._pick(data, "SCHEDULED")
            job = self.jobs.get(i)
            due = self.now + delta
            if job is None or job.st != "SCHEDULED":
                with pytest.raises((JobNotFound, InvalidState)) as err:
                    self.store.jobs.reschedule(i, str(due), now_ms=self.now)
                assert isinstance(err.value, JobNotFound) == (job is None)
                return
            assert self.store.jobs.reschedule(i, str(due), now_ms=self.now) == due
            job.due = due

        # -- the operators' controls ------------------------------------------------------------

        @rule()
        def pause_all(self) -> None:
            self.store.jobs.pause(["all"], now_ms=self.now)
            self.paused = True

        @rule()
        def resume_all(self) -> None:
            assert self.store.jobs.resume(now_ms=self.now) == 0  # nothing held: only "all" is paused
            self.paused = False

        @rule(data=st.data())
        def promote(self, data: st.DataObject) -> None:
            i = self._pick(data, "SCHEDULED")
            job = self.jobs.get(i)
            if job is None or job.st != "SCHEDULED":
                with pytest.raises((JobNotFound, InvalidState)) as err:
                    self.store.jobs.promote(i, now_ms=self.now)
                assert isinstance(err.value, JobNotFound) == (job is None)
                return
            assert self.store.jobs.promote(i, now_ms=self.now) == self.now
            assert job.due is not None
            if job.due > self.now:
                job.due = self.now
                self.counts["promoted"] += 1

        # -- time ----------------------------------------------------------------------------

        @rule(ms=st.integers(0, 2500))
        def advance(self, ms: int) -> None:
            self.now += ms

        @rule()
        def expire_claims(self) -> None:
            """Jump past every claim lease, as if the claiming scheduler died."""
            self.now += CLAIM_LEASE_MS + 1

        @rule(ms=st.integers(1, 3000))
        def clock_goes_back(self, ms: int) -> None:
            """A failover to a replica whose clock is behind: the Redis clock jumps backwards."""
            self.now -= ms

        # -- the scheduler side ----------------------------------------------------------------

        @rule(owner=st.sampled_from(SCHEDULERS), leave=st.booleans())
        def heartbeat(self, owner: str, leave: bool) -> None:
            beat = self.store.fleet.heartbeat(owner, leave, now_ms=self.now)
            joined = not leave and owner not in self.members  # the set is pruned only here
            if leave:
                self.members.pop(owner, None)
            else:
                self.members[owner] = self.now + LEASE_MS
            self.members = {m: d for m, d in self.members.items() if d > self.now}
            assert (beat.now_ms, beat.members, beat.deadlines, beat.joined) == (
                self.now, sorted(self.members), self.members, joined)

        @rule(owner=st.sampled_from(SCHEDULERS), give_all=st.booleans())
        def hold(self, owner: str, give_all: bool) -> None:
            """Take the caller's share of the shards (or give every lease it holds up), as the loop does."""
            live = [m for m, d in self.members.items() if d > self.now]  # the set is not pruned here
            mine = {s for s, lease in self.leases.items() if lease[0] == owner}
            wanted = set() if give_all else share(live, owner, SHARDS)
            held, waits = self.store.fleet.shard_lease(owner, wanted, mine - wanted, live=live)
            exp_held: dict[int, str] = {}
            exp_waits: dict[int, str] = {}
            for s in sorted(wanted | mine):
                cur = self.leases.get(s)
                if cur is not None and cur[0] == owner:
                    if s in wanted:  # kept: no deadline to move, the same fence
                        exp_held[s] = str(cur[1])
                    else:  # given up
                        del self.leases[s]
                    continue
                if s not in wanted:
                    continue
                if cur is not None and cur[0] in live:  # its holder is a live member
                    exp_waits[s] = cur[0]
                    continue
                self.fences[s] += 1  # a new holder: a new fence
                self.leases[s] = (owner, self.fences[s])
                exp_held[s] = str(self.fences[s])
            assert (held, waits) == (exp_held, exp_waits)

        @rule(shard=st.integers(0, SHARDS - 1), limit=st.integers(1, 6), who=st.sampled_from(CALLERS))
        def release(self, shard: int, limit: int, who: str) -> None:
            owner, fence, allowed = self._caller(shard, who)
            if not allowed:
                with pytest.raises(LeaseLost):
                    self.store.release.release_due(shard, owner, fence, now_ms=self.now, limit=limit)
                return
            if self.paused:  # nothing is released, and the caller is told there is nothing to wait for
                batch = self.store.release.release_due(shard, owner, fence, now_ms=self.now, limit=limit)
                assert (batch.count, batch.next_due_ms) == (0, None)
                return
            due = [i for i, d in self._due_in(shard) if d <= self.now][:limit]
            released, skipped, dead = [], 0, 0
            for i in due:
                unsent = self._unsendable(self.jobs[i])
                if unsent:
                    self._mark_unsent(i, unsent)
                    skipped += 1
                    dead += unsent == "DEAD"
                    continue
                job = self.jobs[i]
                job.st, job.ttl = "QUEUED", True  # the message stays until the job starts
                self.pushed.append(i)
                released.append(i)
            self.counts["released"] += len(released)
            if dead:
                self._dlq_trim(shard)
            batch = self.store.release.release_due(shard, owner, fence, now_ms=self.now, limit=limit)
            assert batch.ids == released
            assert (batch.count, batch.skipped, batch.now_ms) == (len(released), skipped, self.now)
            left = [d for _, d in self._due_in(shard)]
            assert batch.next_due_ms == (min(left) if left else None)

        @rule(shard=st.integers(0, SHARDS - 1), limit=st.integers(1, 6), who=st.sampled_from(CALLERS))
        def claim(self, shard: int, limit: int, who: str) -> None:
            owner, fence, allowed = self._caller(shard, who)
            if not allowed:
                with pytest.raises(LeaseLost):
                    self.store.release.claim_due(shard, owner, fence, now_ms=self.now, limit=limit)
                return
            if self.paused:
                assert self.store.release.claim_due(shard, owner, fence, now_ms=self.now, limit=limit).count == 0
                return
            flight = self.inflight[shard]
            claimed: list[str] = []
            skipped = dead = 0

            def held_back(i: str) -> bool:
                nonlocal skipped, dead
                unsent = self._unsendable(self.jobs[i])
                if unsent is None:
                    return False
                flight.pop(i, None)
                self._mark_unsent(i, unsent)
                skipped += 1
                dead += unsent == "DEAD"
                return True

            def emit(i: str) -> None:
                flight[i] = self.now + CLAIM_LEASE_MS
                self.jobs[i].claims += 1
                claimed.append(i)

            stale = [i for _, _, i in sorted((d, i.encode(), i) for i, d in flight.items() if d <= self.now)][:limit]
            for i in stale:
                job = self.jobs.get(i)
                if job is not None and job.shard == shard and job.st == "CLAIMED" and job.msg:
                    if not held_back(i):
                        emit(i)
                else:
                    del flight[i]  # started, cancelled or acknowledged meanwhile: dropped
            for i in [i for i, d in self._due_in(shard) if d <= self.now][:limit - len(claimed)]:
                if not held_back(i):
                    self.jobs[i].st = "CLAIMED"
                    emit(i)
            if dead:
                self._dlq_trim(shard)
            batch = self.store.release.claim_due(shard, owner, fence, now_ms=self.now, limit=limit)
            assert batch.ids == claimed
            assert (batch.count, batch.skipped, batch.now_ms) == (len(claimed), skipped, self.now)
            for i, (msg, _ex, rk, q) in zip(batch.ids, batch.messages, strict=True):
                assert json.loads(msg)["headers"]["id"] == i
                assert q == self.queue and rk == self.queue
            left = [d for _, d in self._due_in(shard)] + list(flight.values())
            assert batch.next_due_ms == (min(left) if left else None)

        @rule(data=st.data())
        def release_and_start(self, data: st.DataObject) -> None:
            """A shortcut to the worker side: release what is due in both shards (no lease
            check), then a worker starts one of the released jobs."""
            self.now += 5000
            for s in range(SHARDS):
                self.release(s, 6, "")
            queued = sorted(i for i, j in self.jobs.items() if j.st == "QUEUED")
            if queued:
                i = data.draw(st.sampled_from(queued), label="id")
                self._start(i, data.draw(st.sampled_from(WORKERS), label="worker"))

        @precondition(lambda self: any(self.inflight.values()))
        @rule(data=st.data())
        def ack(self, data: st.DataObject) -> None:
            shard = data.draw(st.sampled_from([s for s, f in self.inflight.items() if f]))
            ids = data.draw(st.lists(st.sampled_from([*self.inflight[shard], *IDS[:3]]), max_size=5))
            expected = 0
            for i in ids:
                if self.inflight[shard].pop(i, None) is not None:
                    expected += 1
                    job = self.jobs[i]
                    if job.st == "CLAIMED":  # one a worker started meanwhile keeps its state
                        job.st, job.ttl = "QUEUED", True  # the message stays until the job starts
                        self.counts["released"] += 1
            assert self.store.release.ack_claimed(shard, ids, now_ms=self.now) == expected

        # -- the worker side -----------------------------------------------------------------

        @rule(data=st.data())
        def start(self, data: st.DataObject) -> None:
            i = self._pick(data, *FAILABLE)
            worker = self._worker(data, i, WORKERS) if data.draw(st.booleans(), label="again") else \
                data.draw(st.sampled_from(WORKERS), label="worker")
            self._start(i, worker)

        def _start(self, i: str, worker: str) -> None:
            res = self.store.executions.start(i, self._shard_of(i), worker, "host", now_ms=self.now)
            got = (res.code, res.state, res.attempt, res.lease_until_ms)
            job = self.jobs.get(i)
            if job is None:
                assert got == (Reply.NOT_FOUND, "", 0, 0)
            elif job.st not in FAILABLE:
                assert got == (Reply.WRONG_STATE, job.st, job.att, 0)
            elif job.st == "RUNNING" and job.lo != worker and job.lu is not None and job.lu > self.now:
                assert got == (Reply.BUSY, "RUNNING", job.att, job.lu)
            else:  # QUEUED, CLAIMED, or RUNNING whose lease passed (or is this worker's own)
                job.att += 1
                job.st, job.lo, job.lu, job.ttl = "RUNNING", worker, self.now + EXEC_LEASE_MS, False
                job.msg = False  # started: the reconciler will not send it again
                assert got == (Reply.OK, "RUNNING", job.att, job.lu)

        @rule(data=st.data())
        def extend_lease(self, data: st.DataObject) -> None:
            i = self._pick(data, "RUNNING")
            worker = self._worker(data, i, WORKERS)
            job = self.jobs.get(i)
            ours = job is not None and job.st == "RUNNING" and job.lo == worker
            assert self.store.executions.extend_lease(i, self._shard_of(i), worker, now_ms=self.now) == ours
            if ours:
                assert job is not None
                job.lu = self.now + EXEC_LEASE_MS

        @rule(data=st.data(), outcome=st.sampled_from(["SUCCEEDED", "FAILED", "QUEUED"]))
        def finish(self, data: st.DataObject, outcome: str) -> None:
            i = self._pick(data, "RUNNING")
            worker = self._worker(data, i, WORKERS)
            out = self.store.executions.finish(i, self._shard_of(i), worker, outcome, now_ms=self.now)
            job = self.jobs.get(i)
            if job is None:
                assert (out.code, out.state) == (Reply.NOT_FOUND, "")
                return
            if job.st != "RUNNING" or job.lo != worker:
                assert (out.code, out.state) == (Reply.NOT_OWNER, job.st)
                return
            assert (out.code, out.state) == (Reply.OK, outcome)
            job.lo = job.lu = None
            job.st, job.ttl = outcome, True
            if outcome != "QUEUED":
                job.msg = False

        # -- failures and the dead-letter queue ------------------------------------------------

        def _refusal(self, job: Job | None, owner: str) -> Reply | None:
            """attempts.lua: why a failing attempt may not be closed (None: it may)."""
            if job is None:
                return None
            if job.st not in FAILABLE:
                return Reply.WRONG_STATE
            if owner and job.st == "RUNNING" and job.lo not in (None, owner):
                return Reply.NOT_OWNER
            return None

        def _closed(self, i: str, state: str) -> tuple[Job, str]:
            """The job after its failing attempt closed in ``state`` (a record is made if there was none)."""
            job = self.jobs.get(i)
            prev = job.st if job is not None else ""
            if job is None:
                job = self.jobs[i] = Job(self._shard_of(i), None, msg=False)
            job.st, job.lo, job.lu = state, None, None
            self.inflight[job.shard].pop(i, None)
            return job, prev

        @rule(data=st.data(), delta=st.integers(-1000, 4000), relative=st.booleans(), retries=st.integers(1, 5))
        def retry(self, data: st.DataObject, delta: int, relative: bool, retries: int) -> None:
            i = self._pick(data, *FAILABLE)
            owner = self._worker(data, i, ["", *WORKERS])
            spec, due = self._spec(delta, relative)
            out = self.store.executions.retry(i, self._shard_of(i), spec, retries, self._message_fields(i), owner=owner,
                                   now_ms=self.now)
            job = self.jobs.get(i)
            if job is not None and job.st == "SCHEDULED":
                assert (out.code, out.state, out.due_ms) == (Reply.UNCHANGED, "SCHEDULED", job.due)
                return
            refused = self._refusal(job, owner)
            if refused is not None:
                assert job is not None and (out.code, out.state, out.due_ms) == (refused, job.st, 0)
                return
            job, prev = self._closed(i, "SCHEDULED")
            job.due, job.retries, job.msg, job.ttl = due, str(retries), True, False
            assert (out.code, out.state, out.due_ms) == (Reply.OK, prev, due)

        @rule(data=st.data())
        def fail(self, data: st.DataObject) -> None:
            i = self._pick(data, *FAILABLE)
            owner = self._worker(data, i, ["", *WORKERS])
            out = self.store.executions.fail(i, self._shard_of(i), {"etype": "app.Boom", "emsg": "boom"}, owner=owner,
                                  now_ms=self.now)
            job = self.jobs.get(i)
            refused = self._refusal(job, owner)
            if refused is not None:
                assert job is not None and (out.code, out.state) == (refused, job.st)
                return
            job, prev = self._closed(i, "FAILED")
            job.msg, job.ttl = False, True
            assert (out.code, out.state) == (Reply.OK, prev)

        @rule(data=st.data(), with_msg=st.booleans())
        def dead(self, data: st.DataObject, with_msg: bool) -> None:
            i = self._pick(data, *FAILABLE)
            owner = self._worker(data, i, ["", *WORKERS])
            fields = {"etype": "app.Boom", "emsg": "boom", "attempts": "3"}
            # A dead letter keeps a message to requeue; one without (its value '' removes the
            # field) cannot be requeued.
            fields |= self._message_fields(i) if with_msg else {"msg": ""}
            shard = self._shard_of(i)
            job = self.jobs.get(i)
            refused = self._refusal(job, owner)
            if refused is None:
                job, prev = self._closed(i, "DEAD")
                job.msg, job.ttl = with_msg, False
                self.dlq[shard][i] = self.now
                before = dict(self.dlq[shard])
                self._dlq_trim(shard)
                dropped = len(before) - len(self.dlq[shard])
            out = self.store.executions.dead(i, shard, fields, owner=owner, now_ms=self.now)
            if refused is not None:
                assert job is not None and (out.code, out.state, out.dropped) == (refused, job.st, 0)
                return
            assert (out.code, out.state, out.dropped) == (Reply.OK, prev, dropped)

        @rule(shard=st.integers(0, SHARDS - 1), data=st.data(), delta=st.integers(-1000, 4000),
              relative=st.booleans())
        def requeue(self, shard: int, data: st.DataObject, delta: int, relative: bool) -> None:
            pool = sorted(set(self.dlq[shard]) | set(IDS[:4]))
            ids = data.draw(st.lists(st.sampled_from(pool), max_size=4))
            spec, due = self._spec(delta, relative)
            expected = []
            for i in ids:
                job = self.jobs.get(i)
                if job is None or job.shard != shard:  # no record in this shard
                    self.dlq[shard].pop(i, None)
                    expected.append((Reply.NOT_FOUND, ""))
                elif job.st != "DEAD":
                    self.dlq[shard].pop(i, None)
                    expected.append((Reply.WRONG_STATE, job.st))
                elif not job.msg:
                    expected.append((Reply.NO_MESSAGE, "DEAD"))  # stays a dead letter
                else:
                    del self.dlq[shard][i]
                    job.st, job.due, job.retries, job.att = "SCHEDULED", due, "0", 0
                    expected.append((Reply.OK, "DEAD"))
            got_due, outcomes = self.store.dead_letters.requeue(shard, ids, spec, now_ms=self.now)
            assert got_due == due
            assert [(o.code, o.state) for o in outcomes] == expected

        @rule(shard=st.integers(0, SHARDS - 1))
        def purge(self, shard: int) -> None:
            n = len(self.dlq[shard])
            for i in list(self.dlq[shard]):
                self._dlq_drop(shard, i)
            assert self.store.dead_letters.purge_dead(shard) == n

        # -- the check -------------------------------------------------------------------

        @invariant()
        def check(self) -> None:
            c = self.client
            for s in range(SHARDS):
                sk = self.store.keys.shard(s)
                expected_due = dict(self._due_in(s))
                if bucket_ms <= 0:
                    got = {k: int(v) for k, v in c.zrange(sk.due, 0, -1, withscores=True)}
                    assert not c.exists(sk.buckets)
                else:
                    got = {}
                    for bk, start in c.zrange(sk.buckets, 0, -1, withscores=True):
                        members = c.zrange(bk, 0, -1, withscores=True)
                        assert members, f"empty bucket {bk} left in the index"
                        for k, v in members:
                            assert int(start) <= v < start + bucket_ms and k not in got
                            got[k] = int(v)
                    listed = set(c.zrange(sk.buckets, 0, -1))
                    on_server = set(c.scan_iter(match=f"{sk.due}:*", count=1000))
                    assert on_server == listed, "a bucket key that the bucket index does not list"
                assert got == expected_due
                # the pending index (one task, one queue here) holds exactly the scheduled jobs
                parts = set(c.smembers(sk.index_parts))
                assert parts <= {index_part(TASK, self.queue)}
                ix = {k: int(v) for p in parts for k, v in c.zrange(sk.index(p), 0, -1, withscores=True)}
                assert ix == expected_due
                assert {k: int(v) for k, v in c.zrange(sk.inflight, 0, -1, withscores=True)} == self.inflight[s]
                assert not set(got) & set(self.inflight[s]), "a job both scheduled and in flight"
                assert {k: int(v) for k, v in c.zrange(sk.dlq, 0, -1, withscores=True)} == self.dlq[s]
                nxt = c.get(sk.next)
                if expected_due:
                    assert nxt is not None and int(nxt) <= min(expected_due.values()), (
                        "the next-due hint is later than a scheduled job: a wake-up could be missed")
                lease = self.leases.get(s)
                assert c.get(sk.lease) == (f"{lease[0]}|{lease[1]}" if lease else None)
                assert int(c.get(sk.fence) or 0) == self.fences[s]
            members = {m: int(d) for m, d in c.zrange(self.store.keys.schedulers, 0, -1, withscores=True)}
            assert members == self.members
            pipe = c.pipeline(transaction=False)
            for i, job in self.jobs.items():
                key = self.store.keys.shard(job.shard).job(i)
                pipe.hmget(key, "st", "due", "msg", "lo", "lu", "att", "retries", "claims", "b")
                pipe.pttl(key)
            replies = pipe.execute()
            for (i, job), (st_, due, msg, lo, lu, att, retries, claims, head), ttl in zip(
                    self.jobs.items(), replies[::2], replies[1::2], strict=True):
                assert st_ == job.st, i
                assert due == (None if job.due is None else str(job.due)), i
                assert (msg is not None or head is not None) == job.msg, (i, job)  # full, or compact
                assert (ttl > 0) == job.ttl and ttl != -2, (i, job, ttl)
                assert (lo, lu) == (job.lo, None if job.lu is None else str(job.lu)), i
                assert (int(att or 0), retries, int(claims or 0)) == (job.att, job.retries, job.claims), i
            counters = dict.fromkeys(self.counts, 0)
            for s in range(SHARDS):
                for k, v in c.hgetall(self.store.keys.shard(s).stats).items():
                    if k in counters:
                        counters[k] += int(v)
            assert counters == self.counts
            listed = [json.loads(m)["headers"]["id"] for m in c.lrange(self.queue, 0, -1)]
            assert listed == self.pushed[::-1]
            # No orphans: every record under the prefix is a job the model knows.
            for s in range(SHARDS):
                prefix = self.store.keys.shard(s).job_prefix
                for key in c.scan_iter(match=f"{prefix}*", count=1000):
                    i = key[len(prefix):]
                    assert i in self.jobs and self.jobs[i].shard == s, i

    return StoreMachine


@pytest.fixture(scope="module")
def model_redis() -> Iterator[str]:
    """A redis-server of its own: the checks scan the keyspace after every step, so the
    thousands of records other tests leave on the session server would slow them down."""
    need("redis-server", shutil.which("redis-server") is not None)
    with RedisServer() as server:
        yield server.url


def _seed() -> int:
    return int(os.environ.get("STORE_MODEL_SEED") or random.SystemRandom().randrange(2**32))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("bucket_ms", [0, 1000])
def test_store_scripts_match_the_model(model_redis: str, bucket_ms: int) -> None:
    profile = PROFILES["ci" if IN_CI else "dev"]
    seed = _seed()
    test = get_state_machine_test(
        machine(model_redis, bucket_ms),
        settings=settings(**profile, deadline=None, derandomize=False, print_blob=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
    )
    try:
        hypothesis.seed(seed)(test)()
    except BaseException as exc:
        exc.add_note(f"store model: seed {seed}; run it again with STORE_MODEL_SEED={seed}")
        raise
