"""The store side of drop-in fidelity (issue 16) on a real redis-server.

The ``delayed_eta`` header (written at schedule and retry, rewritten by
``reschedule`` and ``requeue``), the fallback counter, Celery's revoke of a
stored job (:func:`revoke_in_store`) and the bounded listing that answers
``inspect scheduled``.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from support import make_app

import celery_delayed
from celery_delayed import apply_later, dlq, get_store
from celery_delayed.store import ShardStatus
from celery_delayed.timeutil import from_ms


def _headers(store: Any, job_id: str, shard: int) -> dict[str, Any]:
    return json.loads(store.lookup.message(job_id, shard) or "")["headers"]  # type: ignore[no-any-return]


def test_the_eta_header_is_the_due_time_as_celery_writes_it(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=4)
    store = get_store(app)
    at = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=timezone(timedelta(hours=2)))
    h = apply_later(app, "x.task", when=at, strict=False)
    assert _headers(store, h.id, h.shard)["delayed_eta"] == "2031-05-06T07:08:09.123456+02:00"  # as given
    h = apply_later(app, "x.task", when=90, strict=False)
    eta = datetime.fromisoformat(_headers(store, h.id, h.shard)["delayed_eta"])
    assert abs((eta - h.eta).total_seconds()) < 1 and eta.utcoffset() == timedelta(0)
    many = celery_delayed.apply_later_many(app, "x.task", [{"args": (i,), "when": 60} for i in range(3)],
                                           strict=False)
    for x in many:  # the batch's fast path renders it too
        assert abs((datetime.fromisoformat(_headers(store, x.id, x.shard)["delayed_eta"]) - x.eta)
                   .total_seconds()) < 1


@pytest.mark.parametrize("due_ms", [
    0, 951_782_400_000, 1_709_251_199_999, 1_709_251_200_001, 4_102_444_800_000, 253_402_300_799_999, -86_400_001,
])
def test_reschedule_rewrites_the_eta_header(redis_url, uid, due_ms):
    """lua/includes/eta.lua's date arithmetic against Python's, over leap days, centuries and the epoch."""
    app = make_app(redis_url, uid, delayed_shards=2)
    store = get_store(app)
    h = apply_later(app, "x.task", when=3600, strict=False)
    assert store.jobs.reschedule(h.id, str(due_ms)) == due_ms
    got = _headers(store, h.id, h.shard)["delayed_eta"]
    assert datetime.fromisoformat(got) == datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(milliseconds=due_ms)
    assert got.endswith("000+00:00")
    env = json.loads(store.lookup.message(h.id, h.shard) or "")
    assert env["headers"]["id"] == h.id  # the rest of the envelope is intact


def test_requeue_gives_a_dead_letter_its_new_eta(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=1)
    store = get_store(app)
    sk = store.keys.shard(0)
    msg = json.dumps({"headers": {"id": "d1", "delayed_eta": None, "x": 1}, "properties": {}})
    store.redis.client.hset(sk.job("d1"), mapping={"st": "QUEUED", "msg": "x"})
    assert store.executions.dead("d1", 0, {"task": "t.x", "msg": msg}).ok
    due = dlq.requeue(app, "d1", when=30)
    headers = _headers(store, "d1", 0)
    assert datetime.fromisoformat(headers["delayed_eta"]) == from_ms(due) and headers["x"] == 1


def test_fallbacks_are_counted_per_shard_and_summed(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=4)
    store = get_store(app)
    status = ShardStatus(store)
    assert status.eta_fallbacks().count == 0 and status.eta_fallbacks().last_ms is None
    assert store.jobs.note_fallback(1, "t.a", "PayloadTooLarge: big", now_ms=1_000) == 1
    assert store.jobs.note_fallback(1, "t.b", "why | not", now_ms=3_000) == 2
    assert store.jobs.note_fallback(3, "t.c", "positional\narguments", now_ms=2_000) == 1
    got = status.eta_fallbacks()
    assert (got.count, got.last_ms, got.last_task, got.last_reason) == (3, 3_000, "t.b", "why | not")
    assert got.as_dict()["count"] == 3
    assert store.redis.client.hgetall(store.keys.shard(3).stats)["eta_fallback_last"] == "2000|t.c|positional arguments"
