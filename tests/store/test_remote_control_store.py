"""Celery's revoke and ``inspect scheduled`` on the store (issue 16), on a real redis-server.

:func:`revoke_in_store` (what the caller's ``app.control.revoke`` and the
workers' ``revoke`` command do), :func:`install_revoke`, and the bounded
listing that answers ``inspect scheduled`` in Celery's format.
"""

from __future__ import annotations

import json
import pickle
from datetime import datetime, timedelta, timezone

from support import make_app

import celery_delayed
from celery_delayed import apply_later, get_store
from celery_delayed.cancellation import revoke_in_store
from celery_delayed.store import Pending
from celery_delayed.timeutil import eta_iso, from_ms
from celery_delayed.worker.control import scheduled_entry


def test_revoke_in_store_cancels_what_had_not_started(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=4)
    store = get_store(app)
    a, b, running = (apply_later(app, "x.task", when=60, strict=False) for _ in range(3))
    store.redis.client.hset(store.keys.shard(b.shard).job(b.id), "st", "QUEUED")
    store.redis.client.hset(store.keys.shard(running.shard).job(running.id), "st", "RUNNING")
    got = revoke_in_store(app, [a.id, b.id, running.id, "not-a-job", ""])
    assert got == {a.id: "SCHEDULED", b.id: "QUEUED"}  # a running job needs terminate
    assert store.lookup.get(a.id)["st"] == store.lookup.get(b.id)["st"] == "CANCELLED"
    assert store.lookup.get(running.id)["st"] == "RUNNING"
    assert revoke_in_store(app, running.id, terminate=True) == {running.id: "RUNNING"}
    assert store.lookup.get(running.id)["st"] == "CANCELLED"
    assert revoke_in_store(app, a.id) == {}  # cancelled already: Celery's revoke alone


def test_revoke_in_store_never_raises_when_the_store_is_down(uid):
    app = make_app("redis://127.0.0.1:1/0", uid, delayed_redis_url="redis://127.0.0.1:1/0")
    assert revoke_in_store(app, "some-id") == {}


def test_install_makes_control_revoke_cancel_in_the_store(redis_url, uid):
    app = celery_delayed.install(make_app(redis_url, uid))
    early = celery_delayed.install(make_app(redis_url, uid + "x"))
    _ = early.control  # created before: its instance method is wrapped instead
    for a in (app, early):
        celery_delayed.install(a)  # idempotent
        h = apply_later(a, "x.task", when=60, strict=False)
        a.control.revoke(h.id)
        assert get_store(a).lookup.get(h.id)["st"] == "CANCELLED"
    assert type(app.control).__name__ == "DurableControl"
    copy = pickle.loads(pickle.dumps(app))  # the class is named, so an installed app still pickles
    assert copy.control_cls == "celery_delayed.cancellation:DurableControl"


def test_locate_many_finds_jobs_in_any_shard_in_one_round_trip(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=8)
    store = get_store(app)
    a = apply_later(app, "x.task", when=60, strict=False)
    b = apply_later(app, "x.task", when=60, shard_key="elsewhere", strict=False)
    assert store.lookup.locate_many([a.id, "nope", b.id]) == {a.id: a.shard, b.id: b.shard}
    assert store.lookup.locate_many([]) == {}


def test_the_scheduled_listing_is_bounded_and_in_celerys_format(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=4)
    store = get_store(app)
    at = datetime.now(timezone.utc) + timedelta(hours=1)
    hs = [apply_later(app, "x.task", (i,), {"k": i}, when=at + timedelta(seconds=i), strict=False) for i in range(30)]
    other = apply_later(app, "x.task", when=at, queue="other", strict=False)
    pending = Pending(store)
    rows = pending.messages([app.conf.task_default_queue], limit=5)
    assert [due for due, _ in rows] == [h.due_ms for h in hs[:5]]
    assert len(pending.messages([app.conf.task_default_queue], limit=100, max_scan=10)) <= 10
    assert len(pending.messages(["other"])) == 1 and other.id
    entry = scheduled_entry(rows[0][1], rows[0][0], "w@h", app.timezone, {"application/json"})
    assert entry["eta"] == eta_iso(at, app.timezone) and entry["priority"] == 6
    assert entry["request"]["args"] == [0] and entry["request"]["kwargs"] == {"k": 0}
    assert entry["request"]["id"] == hs[0].id and entry["request"]["hostname"] == "w@h"
    # a message without the header: the record's due time
    assert scheduled_entry(json.dumps({**json.loads(rows[0][1]), "headers": {
        **json.loads(rows[0][1])["headers"], "delayed_eta": None}}), 1_000, "w", app.timezone,
        {"application/json"})["eta"] == from_ms(1_000).isoformat()
