"""Branches of the worker-side and dead-letter scripts that the other tests do not reach, and the
views' paging across their page boundaries, on a real redis-server with synthetic ``now_ms``.

start.lua refusing every state but QUEUED / CLAIMED / RUNNING; finish.lua into QUEUED and
FAILED; requeue.lua's reply for each kind of id (OK, NOT_FOUND, WRONG_STATE, NO_MESSAGE);
retry.lua into time buckets; ``Pending`` and ``DeadLetters`` pages across the 500-id reads,
``requeue_all`` past letters it cannot move, ``purge`` past its 1,000-letter batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from support import make_app

from celery_delayed import InvalidState, JobNotFound, dlq
from celery_delayed.store import NewJob, Pending, Store
from celery_delayed.store.dead_letters import _PURGE_BATCH
from celery_delayed.store.paging import PAGE as _PAGE
from celery_delayed.vocab import Reply

T = 1_800_000_000_000  # a synthetic "now", a multiple of every bucket width used
EXEC_LEASE_MS = 1000
DONE_TTL_S = 600


@pytest.fixture(params=[0, 60_000], ids=["flat", "buckets"])
def bapp(request: pytest.FixtureRequest, redis_url: str, uid: str) -> Celery:
    return make_app(redis_url, uid, delayed_shards=2, delayed_bucket_ms=int(request.param),
                    delayed_exec_lease_ms=EXEC_LEASE_MS, delayed_done_ttl_s=DONE_TTL_S)


@pytest.fixture
def store(bapp: Celery) -> Iterator[Store]:
    s = Store(bapp)
    yield s
    s.redis.client.close()


def lst(store: Store) -> str:
    return f"{store.keys.prefix}:list"


def new(store: Store, jid: str, due: int = T, shard: int = 0, **fields: str) -> NewJob:
    base = {"task": "t.x", "q": "q1", "msg": f"m-{jid}", "lk": lst(store)}
    return NewJob(jid, shard, str(due), base | fields)


def queued(store: Store, jid: str, shard: int = 0, **fields: str) -> None:
    """A job scheduled at T and released at T: QUEUED."""
    assert store.jobs.schedule([new(store, jid, T, shard, **fields)], now_ms=T)[0].created
    assert jid in store.release.release_due(shard, now_ms=T).ids


def rec(store: Store, jid: str, shard: int = 0) -> dict[str, str]:
    return dict(store.redis.client.hgetall(store.keys.shard(shard).job(jid)))


def ttl_ms(store: Store, jid: str, shard: int = 0) -> int:
    return int(store.redis.client.pttl(store.keys.shard(shard).job(jid)))


# -- start.lua ------------------------------------------------------------------


def test_start_refuses_every_state_but_queued_claimed_and_running(store: Store) -> None:
    """WRONG_STATE with the record's state and attempts, the record untouched, for each state a
    delivery may find that is not runnable."""
    store.jobs.schedule([new(store, "pending", T + 60_000)], now_ms=T)  # SCHEDULED
    queued(store, "failed")
    assert store.executions.start("failed", 0, "w", now_ms=T).code == Reply.OK
    assert store.executions.fail("failed", 0, {"etype": "E"}, owner="w", now_ms=T + 1).ok  # FAILED after 1 attempt
    queued(store, "dead")
    assert store.executions.dead("dead", 0, {"etype": "E", "msg": "m"}, now_ms=T).ok  # DEAD
    store.jobs.schedule([new(store, "expired", T, exp=str(T + 5))], now_ms=T)
    store.jobs.schedule([new(store, "skipped", T, ml="10", mf="skip")], now_ms=T)
    assert store.release.release_due(0, now_ms=T + 100).skipped == 2  # EXPIRED, SKIPPED
    queued(store, "cancelled")
    store.jobs.cancel("cancelled", 0, now_ms=T)
    queued(store, "done")
    assert store.executions.start("done", 0, "w", now_ms=T).code == Reply.OK
    assert store.executions.finish("done", 0, "w", "SUCCEEDED", now_ms=T + 1).ok
    want = {"pending": ("SCHEDULED", 0), "failed": ("FAILED", 1), "dead": ("DEAD", 0), "expired": ("EXPIRED", 0),
            "skipped": ("SKIPPED", 0), "cancelled": ("CANCELLED", 0), "done": ("SUCCEEDED", 1)}
    for jid, (state, att) in want.items():
        before = rec(store, jid)
        got = store.executions.start(jid, 0, "w2", "host-2", now_ms=T + 200)
        assert (got.code, got.state, got.attempt, got.lease_until_ms) == (Reply.WRONG_STATE, state, att, 0), jid
        assert rec(store, jid) == before, jid
    assert store.executions.start("never", 0, "w").code == Reply.NOT_FOUND


def test_start_takes_over_a_passed_lease_and_restarts_its_own(store: Store) -> None:
    queued(store, "a")
    assert store.executions.start("a", 0, "w1", now_ms=T).attempt == 1
    busy = store.executions.start("a", 0, "w2", now_ms=T + EXEC_LEASE_MS - 1)
    assert (busy.code, busy.lease_until_ms) == (Reply.BUSY, T + EXEC_LEASE_MS)
    again = store.executions.start("a", 0, "w1", now_ms=T + 10)  # the same execution owner: its own lease
    assert (again.code, again.attempt) == (Reply.OK, 2)
    taken = store.executions.start("a", 0, "w2", now_ms=T + 10 + EXEC_LEASE_MS)  # at the deadline: passed
    assert (taken.code, taken.attempt, taken.lease_until_ms) == (Reply.OK, 3, T + 10 + 2 * EXEC_LEASE_MS)
    assert rec(store, "a")["lo"] == "w2"


# -- finish.lua -------------------------------------------------------------------


def test_finish_into_queued_lets_the_next_delivery_start_it(store: Store) -> None:
    queued(store, "a")
    assert store.executions.start("a", 0, "w1", now_ms=T).code == Reply.OK
    out = store.executions.finish("a", 0, "w1", "QUEUED", now_ms=T + 5)
    assert (out.code, out.state) == (Reply.OK, "QUEUED")
    r = rec(store, "a")
    assert r["st"] == "QUEUED" and "lo" not in r and "lu" not in r and "finished" not in r
    assert 0 < ttl_ms(store, "a") <= DONE_TTL_S * 1000  # bounded, as at release
    nxt = store.executions.start("a", 0, "w2", now_ms=T + 6)  # Celery's own retry re-queued it: it runs again
    assert (nxt.code, nxt.attempt) == (Reply.OK, 2)
    assert ttl_ms(store, "a") == -1


def test_finish_into_failed_is_final_with_its_reason(store: Store) -> None:
    queued(store, "a")
    store.executions.start("a", 0, "w1", now_ms=T)
    assert store.executions.finish("a", 0, "w2", "FAILED", now_ms=T + 5).code == Reply.NOT_OWNER
    out = store.executions.finish("a", 0, "w1", "FAILED", reason="rejected", now_ms=T + 5)
    assert (out.code, out.state) == (Reply.OK, "FAILED")
    r = rec(store, "a")
    assert (r["st"], r["finished"], r["reason"]) == ("FAILED", str(T + 5), "rejected")
    assert "lo" not in r and "lu" not in r and "msg" not in r
    assert 0 < ttl_ms(store, "a") <= DONE_TTL_S * 1000
    assert store.executions.start("a", 0, "w3", now_ms=T + 6).code == Reply.WRONG_STATE
    late = store.executions.finish("a", 0, "w1", "SUCCEEDED", now_ms=T + 7)  # finished already: nothing changes
    assert (late.code, late.state) == (Reply.NOT_OWNER, "FAILED")
    assert store.executions.finish("gone", 0, "w1", "FAILED").code == Reply.NOT_FOUND


# -- retry.lua with time buckets ---------------------------------------------------


def test_retry_indexes_the_next_attempt_in_its_bucket(store: Store) -> None:
    queued(store, "a")
    store.executions.start("a", 0, "w1", now_ms=T)
    due = T + 90_000  # the second 60 s bucket after T
    out = store.executions.retry("a", 0, str(due), 1, {"msg": "m-a2"}, owner="w1", now_ms=T + 10)
    assert (out.code, out.state, out.due_ms) == (Reply.OK, "RUNNING", due)
    sk = store.keys.shard(0)
    if store.config.bucket_ms:
        bucket = f"{sk.due}:{due - due % 60_000}"
        assert store.redis.client.zrange(sk.buckets, 0, -1, withscores=True) == [(bucket, float(due - due % 60_000))]
        assert store.redis.client.zscore(bucket, "a") == due
    else:
        assert store.redis.client.zscore(sk.due, "a") == due
    assert store.redis.client.get(sk.next) == str(due)
    assert store.release.release_due(0, now_ms=due - 1).ids == []
    assert store.release.release_due(0, now_ms=due).ids == ["a"]
    assert store.redis.client.lrange(lst(store), 0, 0) == ["m-a2"]
    assert not store.redis.client.exists(sk.buckets)  # the emptied bucket left the index


# -- requeue.lua ---------------------------------------------------------------------


def test_requeue_replies_for_each_kind_of_id(store: Store) -> None:
    sk = store.keys.shard(0)
    queued(store, "ok")
    queued(store, "nomsg")
    queued(store, "alive")
    assert store.executions.start("nomsg", 0, "w", now_ms=T).code == Reply.OK  # started: its message is dropped
    assert store.executions.dead("ok", 0, {"etype": "E", "msg": "m-ok"}, now_ms=T).ok
    assert store.executions.dead("nomsg", 0, {"etype": "E"}, now_ms=T + 1).ok
    # Index entries whose record is gone or is not DEAD (left behind by a crash or by hand).
    store.redis.client.zadd(sk.dlq, {"gone": T + 2, "alive": T + 3})
    due, outcomes = store.dead_letters.requeue(0, ["ok", "nomsg", "gone", "alive"], "+500", now_ms=T + 10)
    assert due == T + 510
    assert [(o.code, o.state) for o in outcomes] == [
        (Reply.OK, "DEAD"), (Reply.NO_MESSAGE, "DEAD"), (Reply.NOT_FOUND, ""), (Reply.WRONG_STATE, "QUEUED")]
    assert store.redis.client.zrange(sk.dlq, 0, -1) == ["nomsg"]  # only the one it could not move stays
    assert rec(store, "ok")["st"] == "SCHEDULED" and rec(store, "alive")["st"] == "QUEUED"
    assert rec(store, "nomsg")["st"] == "DEAD"
    letters = store.dead_letters
    with pytest.raises(InvalidState, match="without a stored message"):
        letters.requeue_job("nomsg", "+0")
    with pytest.raises(InvalidState, match="SCHEDULED"):
        letters.requeue_job("ok", "+0")
    with pytest.raises(JobNotFound):
        letters.requeue_job("gone", "+0")


# -- paging across the views' page boundaries -----------------------------------------


@pytest.fixture
def one_shard(redis_url: str, uid: str) -> Iterator[Store]:
    s = Store(make_app(redis_url, uid, delayed_shards=1))
    yield s
    s.redis.client.close()


def _dead_letters(store: Store, n: int, **fields: Any) -> list[str]:
    """``n`` dead letters in shard 0, dying 1 ms apart (ids d0000 ... oldest first)."""
    ids = [f"d{i:04d}" for i in range(n)]
    store.jobs.schedule([new(store, i, T) for i in ids], now_ms=T)
    assert store.release.release_due(0, now_ms=T, limit=n).count == n
    for k, i in enumerate(ids):
        task = "t.even" if k % 2 == 0 else "t.odd"
        msg = "" if k % 7 == 3 else f"m-{i}"  # every 7th letter has no message
        assert store.executions.dead(i, 0, {"task": task, "etype": "E", "msg": msg, **fields}, now_ms=T + k).ok
    return ids


def test_pending_pages_across_its_reads(one_shard: Store) -> None:
    store = one_shard
    n = _PAGE * 2 + 3
    ids = [f"p{i:04d}" for i in range(n)]
    store.jobs.schedule([new(store, i, T + k, task="t.even" if k % 2 == 0 else "t.odd") for k, i in enumerate(ids)],
                   now_ms=T)
    pending = Pending(store)
    assert [r["id"] for r in pending.page(offset=_PAGE - 2, limit=5)] == ids[_PAGE - 2:_PAGE + 3]
    assert [r["id"] for r in pending.page(offset=2 * _PAGE, limit=10)] == ids[2 * _PAGE:]
    assert pending.page(offset=n, limit=10) == []
    assert [r["id"] for r in pending.page(offset=0, limit=n + 5)] == ids
    odd = [i for k, i in enumerate(ids) if k % 2]
    assert [r["id"] for r in pending.page(task="t.odd", offset=_PAGE // 2 - 1, limit=3)] == odd[
        _PAGE // 2 - 1:_PAGE // 2 + 2]


def test_dead_letter_pages_requeue_all_and_purge_past_their_batches(one_shard: Store) -> None:
    store = one_shard
    n = _PURGE_BATCH + 3  # more than one purge batch, more than two reads of 500
    ids = _dead_letters(store, n)
    newest = ids[::-1]
    letters = store.dead_letters
    assert letters.count() == n
    assert [d.id for d in letters.page(offset=_PAGE - 1, limit=3)] == newest[_PAGE - 1:_PAGE + 2]
    assert [d.id for d in letters.page(offset=n - 2, limit=10)] == newest[n - 2:]
    assert letters.page(offset=n, limit=1) == []
    even = [i for k, i in enumerate(ids) if k % 2 == 0][::-1]
    assert [d.id for d in letters.page(offset=_PAGE // 2, limit=4, task="t.even")] == even[
        _PAGE // 2:_PAGE // 2 + 4]
    # A stale index entry (its record is not DEAD) is skipped, not listed.
    store.redis.client.hset(store.keys.shard(0).job(newest[0]), "st", "QUEUED")
    assert [d.id for d in letters.page(limit=2)] == newest[1:3]
    store.redis.client.hset(store.keys.shard(0).job(newest[0]), "st", "DEAD")

    # requeue --all --task t.odd: past the letters it must leave (other task, or no message).
    movable_odd = {i for k, i in enumerate(ids) if k % 2 and k % 7 != 3}
    assert dlq.requeue_all(store, when=60, task="t.odd") == len(movable_odd)
    left = {d.id for d in letters.page(limit=n)}
    assert left == set(ids) - movable_odd
    assert {p["id"] for p in Pending(store).page(limit=n)} == movable_odd
    # requeue --all: every letter that has a message; those without stay.
    stuck = {i for k, i in enumerate(ids) if k % 7 == 3}
    assert dlq.requeue_all(store, when=60) == len(left - stuck)
    assert {d.id for d in letters.page(limit=n)} == stuck

    # purge: more letters than one purge batch.
    more = [f"x{i:04d}" for i in range(_PURGE_BATCH)]
    for i in more:  # dead.lua makes the record of a job it has none of
        assert store.executions.dead(i, 0, {"etype": "E"}, now_ms=T).ok
    assert letters.count() == len(stuck) + _PURGE_BATCH > _PURGE_BATCH
    assert dlq.purge(store) == len(stuck) + _PURGE_BATCH
    assert letters.count() == 0
    assert not any(store.redis.client.exists(store.keys.shard(0).job(i)) for i in [*stuck, *more])
