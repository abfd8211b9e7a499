"""Every Lua script, run through ``Store`` on a real redis-server with synthetic ``now_ms``.

Records are written with hand-made fields (``msg`` is any string, ``lk`` a
list key under the test's prefix) so each script is tested on its own; the
envelope itself is covered by test_message.py and test_roundtrip.py.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Exchange, Queue
from support import make_app

from celery_delayed.errors import InvalidState, JobNotFound, LeaseLost
from celery_delayed.scheduler.loop import share
from celery_delayed.store import NewJob, Store

T = 1_800_000_000_000  # a synthetic "now", a multiple of every bucket width used
SEP = "\x06\x16"


@pytest.fixture(params=[0, 60_000], ids=["flat", "buckets"])
def bucket_ms(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def sapp(redis_url: str, uid: str, bucket_ms: int) -> Celery:
    return make_app(redis_url, uid, delayed_shards=4, delayed_bucket_ms=bucket_ms,
                    delayed_claim_lease_ms=10_000, delayed_record_ttl_s=3600, delayed_lease_ms=30_000)


@pytest.fixture
def store(sapp: Celery) -> Iterator[Store]:
    s = Store(sapp)
    yield s
    s.redis.client.close()


def job(store: Store, jid: str, due: int | str, shard: int = 0, **fields: str) -> NewJob:
    base = {"task": "t.x", "q": "q1", "msg": f"m-{jid}", "lk": lst(store)}
    return NewJob(jid, shard, str(due), base | fields)


def lst(store: Store, name: str = "list") -> str:
    return f"{store.keys.prefix}:{name}"


def indexed(store: Store, shard: int = 0) -> dict[str, int]:
    """Every indexed job id of a shard -> its score, across buckets."""
    sk = store.keys.shard(shard)
    keys = [sk.due] if store.config.bucket_ms == 0 else store.redis.client.zrange(sk.buckets, 0, -1)
    out: dict[str, int] = {}
    for k in keys:
        out.update({m: int(s) for m, s in store.redis.client.zrange(k, 0, -1, withscores=True)})
    return out


def record(store: Store, jid: str, shard: int = 0) -> dict[str, str]:
    return dict(store.redis.client.hgetall(store.keys.shard(shard).job(jid)))


def prefix_keys(client: redis.Redis, prefix: str) -> set[str]:
    return {str(k) for k in client.scan_iter(match=f"{prefix}:*", count=1000)}


class Wake:
    """A subscriber on the store's wake channel."""

    def __init__(self, store: Store) -> None:
        self.ps = store.redis.client.pubsub()
        self.ps.subscribe(store.keys.wake)
        msg = self.ps.get_message(timeout=2)
        assert msg and msg["type"] == "subscribe"

    def messages(self, expect: int = 0, timeout: float = 5.0, quiet: float = 0.2) -> list[str]:
        """Messages received until ``expect`` have come (within ``timeout``) and then ``quiet`` s of silence."""
        out: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            wait = quiet if len(out) >= expect else deadline - time.monotonic()
            if wait <= 0:
                return out
            msg = self.ps.get_message(timeout=wait)
            if msg is None and len(out) >= expect:
                return out
            if msg and msg["type"] == "message":
                out.append(str(msg["data"]))

    def close(self) -> None:
        self.ps.close()


@pytest.fixture
def wake(store: Store) -> Iterator[Wake]:
    w = Wake(store)
    yield w
    w.close()


# -- schedule ---------------------------------------------------------------


def test_schedule_new_job(store: Store) -> None:
    [res] = store.jobs.schedule([job(store, "a", T + 5000, ex="", sk="")], now_ms=T)
    assert (res.id, res.shard, res.due_ms, res.created, res.state) == ("a", 0, T + 5000, True, "SCHEDULED")
    rec = record(store, "a")
    assert rec == {"st": "SCHEDULED", "due": str(T + 5000), "created": str(T), "task": "t.x",
                   "q": "q1", "msg": "m-a", "lk": lst(store)}  # empty fields are not stored
    assert indexed(store) == {"a": T + 5000}
    assert store.redis.client.get(store.keys.shard(0).next) == str(T + 5000)
    assert store.redis.client.ttl(store.keys.shard(0).job("a")) == -1  # a scheduled job never expires
    if store.config.bucket_ms:
        sk = store.keys.shard(0)
        bucket = T + 5000 - (T + 5000) % store.config.bucket_ms
        assert store.redis.client.zrange(sk.buckets, 0, -1, withscores=True) == [(f"{sk.due}:{bucket}", bucket)]


def test_schedule_existing_id_returns_its_state_and_writes_nothing(store: Store) -> None:
    store.jobs.schedule([job(store, "a", T + 5000)], now_ms=T)
    before = record(store, "a")
    [res] = store.jobs.schedule([job(store, "a", T + 1, msg="other")], now_ms=T + 10)
    assert (res.created, res.state, res.due_ms) == (False, "SCHEDULED", T + 5000)
    assert record(store, "a") == before
    assert indexed(store) == {"a": T + 5000}
    store.jobs.cancel("a", 0, now_ms=T + 20)
    [res] = store.jobs.schedule([job(store, "a", T + 1)], now_ms=T + 30)
    assert (res.created, res.state) == (False, "CANCELLED")
    assert indexed(store) == {}


def test_schedule_relative_due_uses_now(store: Store) -> None:
    res = store.jobs.schedule([job(store, "a", "+1500"), job(store, "b", "+0")], now_ms=T)
    assert [r.due_ms for r in res] == [T + 1500, T]
    assert record(store, "a")["due"] == str(T + 1500)


def test_schedule_relative_due_uses_the_redis_clock(store: Store) -> None:
    before = store.redis.now_ms()
    [res] = store.jobs.schedule([job(store, "a", "+1000")])
    after = store.redis.now_ms()
    assert before + 1000 <= res.due_ms <= after + 1000
    assert before <= int(record(store, "a")["created"]) <= after


def test_schedule_many_shards_in_one_call(store: Store) -> None:
    jobs = [job(store, f"j{i}", T + i, shard=i % 4) for i in range(12)]
    res = store.jobs.schedule(jobs, now_ms=T)
    assert [r.id for r in res] == [j.id for j in jobs]
    assert [r.shard for r in res] == [i % 4 for i in range(12)]
    for s in range(4):
        assert set(indexed(store, s)) == {f"j{i}" for i in range(12) if i % 4 == s}


def test_schedule_wakes_only_when_earlier_than_next(store: Store, wake: Wake) -> None:
    nxt = store.keys.shard(2).next
    store.jobs.schedule([job(store, "a", T + 10_000, shard=2)], now_ms=T)
    assert wake.messages(1) == [f"2:{T + 10_000}"]
    store.jobs.schedule([job(store, "b", T + 20_000, shard=2)], now_ms=T)
    store.jobs.schedule([job(store, "c", T + 10_000, shard=2)], now_ms=T)  # equal: not earlier
    assert wake.messages() == []
    assert store.redis.client.get(nxt) == str(T + 10_000)
    # Several new jobs in one call: one message, for the earliest.
    store.jobs.schedule([job(store, "d", T + 9000, shard=2), job(store, "e", T + 5000, shard=2),
                    job(store, "f", T + 7000, shard=2)], now_ms=T)
    assert wake.messages(1) == [f"2:{T + 5000}"]
    assert store.redis.client.get(nxt) == str(T + 5000)
    # A duplicate id schedules nothing and wakes nobody.
    store.jobs.schedule([job(store, "a", T + 1, shard=2)], now_ms=T)
    assert wake.messages() == []


def test_schedule_past_due_is_released_at_once(store: Store) -> None:
    store.jobs.schedule([job(store, "old", T - 3_600_000)], now_ms=T)
    b = store.release.release_due(0, now_ms=T)
    assert b.ids == ["old"]


# -- release_due --------------------------------------------------------------


def test_release_due_releases_only_due_jobs(store: Store) -> None:
    store.jobs.schedule([job(store, "early", T - 1), job(store, "now", T), job(store, "late", T + 1)], now_ms=T - 10)
    b = store.release.release_due(0, now_ms=T)
    assert (b.count, b.skipped, b.next_due_ms, b.now_ms) == (2, 0, T + 1, T)
    assert sorted(b.ids) == ["early", "now"]
    assert store.redis.client.lrange(lst(store), 0, -1) == ["m-now", "m-early"]  # LPUSH: earliest at the tail
    assert indexed(store) == {"late": T + 1}
    assert store.redis.client.get(store.keys.shard(0).next) == str(T + 1)
    b = store.release.release_due(0, now_ms=T)
    assert (b.count, b.ids, b.next_due_ms) == (0, [], T + 1)


def test_release_due_record_becomes_queued_with_ttl_and_keeps_msg_until_it_starts(store: Store) -> None:
    store.jobs.schedule([job(store, "a", T, ev=json.dumps({"uuid": "a", "name": "t.x"}))], now_ms=T - 5)
    b = store.release.release_due(0, now_ms=T + 7)
    assert b.events == [{"uuid": "a", "name": "t.x"}]
    rec = record(store, "a")
    assert rec["st"] == "QUEUED" and rec["released"] == str(T + 7)
    # the message stays (the reconciler sends it again if the broker loses it) until the job starts
    assert rec["msg"] == "m-a" and rec["task"] == "t.x"
    assert store.redis.client.zscore(store.keys.shard(0).released, "a") == T  # a reconciler candidate, by due time
    ttl = store.redis.client.pttl(store.keys.shard(0).job("a"))
    assert 3_500_000 < ttl <= 3_600_000
    # The shard is empty: its next key is gone.
    assert b.next_due_ms is None
    assert not store.redis.client.exists(store.keys.shard(0).next)
    assert store.lookup.get("a")["st"] == "QUEUED"
    assert store.executions.start("a", 0, "w", now_ms=T + 8).run
    assert "msg" not in record(store, "a")
    assert store.redis.client.zscore(store.keys.shard(0).released, "a") is None


def test_release_due_limit_and_due_order(store: Store) -> None:
    """Earliest first, across buckets too (jobs spread over three minutes)."""
    dues = {f"j{i}": T - 150_000 + i * 30_000 for i in range(6)}  # T-150s .. T
    order = ["j3", "j0", "j5", "j1", "j4", "j2"]
    store.jobs.schedule([job(store, j, dues[j]) for j in order], now_ms=T - 200_000)
    released: list[str] = []
    for want in (2, 2, 2):
        b = store.release.release_due(0, now_ms=T, limit=2)
        assert b.count == want
        released += b.ids
    assert released == [f"j{i}" for i in range(6)]
    assert store.redis.client.lrange(lst(store), 0, -1)[::-1] == [f"m-j{i}" for i in range(6)]
    b = store.release.release_due(0, now_ms=T, limit=2)
    assert (b.count, b.next_due_ms) == (0, None)
    if store.config.bucket_ms:
        assert store.redis.client.zcard(store.keys.shard(0).buckets) == 0
    assert not prefix_keys(store.redis.client, store.keys.shard(0).due)


def test_release_due_batch_size_default(redis_url: str, uid: str, bucket_ms: int) -> None:
    s = Store(make_app(redis_url, uid, delayed_batch_size=3, delayed_bucket_ms=bucket_ms))
    s.jobs.schedule([job(s, f"j{i}", T - 10 + i) for i in range(5)], now_ms=T - 100)
    assert s.release.release_due(0, now_ms=T).count == 3
    assert s.release.release_due(0, now_ms=T).count == 2


def test_release_due_skips_jobs_no_longer_scheduled(store: Store) -> None:
    store.jobs.schedule([job(store, j, T - 3 + i) for i, j in enumerate(["a", "b", "c"])], now_ms=T - 10)
    assert store.jobs.cancel("a", 0, now_ms=T - 5) == "SCHEDULED"  # unindexed by cancel itself
    # A record changed behind the index's back (e.g. by a worker) is skipped, not pushed.
    store.redis.client.hset(store.keys.shard(0).job("b"), "st", "CANCELLED")
    b = store.release.release_due(0, now_ms=T)
    assert (b.count, b.skipped, b.ids) == (1, 1, ["c"])
    assert store.redis.client.lrange(lst(store), 0, -1) == ["m-c"]
    assert record(store, "a")["st"] == "CANCELLED"
    assert indexed(store) == {}


def test_release_due_with_a_missing_record_skips_it(store: Store) -> None:
    store.jobs.schedule([job(store, "a", T - 1), job(store, "b", T)], now_ms=T - 10)
    store.redis.client.delete(store.keys.shard(0).job("a"))
    b = store.release.release_due(0, now_ms=T)
    assert (b.count, b.skipped, b.ids) == (1, 1, ["b"])


def test_release_due_checks_the_lease(store: Store) -> None:
    sk = store.keys.shard(1)
    store.jobs.schedule([job(store, "a", T, shard=1)], now_ms=T - 10)
    store.redis.client.set(sk.lease, "owner-1|3")
    for owner, fence in (("owner-1", "2"), ("owner-2", "3"), ("owner-1", "")):
        with pytest.raises(LeaseLost):
            store.release.release_due(1, owner, fence, now_ms=T)
    assert indexed(store, 1) == {"a": T} and record(store, "a", 1)["st"] == "SCHEDULED"
    assert store.redis.client.llen(lst(store)) == 0
    assert store.release.release_due(1, "owner-1", "3", now_ms=T).ids == ["a"]
    store.redis.client.delete(sk.lease)
    with pytest.raises(LeaseLost):
        store.release.release_due(1, "owner-1", "3", now_ms=T)


def test_release_due_pushes_to_the_given_list_key_with_priority_suffix(store: Store) -> None:
    hi = lst(store, "q" + SEP + "9")
    store.jobs.schedule([job(store, "a", T, lk=hi), job(store, "b", T, lk=lst(store, "q"))], now_ms=T)
    store.release.release_due(0, now_ms=T)
    assert store.redis.client.lrange(hi, 0, -1) == ["m-a"]
    assert store.redis.client.lrange(lst(store, "q"), 0, -1) == ["m-b"]


def _bind(url: str, gkp: str, exchange: str, bindings: list[tuple[str, str]]) -> None:
    """Declare queues bound to a direct exchange with kombu itself (its binding set format)."""
    opts = {"global_keyprefix": gkp} if gkp else {}
    with Connection(url, transport_options=opts) as conn:
        ch = conn.default_channel
        ex = Exchange(exchange, type="direct")
        for queue, rk in bindings:
            Queue(queue, ex, routing_key=rk, channel=ch).declare()


@pytest.mark.parametrize(("gkp", "dead"), [("", ""), ("gkp_", ""), ("", "dead"), ("gkp_", "dead")])
def test_release_due_named_exchange_routes_through_bindings(
    store: Store, redis_url: str, uid: str, gkp: str, dead: str
) -> None:
    ex = f"ex{uid}"
    qa, qb, qc = f"qa{uid}", f"qb{uid}", f"qc{uid}"
    _bind(redis_url, gkp, ex, [(qa, "r1"), (qb, "r1"), (qc, "r2")])
    bx = f"{gkp}_kombu.binding.{ex}"
    assert store.redis.client.scard(bx) == 3
    opts = {"global_keyprefix": gkp} if gkp else {}
    if dead:
        opts["deadletter_queue"] = f"{dead}{uid}"
    store.app.conf.broker_transport_options = opts
    store = Store(store.app)  # the broker's layout is read once, when the store is made
    store.jobs.schedule([
        job(store, "one", T, lk="", bx=bx, rk="r1", ps=""),
        job(store, "two", T + 1, lk="", bx=bx, rk="r2", ps=SEP + "6"),
        job(store, "none", T + 2, lk="", bx=bx, rk="nobody", ps=""),
        job(store, "none9", T + 3, lk="", bx=bx, rk="nobody", ps=SEP + "9"),
    ], now_ms=T)
    assert store.release.release_due(0, now_ms=T + 10).count == 4
    c = store.redis.client
    assert c.lrange(f"{gkp}{qa}", 0, -1) == ["m-one"]
    assert c.lrange(f"{gkp}{qb}", 0, -1) == ["m-one"]
    assert c.lrange(f"{gkp}{qc}{SEP}6", 0, -1) == ["m-two"]
    assert c.llen(f"{gkp}{qc}") == 0
    # No queue bound with that routing key: kombu's dead-letter queue when one is
    # configured, else dropped as kombu drops it (test_message proves kombu does).
    for jid in ("none", "none9"):
        assert record(store, jid)["st"] == "QUEUED"
        assert record(store, jid).get("reason") == (None if dead else "UNROUTABLE")
    if dead:
        assert c.lrange(f"{gkp}{dead}{uid}", 0, -1) == ["m-none"]
        assert c.lrange(f"{gkp}{dead}{uid}{SEP}9", 0, -1) == ["m-none9"]
    assert not c.exists(f"{gkp}ae.undeliver", f"{gkp}ae.undeliver{SEP}9")


def test_release_due_without_routing_fields_falls_back_to_the_queue(store: Store) -> None:
    """A record stored for the publish path (no lk/bx) must not be lost by a direct release."""
    store.jobs.schedule([job(store, "a", T, lk="", q=lst(store, "fallback")), job(store, "b", T)], now_ms=T)
    b = store.release.release_due(0, now_ms=T)
    assert sorted(b.ids) == ["a", "b"]
    assert store.redis.client.lrange(lst(store, "fallback"), 0, -1) == ["m-a"]
    assert store.redis.client.lrange(lst(store), 0, -1) == ["m-b"]


# -- claim_due / ack_claimed ----------------------------------------------------


def test_claim_due_moves_jobs_in_flight(store: Store) -> None:
    sk = store.keys.shard(0)
    store.jobs.schedule([job(store, "a", T - 1, ex="ex1", rk="rk1", ev='{"x": 1}'), job(store, "b", T + 50)],
                   now_ms=T - 10)
    b = store.release.claim_due(0, now_ms=T)
    assert (b.count, b.skipped, b.ids) == (1, 0, ["a"])
    assert b.messages == [("m-a", "ex1", "rk1", "q1")]
    assert b.events == [{"x": 1}]
    rec = record(store, "a")
    assert rec["st"] == "CLAIMED" and rec["claims"] == "1" and rec["msg"] == "m-a"
    assert store.redis.client.zrange(sk.inflight, 0, -1, withscores=True) == [("a", T + 10_000)]
    assert indexed(store) == {"b": T + 50}
    assert b.next_due_ms == T + 50
    # Nothing due and the claim not expired: nothing claimed.
    assert store.release.claim_due(0, now_ms=T + 10).ids == []
    assert store.redis.client.llen(lst(store)) == 0  # the publish path never pushes itself


def test_claim_due_next_due_includes_the_claim_deadline(store: Store) -> None:
    store.jobs.schedule([job(store, "a", T)], now_ms=T)
    b = store.release.claim_due(0, now_ms=T)
    assert b.next_due_ms == T + 10_000  # the scheduler must look again when the claim expires
    assert store.redis.client.get(store.keys.shard(0).next) == str(T + 10_000)


def test_expired_claim_is_claimed_again(store: Store) -> None:
    store.jobs.schedule([job(store, "a", T)], now_ms=T)
    assert store.release.claim_due(0, now_ms=T).ids == ["a"]
    assert store.release.claim_due(0, now_ms=T + 9_999).ids == []
    b = store.release.claim_due(0, now_ms=T + 10_000)
    assert b.ids == ["a"] and b.messages[0][0] == "m-a"
    assert record(store, "a")["claims"] == "2"
    assert store.redis.client.zscore(store.keys.shard(0).inflight, "a") == T + 20_000
    assert store.release.ack_claimed(0, ["a"], now_ms=T + 10_001) == 1
    assert record(store, "a")["st"] == "QUEUED"


def test_late_ack_after_a_reclaim(store: Store) -> None:
    """Scheduler A claims, stalls past its claim lease; B claims again; both publish."""
    store.jobs.schedule([job(store, "a", T)], now_ms=T)
    assert store.release.claim_due(0, now_ms=T).ids == ["a"]  # A
    assert store.release.claim_due(0, now_ms=T + 10_000).ids == ["a"]  # B: A's claim expired
    assert store.release.ack_claimed(0, ["a"], now_ms=T + 10_001) == 1  # A published it: acknowledged
    assert record(store, "a")["st"] == "QUEUED"
    assert store.release.ack_claimed(0, ["a"], now_ms=T + 10_002) == 0  # B's ack finds nothing in flight
    assert store.release.claim_due(0, now_ms=T + 60_000).ids == []  # and nobody claims it a third time


def test_claim_due_limit_counts_stale_claims_first(store: Store) -> None:
    store.jobs.schedule([job(store, f"j{i}", T + i) for i in range(3)], now_ms=T)
    assert store.release.claim_due(0, now_ms=T + 5, limit=2).ids == ["j0", "j1"]
    later = T + 20_000
    assert store.release.claim_due(0, now_ms=later, limit=2).ids == ["j0", "j1"]  # stale first
    assert store.release.claim_due(0, now_ms=later, limit=2).ids == ["j2"]


def test_claim_due_skips_cancelled(store: Store) -> None:
    store.jobs.schedule([job(store, "a", T), job(store, "b", T), job(store, "c", T + 1)], now_ms=T)
    store.redis.client.hset(store.keys.shard(0).job("a"), "st", "CANCELLED")
    b = store.release.claim_due(0, now_ms=T)
    assert (b.ids, b.skipped) == (["b"], 1)
    # Cancelled while in flight: never claimed again, and the ack does not revive it.
    assert store.jobs.cancel("b", 0, now_ms=T + 1) == "CLAIMED"
    assert store.redis.client.zcard(store.keys.shard(0).inflight) == 0
    assert store.release.claim_due(0, now_ms=T + 60_000).ids == ["c"]
    assert store.release.ack_claimed(0, ["b"], now_ms=T + 60_001) == 0
    assert record(store, "b")["st"] == "CANCELLED"


def test_claim_due_drops_stale_claims_no_longer_claimed(store: Store) -> None:
    sk = store.keys.shard(0)
    store.jobs.schedule([job(store, "a", T)], now_ms=T)
    store.release.claim_due(0, now_ms=T)
    store.redis.client.hset(sk.job("a"), "st", "QUEUED")  # acknowledged by some other path
    b = store.release.claim_due(0, now_ms=T + 60_000)
    assert b.ids == [] and store.redis.client.zcard(sk.inflight) == 0


def test_claim_due_checks_the_lease(store: Store) -> None:
    store.jobs.schedule([job(store, "a", T)], now_ms=T)
    store.redis.client.set(store.keys.shard(0).lease, "me|1")
    with pytest.raises(LeaseLost):
        store.release.claim_due(0, "me", "0", now_ms=T)
    assert indexed(store) == {"a": T}
    assert store.release.claim_due(0, "me", "1", now_ms=T).ids == ["a"]


def test_ack_claimed(store: Store) -> None:
    sk = store.keys.shard(0)
    store.jobs.schedule([job(store, "a", T), job(store, "b", T)], now_ms=T)
    store.release.claim_due(0, now_ms=T)
    assert store.release.ack_claimed(0, [], now_ms=T) == 0
    assert store.release.ack_claimed(0, ["a", "nope"], now_ms=T + 3) == 1
    rec = record(store, "a")
    assert rec["st"] == "QUEUED" and rec["released"] == str(T + 3) and rec["msg"]  # kept until it starts
    assert 3_500_000 < store.redis.client.pttl(sk.job("a")) <= 3_600_000
    assert store.redis.client.zrange(sk.inflight, 0, -1) == ["b"]
    assert store.release.ack_claimed(0, ["a"], now_ms=T + 4) == 0  # twice: counted once
    assert record(store, "b")["st"] == "CLAIMED"


# -- cancel ---------------------------------------------------------------------


def test_cancel_scheduled(store: Store) -> None:
    sk = store.keys.shard(0)
    store.jobs.schedule([job(store, "a", T + 5000), job(store, "b", T + 600_000)], now_ms=T)
    assert store.jobs.cancel("a", now_ms=T + 1) == "SCHEDULED"
    rec = record(store, "a")
    assert rec["st"] == "CANCELLED" and rec["cancelled"] == str(T + 1) and "msg" not in rec
    assert 3_500_000 < store.redis.client.pttl(sk.job("a")) <= 3_600_000
    assert indexed(store) == {"b": T + 600_000}
    if store.config.bucket_ms:  # the emptied bucket left the bucket index
        assert store.redis.client.zcard(sk.buckets) == 1
    assert store.release.release_due(0, now_ms=T + 10_000).ids == []


def test_cancel_claimed_queued_cancelled_missing(store: Store) -> None:
    store.jobs.schedule([job(store, "c", T), job(store, "q", T + 1)], now_ms=T)
    store.release.claim_due(0, now_ms=T, limit=1)
    assert store.jobs.cancel("c", now_ms=T + 1) == "CLAIMED"
    store.release.release_due(0, now_ms=T + 1)
    assert record(store, "q")["st"] == "QUEUED"
    assert store.jobs.cancel("q", now_ms=T + 2) == "QUEUED"
    rec = record(store, "q")
    assert rec["st"] == "CANCELLED" and rec["released"] == str(T + 1)
    with pytest.raises(InvalidState, match="cannot cancel job 'q': it is CANCELLED") as e:
        store.jobs.cancel("q", now_ms=T + 3)
    assert e.value.state == "CANCELLED"
    store.redis.client.hset(store.keys.shard(0).job("c"), "st", "SUCCEEDED")
    with pytest.raises(InvalidState):
        store.jobs.cancel("c")
    with pytest.raises(JobNotFound, match="'nope'"):
        store.jobs.cancel("nope")


def test_cancel_finds_a_job_in_another_shard(store: Store) -> None:
    """A job scheduled with a shard_key lives away from its id's shard."""
    own = store.layout.shard_of("x")
    other = (own + 1) % 4
    store.jobs.schedule([job(store, "x", T, shard=other)], now_ms=T)
    assert store.lookup.locate("x") == other
    assert store.jobs.cancel("x", now_ms=T) == "SCHEDULED"
    assert indexed(store, other) == {}


# -- reschedule -----------------------------------------------------------------


def test_reschedule_moves_and_wakes(store: Store, wake: Wake) -> None:
    sk = store.keys.shard(0)
    store.jobs.schedule([job(store, "a", T + 600_000), job(store, "b", T + 700_000)], now_ms=T)
    assert wake.messages(1) == [f"0:{T + 600_000}"]
    assert store.jobs.reschedule("a", str(T + 650_000), now_ms=T) == T + 650_000  # later: no wake
    assert wake.messages() == []
    assert indexed(store) == {"a": T + 650_000, "b": T + 700_000}
    assert record(store, "a")["due"] == str(T + 650_000)
    assert store.jobs.reschedule("b", "+1000", now_ms=T) == T + 1000  # earlier: wake
    assert wake.messages(1) == [f"0:{T + 1000}"]
    assert store.redis.client.get(sk.next) == str(T + 1000)
    if store.config.bucket_ms:
        buckets = store.redis.client.zrange(sk.buckets, 0, -1)
        assert len(buckets) == 2 and all(store.redis.client.exists(k) for k in buckets)
    assert store.release.release_due(0, now_ms=T + 1000).ids == ["b"]


def test_reschedule_refuses_when_not_scheduled(store: Store) -> None:
    store.jobs.schedule([job(store, "a", T)], now_ms=T)
    store.release.release_due(0, now_ms=T)
    before = record(store, "a")
    with pytest.raises(InvalidState, match="cannot reschedule job 'a': it is QUEUED"):
        store.jobs.reschedule("a", str(T + 10), now_ms=T)
    assert record(store, "a") == before and indexed(store) == {}
    with pytest.raises(JobNotFound):
        store.jobs.reschedule("nope", "+10", now_ms=T)


# -- heartbeat / shard leases ----------------------------------------------------


def test_heartbeat_expiry_and_leave(store: Store) -> None:
    key = store.keys.schedulers
    beat = store.fleet.heartbeat("a", now_ms=T)
    assert (beat.now_ms, beat.members, beat.deadlines, beat.joined) == (T, ["a"], {"a": T + 30_000}, True)
    beat = store.fleet.heartbeat("b", now_ms=T + 20_000)
    assert (beat.members, beat.deadlines, beat.joined) == (["a", "b"], {"a": T + 30_000, "b": T + 50_000}, True)
    assert store.fleet.heartbeat("b", now_ms=T + 21_000).joined is False  # renewed, not joined
    assert store.redis.client.zscore(key, "a") == T + 30_000
    # a's deadline (T+30s) passed: it is dropped by whoever beats next.
    beat = store.fleet.heartbeat("b", now_ms=T + 30_000)
    assert (beat.now_ms, beat.members, beat.joined) == (T + 30_000, ["b"], False)
    assert store.fleet.heartbeat("c", now_ms=T + 31_000).members == ["b", "c"]
    # a comes back: joined again (its shards may have been taken while it was counted dead).
    assert store.fleet.heartbeat("a", now_ms=T + 31_500).joined is True
    beat = store.fleet.heartbeat("c", leave=True, now_ms=T + 32_000)
    assert (beat.now_ms, beat.members) == (T + 32_000, ["a", "b"])
    assert sorted(store.redis.client.zrange(key, 0, -1)) == ["a", "b"]
    # The settings are written when a member joins, and dropped with it.
    assert set(store.redis.client.hgetall(store.keys.scheduler_settings)) == {"a", "b"}


def test_heartbeat_costs_four_commands_when_nothing_changes(redis_url: str, uid: str) -> None:
    """An idle scheduler's heartbeat is its only regular Redis traffic: keep it small (INFO commandstats)."""
    s = Store(make_app(redis_url, uid))
    s.fleet.heartbeat("a")
    s.fleet.shard_lease("a", range(s.config.shards), live=["a"])
    s.redis.client.config_resetstat()
    s.fleet.heartbeat("a")
    stats = s.redis.client.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()
             if k not in ("cmdstat_config|resetstat", "cmdstat_info")}
    assert calls == {"evalsha": 1, "time": 1, "zadd": 1, "zrange": 1}, calls


def _members(store: Store, names: list[str], now: int) -> None:
    for n in names:
        store.fleet.heartbeat(n, now_ms=now)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_shares_split_evenly_and_deterministically(redis_url: str, uid: str, m: int) -> None:
    s = Store(make_app(redis_url, uid, delayed_shards=10))
    names = [f"s{i}" for i in range(m)]
    _members(s, names, T)
    got = {n: s.fleet.shard_lease(n, share(names, n, 10), live=names) for n in names}
    assert all(not waits for _, waits in got.values())
    held = sorted(shard for g, _ in got.values() for shard in g)
    assert held == list(range(10))  # every shard exactly once
    sizes = [len(g) for g, _ in got.values()]
    assert max(sizes) - min(sizes) <= 1
    for n, (g, _) in got.items():
        for shard, fence in g.items():
            assert s.redis.client.get(s.keys.shard(shard).lease) == f"{n}|{fence}"
    # Again, in any order: the same shards and no fence moves.
    assert {n: s.fleet.shard_lease(n, share(names, n, 10), live=names) for n in reversed(names)} == got
    assert share(names, "stranger", 10) == set()


def test_a_shard_moves_only_when_given_up_or_its_holder_is_dead_and_its_fence_moves(redis_url: str,
                                                                                     uid: str) -> None:
    s = Store(make_app(redis_url, uid, delayed_shards=4, delayed_lease_ms=30_000))
    live = ["a", "b"]
    assert s.fleet.shard_lease("a", range(4), live=["a"]) == ({0: "1", 1: "1", 2: "1", 3: "1"}, {})
    # b wants shards 1 and 3 while a, their holder, is a live member: refused, told who holds them.
    assert s.fleet.shard_lease("b", [1, 3], live=live) == ({}, {1: "a", 3: "a"})
    # a gives up 1 and keeps 0 and 2 (same fences); b takes 1 (fence + 1).
    assert s.fleet.shard_lease("a", [0, 2], give=[1], live=live) == ({0: "1", 2: "1"}, {})
    assert s.fleet.shard_lease("b", [1, 3], live=live) == ({1: "2"}, {3: "a"})
    # a's old lease on shard 1 no longer lets it release there; b's does.
    with pytest.raises(LeaseLost):
        s.release.release_due(1, "a", "1", now_ms=T + 3000)
    s.release.release_due(1, "b", "2", now_ms=T + 3000)
    # a is paused past its membership (no longer live): b takes shard 3...
    assert s.fleet.shard_lease("b", [3], live=["b"]) == ({3: "2"}, {})
    # ...and a, back, can neither release from it nor take it back while b is live.
    with pytest.raises(LeaseLost):
        s.release.release_due(3, "a", "1", now_ms=T + 30_001)
    assert s.fleet.shard_lease("a", [0, 2, 3], live=live) == ({0: "1", 2: "1"}, {3: "b"})
    # A lease is its holder's as long as nobody took it, whatever the time: nothing renews it.
    assert s.fleet.shard_lease("a", [0], live=["a"]) == ({0: "1"}, {})
    # Giving up a shard someone else holds changes nothing.
    assert s.fleet.shard_lease("a", [], give=[1], live=live) == ({}, {})
    assert s.redis.client.get(s.keys.shard(1).lease) == "b|2"


def test_checking_a_held_lease_costs_two_commands(redis_url: str, uid: str) -> None:
    s = Store(make_app(redis_url, uid, delayed_shards=2))
    s.fleet.shard_lease("a", [0], live=["a"])
    s.redis.client.config_resetstat()
    assert s.fleet.shard_lease("a", [0], live=["a"]) == ({0: "1"}, {})
    stats = s.redis.client.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()
             if k not in ("cmdstat_config|resetstat", "cmdstat_info")}
    assert calls == {"evalsha": 1, "get": 1}, calls


def test_a_lease_of_an_earlier_version_is_taken_when_its_holder_is_not_live(redis_url: str, uid: str) -> None:
    s = Store(make_app(redis_url, uid, delayed_shards=2))
    s.redis.client.set(s.keys.shard(0).lease, "old|4")  # as rebalance.lua or shard_lease.lua of old versions wrote it
    s.redis.client.set(s.keys.shard(0).fence, 4)
    assert s.fleet.shard_lease("a", [0], live=["a", "old"]) == ({}, {0: "old"})
    assert s.fleet.shard_lease("a", [0], live=["a"]) == ({0: "5"}, {})


# -- script loading ---------------------------------------------------------------


def test_noscript_is_recovered(store: Store, redis_server: Any) -> None:
    store.jobs.schedule([job(store, "a", T)], now_ms=T)
    store.redis.client.script_flush()
    # One shard: EVALSHA -> NOSCRIPT -> SCRIPT LOAD -> EVALSHA.
    assert store.jobs.schedule([job(store, "b", T)], now_ms=T)[0].created
    store.redis.client.script_flush()
    # Several shards in one pipeline: the NOSCRIPT replies are retried after a load.
    res = store.jobs.schedule([job(store, f"m{i}", T, shard=i) for i in range(4)], now_ms=T)
    assert [r.id for r in res] == [f"m{i}" for i in range(4)]
    assert all(r.created for r in res)
    store.redis.client.script_flush()
    assert store.release.release_due(0, now_ms=T).count == 3
    for op in (lambda: store.jobs.cancel("m1", now_ms=T), lambda: store.fleet.heartbeat("x", now_ms=T),
               lambda: store.fleet.shard_lease("x", [1], live=["x"]), lambda: store.release.claim_due(2, now_ms=T),
               lambda: store.release.ack_claimed(2, ["m2"], now_ms=T),
               lambda: store.jobs.reschedule("m3", "+5", now_ms=T)):
        store.redis.client.script_flush()
        op()


# -- a random walk against a model ---------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_match_a_model(store: Store, seed: int) -> None:
    """schedule / cancel / reschedule / release / claim / ack in random order, checked against a dict model.

    Due times cluster around bucket edges (when buckets are on) and the clock
    moves forward in small and large steps.
    """
    rnd = random.Random(seed)
    width = store.config.bucket_ms or 60_000
    now = T
    model: dict[str, tuple[str, int]] = {}  # id -> (state, due)
    inflight: dict[str, int] = {}  # id -> claim deadline
    pushed: list[str] = []
    n = 0

    def due_near() -> int:
        edge = now - now % width + rnd.randint(-2, 3) * width
        return edge + rnd.choice([-1, 0, 1, rnd.randint(0, width - 1)])

    for _ in range(400):
        op = rnd.random()
        ids = sorted(model)
        if op < 0.35:
            batch = []
            for _ in range(rnd.randint(1, 4)):
                n += 1
                batch.append(job(store, f"j{n}", due_near(), shard=0))
            for res in store.jobs.schedule(batch, now_ms=now):
                assert res.created
                model[res.id] = ("SCHEDULED", res.due_ms)
        elif op < 0.45 and ids:
            jid = rnd.choice(ids)
            st, _ = model[jid]
            if st in ("SCHEDULED", "CLAIMED", "QUEUED"):
                assert store.jobs.cancel(jid, 0, now_ms=now) == st
                model[jid] = ("CANCELLED", model[jid][1])
                inflight.pop(jid, None)
            else:
                with pytest.raises(InvalidState):
                    store.jobs.cancel(jid, 0, now_ms=now)
        elif op < 0.55 and ids:
            jid = rnd.choice(ids)
            st, _ = model[jid]
            new = due_near()
            if st == "SCHEDULED":
                assert store.jobs.reschedule(jid, str(new), 0, now_ms=now) == new
                model[jid] = ("SCHEDULED", new)
            else:
                with pytest.raises(InvalidState):
                    store.jobs.reschedule(jid, str(new), 0, now_ms=now)
        elif op < 0.75:
            limit = rnd.randint(1, 6)
            b = store.release.release_due(0, now_ms=now, limit=limit)
            due = sorted((d, i) for i, (st, d) in model.items() if st == "SCHEDULED" and d <= now)
            want = [i for _, i in due[:limit]]
            assert sorted(b.ids) == sorted(want)
            assert [model[i][1] for i in b.ids] == sorted(model[i][1] for i in b.ids)  # earliest first
            for i in b.ids:
                model[i] = ("QUEUED", model[i][1])
            pushed += b.ids
        elif op < 0.85:
            limit = rnd.randint(1, 6)
            b = store.release.claim_due(0, now_ms=now, limit=limit)
            stale = sorted((d, i) for i, d in inflight.items() if d <= now)
            due = sorted((d, i) for i, (st, d) in model.items() if st == "SCHEDULED" and d <= now)
            want = [i for _, i in stale[:limit]]
            want += [i for _, i in due[:limit - len(want)]]
            assert sorted(b.ids) == sorted(want)
            for i in b.ids:
                model[i] = ("CLAIMED", model[i][1])
                inflight[i] = now + 10_000
            if rnd.random() < 0.5 and b.ids:  # published and acknowledged; else the claim lapses
                assert store.release.ack_claimed(0, b.ids, now_ms=now) == len(b.ids)
                for i in b.ids:
                    model[i] = ("QUEUED", model[i][1])
                    inflight.pop(i)
        else:
            now += rnd.choice([1, 500, width // 2, width, 3 * width])
        # The index holds exactly the scheduled jobs, with their due times.
        scheduled = {i: d for i, (st, d) in model.items() if st == "SCHEDULED"}
        assert indexed(store) == scheduled
        # The next key may be early (a cancelled job) but never later than a job:
        # a job scheduled before it would then wake no scheduler.
        if scheduled:
            nxt = store.redis.client.get(store.keys.shard(0).next)
            assert nxt is not None and int(nxt) <= min(scheduled.values())
        assert {i: int(s) for i, s in store.redis.client.zrange(store.keys.shard(0).inflight, 0, -1, withscores=True)} \
            == inflight
    assert len(pushed) == len(set(pushed)) == store.redis.client.llen(lst(store))
    for jid, (st, _) in model.items():
        assert record(store, jid)["st"] == st


def test_release_reads_only_as_many_buckets_as_it_needs(redis_url: str, uid: str) -> None:
    """One-ms buckets: each due job in a bucket of its own; a release of 7 reads 7 buckets.

    A stale empty bucket in the index costs one slot once and is dropped.
    """
    s = Store(make_app(redis_url, uid, delayed_bucket_ms=1))
    s.jobs.schedule([job(s, f"j{i:02}", T - 100 + i) for i in range(30)], now_ms=T)
    sk = s.keys.shard(0)
    assert s.redis.client.zcard(sk.buckets) == 30
    s.redis.client.zadd(sk.buckets, {f"{sk.due}:{T - 1000}": T - 1000})  # names no job
    got: list[str] = []
    counts = []
    while b := s.release.release_due(0, now_ms=T, limit=7).ids:
        counts.append(len(b))
        got += b
    assert got == [f"j{i:02}" for i in range(30)]
    assert counts == [6, 7, 7, 7, 3]
    assert s.redis.client.zcard(sk.buckets) == 0
