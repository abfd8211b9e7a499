"""Property-based test of the store's Lua scripts against a small Python model.

A hypothesis ``RuleBasedStateMachine`` schedules, cancels, reschedules,
releases (direct path), claims, acknowledges, lets claim leases expire,
pauses and resumes release, and promotes jobs ("run now"), on
the real scripts in a private redis-server, with synthetic time (every script
takes ``now_ms``). After every step the whole store of the run (due index,
time buckets, in-flight set, job records, the queue's list) must equal what the
model says, and so must the pending index by task and queue and the
shard's counters (issue 12).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from support import make_app

from celery_delayed import InvalidState, JobNotFound
from celery_delayed.producer.jobs import prepare
from celery_delayed.store import Store
from celery_delayed.store.keys import index_part

T0 = 1_800_000_000_000  # synthetic epoch ms the runs start at
CLAIM_LEASE_MS = 1000
SHARDS = 2
TASK = "prop.task"
IDS = [f"j{i}" for i in range(14)] + ["{b}", "ü 1"]
LIVE = ("SCHEDULED", "CLAIMED", "QUEUED")
SHARD_KEYS = {i: "entity-a" if n % 3 == 0 else "entity-b" for n, i in enumerate(IDS) if n % 3 != 2}


@dataclass
class Job:
    shard: int
    due: int
    st: str = "SCHEDULED"


def machine(redis_url: str, bucket_ms: int) -> type[RuleBasedStateMachine]:
    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            uid = uuid.uuid4().hex[:10]
            self.app = make_app(redis_url, uid, delayed_shards=SHARDS, delayed_bucket_ms=bucket_ms,
                                delayed_claim_lease_ms=CLAIM_LEASE_MS)
            self.store = Store(self.app)
            assert self.store.direct
            self.client: redis.Redis = self.store.client
            self.queue = self.app.conf.task_default_queue
            self.now = T0
            self.jobs: dict[str, Job] = {}
            self.inflight: dict[int, dict[str, int]] = {s: {} for s in range(SHARDS)}
            self.pushed: list[str] = []  # ids in push order (the list holds them reversed)
            self.paused = False
            self.counts = {"released": 0, "cancelled": 0, "promoted": 0}

        def teardown(self) -> None:
            keys = list(self.client.scan_iter(match=f"{self.store.keys.prefix}*", count=1000))
            keys += [self.queue]
            self.client.delete(*keys)

        # -- helpers ---------------------------------------------------------------------

        def _due_in(self, shard: int) -> list[tuple[str, int]]:
            """Model: the shard's scheduled jobs, in release order (score, then id)."""
            rows = [(j.due, i) for i, j in self.jobs.items() if j.shard == shard and j.st == "SCHEDULED"]
            return [(i, d) for d, i in sorted(rows, key=lambda r: (r[0], r[1].encode()))]

        # -- rules -------------------------------------------------------------------------

        @initialize()
        def start(self) -> None:
            self.check()

        @rule(i=st.sampled_from(IDS), delta=st.integers(-3000, 6000), relative=st.booleans())
        def schedule(self, i: str, delta: int, relative: bool) -> None:
            # An id keeps one shard key: the same id under two shard keys lands in two
            # shards, which no script can see (test_bad_input.py marks that xfail).
            p = prepare(self.app, TASK, (i,), {}, 0, task_id=i, shard_key=SHARD_KEYS.get(i))
            spec = f"+{max(delta, 0)}" if relative else str(self.now + delta)
            res = self.store.schedule([replace(p.job, due=spec)], now_ms=self.now)[0]
            if i in self.jobs:
                assert not res.created and res.state == self.jobs[i].st
                return
            due = self.now + max(delta, 0) if relative else self.now + delta
            assert res.created and res.due_ms == due
            self.jobs[i] = Job(res.shard, due)

        @rule(i=st.sampled_from(IDS))
        def cancel(self, i: str) -> None:
            job = self.jobs.get(i)
            if job is None:
                try:
                    self.store.cancel(i, now_ms=self.now)
                except JobNotFound:
                    return
                raise AssertionError("cancel of an unknown job succeeded")
            if job.st not in LIVE:
                try:
                    self.store.cancel(i, now_ms=self.now)
                except InvalidState as exc:
                    assert exc.state == job.st
                    return
                raise AssertionError(f"cancel of a {job.st} job succeeded")
            assert self.store.cancel(i, now_ms=self.now) == job.st
            self.counts["cancelled"] += 1
            job.st = "CANCELLED"
            self.inflight[job.shard].pop(i, None)

        @rule(i=st.sampled_from(IDS), delta=st.integers(-2000, 6000))
        def reschedule(self, i: str, delta: int) -> None:
            job = self.jobs.get(i)
            due = self.now + delta
            if job is None or job.st != "SCHEDULED":
                try:
                    self.store.reschedule(i, str(due), now_ms=self.now)
                except (JobNotFound, InvalidState) as exc:
                    assert isinstance(exc, JobNotFound) == (job is None)
                    return
                raise AssertionError("reschedule of a job that is not scheduled succeeded")
            assert self.store.reschedule(i, str(due), now_ms=self.now) == due
            job.due = due

        @rule(ms=st.integers(0, 2500))
        def advance(self, ms: int) -> None:
            self.now += ms

        @rule()
        def expire_claims(self) -> None:
            """Jump past every claim lease, as if the claiming scheduler died."""
            self.now += CLAIM_LEASE_MS + 1

        @rule()
        def pause_all(self) -> None:
            self.store.pause(["all"], now_ms=self.now)
            self.paused = True

        @rule()
        def resume_all(self) -> None:
            assert self.store.resume(now_ms=self.now) == 0  # nothing held: only "all" is paused
            self.paused = False

        @rule(i=st.sampled_from(IDS))
        def promote(self, i: str) -> None:
            job = self.jobs.get(i)
            if job is None or job.st != "SCHEDULED":
                try:
                    self.store.promote(i, now_ms=self.now)
                except (JobNotFound, InvalidState) as exc:
                    assert isinstance(exc, JobNotFound) == (job is None)
                    return
                raise AssertionError("promote of a job that is not scheduled succeeded")
            assert self.store.promote(i, now_ms=self.now) == self.now
            if job.due > self.now:
                job.due = self.now
                self.counts["promoted"] += 1

        @rule(shard=st.integers(0, SHARDS - 1), limit=st.integers(1, 6))
        def release(self, shard: int, limit: int) -> None:
            if self.paused:
                batch = self.store.release_due(shard, now_ms=self.now, limit=limit)
                assert (batch.count, batch.next_due_ms) == (0, None)
                return
            expected = [i for i, d in self._due_in(shard) if d <= self.now][:limit]
            self.counts["released"] += len(expected)
            batch = self.store.release_due(shard, now_ms=self.now, limit=limit)
            assert batch.ids == expected
            assert (batch.count, batch.skipped, batch.now_ms) == (len(expected), 0, self.now)
            for i in expected:
                self.jobs[i].st = "QUEUED"
                self.pushed.append(i)
            left = [d for _, d in self._due_in(shard)]
            assert batch.next_due_ms == (min(left) if left else None)

        @rule(shard=st.integers(0, SHARDS - 1), limit=st.integers(1, 6))
        def claim(self, shard: int, limit: int) -> None:
            if self.paused:
                assert self.store.claim_due(shard, now_ms=self.now, limit=limit).count == 0
                return
            flight = self.inflight[shard]
            stale = sorted((d, i.encode(), i) for i, d in flight.items() if d <= self.now)
            expected = [i for _, _, i in stale][:limit]
            expected += [i for i, d in self._due_in(shard) if d <= self.now][:limit - len(expected)]
            batch = self.store.claim_due(shard, now_ms=self.now, limit=limit)
            assert batch.ids == expected
            for i, (msg, _ex, rk, q) in zip(batch.ids, batch.messages, strict=True):
                assert json.loads(msg)["headers"]["id"] == i
                assert q == self.queue and rk == self.queue
                self.jobs[i].st = "CLAIMED"
                flight[i] = self.now + CLAIM_LEASE_MS

        @precondition(lambda self: any(self.inflight.values()))
        @rule(data=st.data())
        def ack(self, data: st.DataObject) -> None:
            shard = data.draw(st.sampled_from([s for s, f in self.inflight.items() if f]))
            ids = data.draw(st.lists(st.sampled_from([*self.inflight[shard], *IDS[:3]]), max_size=5))
            expected = 0
            for i in ids:
                if self.inflight[shard].pop(i, None) is not None:
                    expected += 1
                    self.jobs[i].st = "QUEUED"
                    self.counts["released"] += 1
            assert self.store.ack_claimed(shard, ids, now_ms=self.now) == expected

        @rule(i=st.sampled_from(IDS), state=st.sampled_from(["SUCCEEDED", "DEAD"]))
        def finish(self, i: str, state: str) -> None:
            """The worker side finishes a queued job (it writes the state field)."""
            job = self.jobs.get(i)
            if job is not None and job.st == "QUEUED":
                self.client.hset(self.store.keys.shard(job.shard).job(i), "st", state)
                job.st = state

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
                nxt = c.get(sk.next)
                if expected_due:
                    assert nxt is not None and int(nxt) <= min(expected_due.values()), (
                        "the next-due hint is later than a scheduled job: a wake-up could be missed")
            for i, job in self.jobs.items():
                key = self.store.keys.shard(job.shard).job(i)
                st_, due, msg = c.hmget(key, "st", "due", "msg")
                assert (st_, int(due)) == (job.st, job.due)
                assert (msg is not None) == (job.st in ("SCHEDULED", "CLAIMED"))
                assert (c.pttl(key) > 0) == (job.st in ("QUEUED", "CANCELLED")) or job.st in ("SUCCEEDED", "DEAD")
            counters = {k: 0 for k in ("scheduled", *self.counts)}
            for s in range(SHARDS):
                for k, v in c.hgetall(self.store.keys.shard(s).stats).items():
                    if k in counters:
                        counters[k] += int(v)
            assert counters["scheduled"] == len(self.jobs)
            assert {k: counters[k] for k in self.counts} == self.counts
            listed = [json.loads(m)["headers"]["id"] for m in c.lrange(self.queue, 0, -1)]
            assert listed == self.pushed[::-1]
            # No orphans: every record under the prefix is a job the model knows.
            for s in range(SHARDS):
                prefix = self.store.keys.shard(s).job_prefix
                for key in c.scan_iter(match=f"{prefix}*", count=1000):
                    assert key[len(prefix):] in self.jobs

    return StoreMachine


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucket_ms", [0, 1000])
def test_store_scripts_match_the_model(redis_url: str, bucket_ms: int) -> None:
    run_state_machine_as_test(
        machine(redis_url, bucket_ms),
        settings=settings(max_examples=40, stateful_step_count=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow], database=None),
    )
