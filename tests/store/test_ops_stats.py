"""The fleet-wide figures the scripts keep per shard (issue 12): counters, gauges, histograms, the pending index."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from celery import Celery
from support import make_app

from celery_delayed.metrics import render
from celery_delayed.store import NewJob, Store
from celery_delayed.store.keys import index_part, parse_index_part
from celery_delayed.store.loader import lua_dir
from celery_delayed.store.stats import LATENESS_BOUNDS_MS, FleetStats

T = 1_800_000_000_000


@pytest.fixture(params=[0, 60_000], ids=["flat", "buckets"])
def sapp(request: pytest.FixtureRequest, redis_url: str, uid: str) -> Celery:
    return make_app(redis_url, uid, delayed_shards=4, delayed_bucket_ms=int(request.param))


@pytest.fixture
def store(sapp: Celery) -> Iterator[Store]:
    s = Store(sapp)
    yield s
    s.redis.client.close()


def job(store: Store, jid: str, due: int, task: str = "t.a", q: str = "q1", shard: int = 0) -> NewJob:
    return NewJob(jid, shard, str(due), {"task": task, "q": q, "msg": f"m-{jid}", "lk": f"{store.keys.prefix}:l"})


def test_lua_buckets_match_python():
    text = (lua_dir() / "includes" / "ops.lua").read_text()
    m = re.search(r"^local LATE_MS = \{([0-9, ]+)\}$", text, re.M)
    assert m and tuple(int(x) for x in m.group(1).split(",")) == LATENESS_BOUNDS_MS


def test_index_part_round_trips():
    for task, q in (("t.a", "q1"), ("a:b", "c:d"), ("é:ü", ""), ("", "x")):
        assert parse_index_part(index_part(task, q)) == (task, q)


def test_counters_gauges_and_histograms_follow_a_jobs_life(store: Store):
    store.jobs.schedule([job(store, "a", T - 30), job(store, "b", T - 400), job(store, "c", T + 60_000, task="t.b"),
                    job(store, "d", T + 90_000, task="t.b", q="q2")], now_ms=T - 1000)
    store.jobs.schedule([job(store, "a", T)], now_ms=T - 1000)  # a repeat is not counted
    sk = store.keys.shard(0)
    assert set(store.redis.client.smembers(sk.index_parts)) == {index_part("t.a", "q1"), index_part("t.b", "q1"),
                                                          index_part("t.b", "q2")}
    snap = FleetStats(store).snapshot()
    assert snap.counters["scheduled"] == 4
    assert snap.pending == 4
    assert snap.pending_by == {("t.a", "q1"): 2, ("t.b", "q1"): 1, ("t.b", "q2"): 1}

    batch = store.release.release_due(0, now_ms=T)
    assert sorted(batch.ids) == ["a", "b"]
    snap = FleetStats(store).snapshot()
    assert snap.counters["released"] == 2 and snap.queued == 2
    assert snap.pending_by == {("t.b", "q1"): 1, ("t.b", "q2"): 1}
    assert snap.release_lateness.counts[LATENESS_BOUNDS_MS.index(50)] == 1  # 30 ms late
    assert snap.release_lateness.counts[LATENESS_BOUNDS_MS.index(500)] == 1  # 400 ms late
    assert snap.release_lateness.sum_ms == 430
    assert store.redis.client.zcard(sk.index(index_part("t.a", "q1"))) == 0
    assert index_part("t.a", "q1") not in store.redis.client.smembers(sk.index_parts)

    assert store.executions.start("a", 0, "w1", now_ms=T + 2000).run
    assert store.executions.start("b", 0, "w2", now_ms=T + 7).run
    snap = FleetStats(store).snapshot()
    assert (snap.counters["started"], snap.running, snap.queued) == (2, 2, 0)
    assert snap.start_lateness.counts[LATENESS_BOUNDS_MS.index(2500)] == 1  # 2,030 ms after due
    assert snap.start_lateness.counts[LATENESS_BOUNDS_MS.index(500)] == 1  # 407 ms
    assert store.executions.finish("a", 0, "w1", "SUCCEEDED", now_ms=T + 3000).ok
    assert not store.executions.start("a", 0, "w3", now_ms=T + 4000).run  # a duplicate delivery
    assert store.executions.finish("b", 0, "w2", "FAILED", now_ms=T + 3000).ok
    assert store.jobs.cancel("c", now_ms=T) == "SCHEDULED"
    snap = FleetStats(store).snapshot()
    c = snap.counters
    assert (c["succeeded"], c["failed"], c["duplicates"], c["cancelled"]) == (1, 1, 1, 1)
    assert snap.running == 0 and snap.pending_by == {("t.b", "q2"): 1} and snap.pending == 1

    text = render(store.app)[0].decode()
    assert 'celery_delayed_pending_jobs{queue="q2",task="t.b"} 1.0' in text
    assert "celery_delayed_released_total 2.0" in text
    assert 'celery_delayed_release_lateness_seconds_bucket{le="0.05"} 1.0' in text
    assert 'celery_delayed_release_lateness_seconds_bucket{le="+Inf"} 2.0' in text
    assert "celery_delayed_release_lateness_seconds_sum 0.43" in text
    assert "celery_delayed_start_lateness_seconds_count 2.0" in text
    assert "celery_delayed_running_jobs 0.0" in text
    assert not re.search(r"^celery_delayed_pending_jobs \d", text, re.M)  # no separate total series


def test_retry_dead_and_requeue_keep_the_index_and_counters(store: Store):
    store.jobs.schedule([job(store, "r", T - 10)], now_ms=T - 1000)
    store.release.release_due(0, now_ms=T)
    assert store.executions.start("r", 0, "w", now_ms=T).run
    out = store.executions.retry("r", 0, str(T + 5000), 1, {"msg": "m-r2"}, owner="w", now_ms=T + 10)
    assert out.ok
    snap = FleetStats(store).snapshot()
    assert snap.counters["retried"] == 1 and snap.running == 0
    assert snap.pending_by == {("t.a", "q1"): 1}
    store.release.release_due(0, now_ms=T + 5000)
    assert store.executions.start("r", 0, "w2", now_ms=T + 5001).run
    assert store.executions.dead("r", 0, {"msg": "m-r3"}, owner="w2", now_ms=T + 5002).ok
    snap = FleetStats(store).snapshot()
    assert snap.counters["dead"] == 1 and snap.dead_letters == 1 and snap.running == 0
    store.dead_letters.requeue(0, ["r"], str(T + 9000), now_ms=T + 6000)
    snap = FleetStats(store).snapshot()
    assert snap.counters["requeued"] == 1 and snap.pending_by == {("t.a", "q1"): 1}


def test_coming_due_counts_windows(store: Store):
    store.jobs.schedule([job(store, f"j{i}", T + i * 60_000 + 1) for i in range(5)], now_ms=T)
    assert FleetStats(store).coming_due(T, 60_000, 6) == [1, 1, 1, 1, 1, 0]
    assert FleetStats(store).coming_due(T, 120_000, 3) == [2, 2, 1]


def test_pause_holds_due_jobs_of_a_task_and_resume_releases_them(store: Store):
    store.jobs.schedule([job(store, "a", T - 10), job(store, "b", T - 20, task="t.b"), job(store, "c", T - 5, q="q9")],
                   now_ms=T - 1000)
    store.jobs.pause(["task:t.b", "queue:q9"], now_ms=T - 500)
    assert set(store.jobs.pauses()) == {"task:t.b", "queue:q9"}
    batch = store.release.release_due(0, now_ms=T)
    assert batch.ids == ["a"]
    snap = FleetStats(store).snapshot()
    assert snap.held == 2 and snap.pending == 2 and snap.overdue == 0
    assert store.lookup.get("b")["st"] == "SCHEDULED"
    assert store.jobs.resume(["task:t.b"], now_ms=T + 1) == 1  # b; c stays held by its queue's pause
    assert FleetStats(store).snapshot().held == 1
    assert store.jobs.resume(["queue:q9"], now_ms=T + 2) == 1
    assert not store.jobs.pauses()
    assert sorted(store.release.release_due(0, now_ms=T + 3).ids) == ["b", "c"]


def test_pause_all_releases_nothing_until_resumed(store: Store):
    store.jobs.schedule([job(store, "a", T - 10)], now_ms=T - 1000)
    store.jobs.pause(["all"])
    b = store.release.release_due(0, now_ms=T)
    assert (b.count, b.next_due_ms) == (0, None)
    assert store.lookup.get("a")["st"] == "SCHEDULED"
    store.jobs.resume()
    assert store.release.release_due(0, now_ms=T).ids == ["a"]


def test_resume_applies_the_misfire_policy(store: Store):
    late = job(store, "m", T - 10)
    late = NewJob(late.id, late.shard, late.due, {**late.fields, "ml": "1000", "mf": "skip"})
    store.jobs.schedule([late], now_ms=T - 1000)
    store.jobs.pause(["task:t.a"])
    store.release.release_due(0, now_ms=T)
    store.jobs.resume()
    b = store.release.release_due(0, now_ms=T + 60_000)
    assert b.not_sent and b.not_sent[0][:2] == ("m", "SKIPPED")
    assert FleetStats(store).snapshot().counters["skipped"] == 1


def test_promote_and_cancel_matching_read_the_index(store: Store):
    jobs = [job(store, f"x{i}", T + 3_600_000 + i, task="t.x") for i in range(7)]
    jobs += [job(store, f"y{i}", T + 3_600_000 + i, task="t.y", shard=i % 4) for i in range(5)]
    store.jobs.schedule(jobs, now_ms=T)
    assert store.jobs.promote("x0", now_ms=T) == T
    assert store.lookup.get("x0")["due"] == str(T)
    assert store.jobs.promote_matching(task="t.x", now_ms=T + 1, batch=2) == 6
    assert sorted(store.release.release_due(0, now_ms=T + 2, limit=100).ids) == [f"x{i}" for i in range(7)]
    cancelled = store.jobs.cancel_matching(task="t.y", due_from_ms=T + 3_600_001, due_to_ms=T + 3_600_003, batch=1)
    assert sorted(cancelled) == ["y1", "y2", "y3"]
    assert store.lookup.get("y2")["st"] == "CANCELLED"
    snap = FleetStats(store).snapshot()
    assert snap.pending_by == {("t.y", "q1"): 2}
    assert snap.counters["promoted"] == 7 and snap.counters["cancelled"] == 3
    with pytest.raises(Exception, match="give a task name or a queue"):
        store.jobs.cancel_matching()


def test_lateness_buckets_at_their_edges(rclient):
    ops = (lua_dir() / "includes" / "ops.lua").read_text()
    script = ops + """
local out = {}
for i = 1, #ARGV do
  local h = late_new()
  late_add(h, tonumber(ARGV[i]))
  for b = 1, #LATE_MS + 1 do if h[b] then out[i] = b end end
end
return out
"""
    samples = [-5, 0, 5, 6, 10, 11, 1000, 1001, 1_800_000, 1_800_001, 10**9]
    got = rclient.eval(script, 0, *samples)
    expected = [next((i + 1 for i, b in enumerate(LATENESS_BOUNDS_MS) if max(0, ms) <= b), len(LATENESS_BOUNDS_MS) + 1)
                for ms in samples]
    assert got == expected
