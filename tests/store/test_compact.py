"""Compact records (store/compact.py, lua/includes/compact.lua) on a real redis-server.

A pending job stores only what differs per job; its template, once per shard,
holds the rest. What a worker receives must be Celery's message: the Lua
rendering equals the Python twin byte for byte, and decodes to what
``build_message`` (Celery's own path) makes of the same call, but for the
delivery tag and the body's padding. The template outlives its jobs, is sent
again when the server lost it, and a job whose template is gone anyway is
dead-lettered, not dropped.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from support import make_app

from celery_delayed import apply_later, apply_later_many, get_store
from celery_delayed.producer.message import build_message
from celery_delayed.reconciler import Reconciler  # noqa: F401  (records() is what the reconciler reads)
from celery_delayed.store import compact
from celery_delayed.vocab import Field, job_headers

pytestmark = pytest.mark.timeout(60)

TASK = "compact.task"
TRICKY: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((), {}),
    ((1, "a", None, 2.5, True), {}),
    (("é ü 漢字", 'quote " back \\ slash', "\x00ctl"), {"k": [1, {"n": None}]}),
    ((10**30, -1, 0.1), {"x": "y" * 70}),
    ((list(range(50)),), {"nested": {"a": {"b": [1, 2, 3]}}}),
]


def _env(text: str) -> dict[str, Any]:
    env: dict[str, Any] = json.loads(text)
    env["properties"].pop("delivery_tag")
    env["body"] = json.loads(base64.b64decode(env["body"]))  # compact bodies are padded: same JSON
    return env


def _pushed(store: Any, queue: str) -> dict[str, str]:
    return {json.loads(m)["headers"]["id"]: m for m in store.redis.client.lrange(queue, 0, -1)}


def test_release_renders_celerys_message_byte_for_byte_with_the_python_twin(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=2)
    store = get_store(app)
    queue = app.conf.task_default_queue
    handles = [apply_later(app, TASK, args, kwargs, when=0, strict=False) for args, kwargs in TRICKY]
    handles.append(apply_later(app, TASK, (1,), when=0, strict=False, task_id='id "with" quotes\\é'))
    handles.append(apply_later(app, TASK, (2,), when=0, strict=False, root_id="the-root", parent_id="the-parent"))
    before = {}
    for n, h in enumerate(handles):
        raw = store.redis.client.hgetall(store.keys.shard(h.shard).job(h.id))
        assert Field.MESSAGE not in raw and raw[Field.TEMPLATE], "stored compact"
        if n < 2:  # small arguments: every field under hash-max-listpack-value, a compact listpack
            assert store.redis.client.object("encoding", store.keys.shard(h.shard).job(h.id)) == "listpack"
        before[h.id] = raw
    released = sum(store.release.release_due(s).count for s in range(2))
    assert released == len(handles)
    pushed = _pushed(store, queue)
    calls = [*TRICKY, ((1,), {}), ((2,), {})]
    for n, ((args, kwargs), h) in enumerate(zip(calls, handles, strict=True)):
        rec = store.redis.client.hgetall(store.keys.shard(h.shard).job(h.id))
        t = store.lookup.template(h.shard, before[h.id][Field.TEMPLATE])
        assert t is not None
        # the Lua rendering is the Python twin's, byte for byte (tag included)
        assert pushed[h.id] == compact.render(t, h.id, h.shard, before[h.id], rec[Field.TAG])
        assert json.loads(pushed[h.id])["properties"]["delivery_tag"] == f"{h.id}.{rec[Field.TAG]}"
        # ... and it is Celery's message for the same call (a delay's eta: the due time, rendered from `due`)
        assert "e" not in before[h.id]
        eta = json.loads(before[h.id]["e"]) if "e" in before[h.id] else compact.iso_utc(int(before[h.id]["due"]))
        opts: dict[str, Any] = {"headers": job_headers(h.shard, store.config.key_prefix, eta)}
        if n == len(calls) - 1:
            opts.update(root_id="the-root", parent_id="the-parent")
        ref = build_message(app, TASK, args, kwargs, h.id, opts, None, max_bytes=1 << 20)
        assert _env(pushed[h.id]) == _env(ref.body)
        # released: the record names its task and queue, and keeps its own fields until it starts
        assert rec[Field.TASK] == TASK and rec[Field.QUEUE] == queue and "b" in rec


def test_a_pending_compact_job_reads_like_a_full_one(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=1)
    store = get_store(app)
    h = apply_later(app, TASK, (1,), {"a": 2}, when=3600, strict=False)
    rec = store.lookup.get(h.id)
    assert rec["task"] == TASK and rec["q"] == app.conf.task_default_queue and rec["lk"]
    assert not {"a", "b", "e", "msg"} & rec.keys()  # the message is not part of the record view
    env = json.loads(store.lookup.message(h.id, 0) or "")
    assert env["headers"]["id"] == h.id and env["headers"]["eta"] is None
    full = store.lookup.records(0, [h.id])[h.id]  # what a database row keeps: a full record
    assert json.loads(full["msg"])["headers"]["argsrepr"] == "(1,)" and full["task"] == TASK
    assert not {"a", "b", "e"} & full.keys()


def test_the_template_is_stored_once_per_shard_and_outlives_its_jobs(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=2)
    store = get_store(app)
    hs = apply_later_many(app, TASK, [{"args": (i,), "when": 3600} for i in range(40)], strict=False)
    tids = {store.redis.client.hget(store.keys.shard(h.shard).job(h.id), Field.TEMPLATE) for h in hs}
    assert len(tids) == 1
    (tid,) = tids
    for s in range(2):
        ttl = store.redis.client.pttl(store.keys.shard(s).template(tid))
        # at least the latest due time plus the record ttl
        assert ttl >= 3600_000 + store.config.record_ttl_ms - 60_000, ttl
    assert len(list(store.redis.client.scan_iter(match=f"{store.keys.prefix}:*tpl:*"))) == 2
    # a job rescheduled later pushes its template's life on
    far = apply_later(app, TASK, (9,), when=60, strict=False)
    store.jobs.reschedule(far.id, str(store.redis.now_ms() + 90 * 86_400_000))
    ttl = store.redis.client.pttl(store.keys.shard(far.shard).template(tid))
    assert ttl >= 90 * 86_400_000 + store.config.record_ttl_ms - 60_000
    assert json.loads(store.lookup.message(far.id, far.shard) or "")["headers"]["delayed_eta"].startswith(
        json.loads(store.redis.client.hget(store.keys.shard(far.shard).job(far.id), "e"))[:10])


def test_a_steady_stream_of_calls_extends_the_template_once_not_every_call(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=1)
    store = get_store(app)
    first = apply_later(app, TASK, (0,), when=3600, strict=False)
    tk = store.keys.shard(0).template(store.redis.client.hget(store.keys.shard(0).job(first.id), Field.TEMPLATE))
    keep = 3600_000 + store.config.record_ttl_ms

    def pexpires() -> int:
        return int(store.redis.client.info("commandstats").get("cmdstat_pexpire", {}).get("calls", 0))

    before = pexpires()
    for i in range(50):
        apply_later(app, TASK, (i,), when=3600, strict=False)
    assert pexpires() - before == 0  # the first call's extension covers the next eighth of its TTL
    assert keep - 60_000 <= store.redis.client.pttl(tk) <= keep + keep // 8
    # a job due later than the template's TTL extends it (at least to that job's due time plus the record ttl)
    far = apply_later(app, TASK, (9,), when=30 * 86_400, strict=False)
    assert pexpires() - before == 1
    assert store.redis.client.pttl(tk) >= 30 * 86_400_000 + store.config.record_ttl_ms - 60_000
    assert far.created


def test_a_template_the_server_lost_is_sent_again(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=1)
    store = get_store(app)
    apply_later(app, TASK, (1,), when=60, strict=False)
    (key,) = store.redis.client.scan_iter(match=f"{store.keys.prefix}:*tpl:*")
    store.redis.client.delete(key)  # e.g. a Redis restart without persistence, or someone's DEL
    h = apply_later(app, TASK, (2,), when=0, strict=False)  # this process thinks the server has it
    assert store.redis.client.exists(key)
    assert store.release.release_due(0).ids == [h.id]


def test_a_job_whose_template_is_gone_is_dead_lettered_not_lost(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=1)
    store = get_store(app)
    h = apply_later(app, TASK, (1,), when=0, strict=False)
    (key,) = store.redis.client.scan_iter(match=f"{store.keys.prefix}:*tpl:*")
    store.redis.client.delete(key)
    batch = store.release.release_due(0)
    assert batch.ids == [] and [(i, st) for i, st, _ in batch.not_sent] == [(h.id, "DEAD")]
    rec = store.lookup.get(h.id)
    assert rec["st"] == "DEAD" and "template" in rec["reason"]
    assert store.redis.client.zscore(store.keys.shard(0).dlq, h.id) is not None


def test_released_ahead_of_its_due_time_a_compact_job_carries_celerys_eta(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=1)
    store = get_store(app)
    h = apply_later(app, TASK, (1,), when=1.0, strict=False)
    assert store.release.release_due(0, lookahead_ms=5000).ids == [h.id]
    env = json.loads(store.redis.client.lrange(app.conf.task_default_queue, 0, 0)[0])
    # Celery's eta: the due time by the Redis clock (the worker holds it until then)
    assert datetime.fromisoformat(env["headers"]["eta"]).timestamp() * 1000 == h.due_ms
    assert env["headers"]["delayed_eta"] is not None


def test_a_misfired_dead_letter_keeps_its_message_and_can_be_requeued(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=1)
    store = get_store(app)
    h = apply_later(app, TASK, (1,), when=0, strict=False, misfire="dead", max_lateness=5)
    batch = store.release.release_due(0, now_ms=store.redis.now_ms() + 60_000)
    assert [st for _, st, _ in batch.not_sent] == ["DEAD"]
    raw = store.redis.client.hgetall(store.keys.shard(0).job(h.id))
    assert json.loads(raw["msg"])["headers"]["id"] == h.id and "b" not in raw  # rendered into `msg`
    _, outcomes = store.dead_letters.requeue(0, [h.id], "+0")
    assert outcomes[0].ok
    assert store.release.release_due(0).ids == [h.id]


def test_a_started_job_drops_its_message(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=1)
    store = get_store(app)
    h = apply_later(app, TASK, (1,), when=0, strict=False)
    store.release.release_due(0)
    assert store.executions.start(h.id, 0, "w|1|t|n").run
    raw = store.redis.client.hgetall(store.keys.shard(0).job(h.id))
    assert not set(compact.FIELDS[1:]) & raw.keys() and "msg" not in raw and "tg" not in raw
    assert raw[Field.TASK] == TASK  # still named (the template may expire before the record)


def test_a_delays_eta_is_rendered_from_the_due_time_and_an_explicit_one_is_kept(redis_url, uid):
    """Version 2 templates: no ``e`` for a delay in a UTC app (the header is the due time by the Redis
    clock, as reschedule writes it); a datetime's eta, or a delay in another timezone, is stored as given."""
    app = make_app(redis_url, uid, delayed_shards=1)
    store = get_store(app)
    h = apply_later(app, TASK, (1,), when=60, strict=False)
    raw = store.redis.client.hgetall(store.keys.shard(0).job(h.id))
    assert "e" not in raw and raw[Field.TEMPLATE].isdigit()  # the template id: an integer in the listpack
    eta = json.loads(store.lookup.message(h.id, 0) or "")["headers"]["delayed_eta"]
    assert eta == compact.iso_utc(h.due_ms) and datetime.fromisoformat(eta).timestamp() * 1000 == h.due_ms
    at = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=timezone(timedelta(hours=2)))
    g = apply_later(app, TASK, (2,), when=at, strict=False)
    assert json.loads(store.redis.client.hget(store.keys.shard(0).job(g.id), "e")) == at.isoformat()
    berlin = make_app(redis_url, uid + "b", delayed_shards=1, timezone="Europe/Berlin")
    b = apply_later(berlin, TASK, (3,), when=60, strict=False)
    bstore = get_store(berlin)
    assert json.loads(bstore.redis.client.hget(bstore.keys.shard(0).job(b.id), "e")).endswith(("+01:00", "+02:00"))
    # the Lua rendering at release agrees with the Python twin, early (Celery's eta) or not
    before = store.redis.client.hgetall(store.keys.shard(0).job(h.id))
    assert store.release.release_due(0, lookahead_ms=120_000).ids == [h.id]  # (g is due in 2031)
    pushed = _pushed(store, app.conf.task_default_queue)
    tag = store.redis.client.hget(store.keys.shard(0).job(h.id), Field.TAG)
    t = store.lookup.template(0, before[Field.TEMPLATE])
    assert t is not None and t.version == 2
    assert pushed[h.id] == compact.render(t, h.id, 0, before, tag, '"' + compact.iso_utc(h.due_ms) + '"')
    assert json.loads(pushed[h.id])["headers"]["delayed_eta"] == json.loads(pushed[h.id])["headers"]["eta"] == eta


def test_a_version_1_record_without_an_eta_keeps_a_null_header(redis_url, uid):
    """Records written before version 2 (no ``e``: a null delayed_eta) are rendered as they were."""
    app = make_app(redis_url, uid, delayed_shards=1)
    store = get_store(app)
    h = apply_later(app, TASK, (1,), when=0, strict=False)
    sk = store.keys.shard(0)
    raw = store.redis.client.hgetall(sk.job(h.id))
    t = store.lookup.template(0, raw[Field.TEMPLATE])
    assert t is not None
    old = compact.Template(t.parts, t.order, t.tail64, t.route, version=1)
    assert '"v":1' in old.text and old.tid != t.tid
    store.redis.client.set(sk.template(old.tid), old.text)
    store.redis.client.hset(sk.job(h.id), Field.TEMPLATE, old.tid)
    assert json.loads(store.lookup.message(h.id, 0) or "")["headers"]["delayed_eta"] is None
    assert store.release.release_due(0).ids == [h.id]
    pushed = _pushed(store, app.conf.task_default_queue)[h.id]
    assert json.loads(pushed)["headers"]["delayed_eta"] is None


def test_iso_utc_is_the_lua_twin():
    for ms in (0, 951_782_400_000, 1_709_251_199_999, 4_102_444_800_000, 253_402_300_799_999, -86_400_001):
        got = compact.iso_utc(ms)
        assert datetime.fromisoformat(got) == datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(milliseconds=ms)
        assert got.endswith("000+00:00")


def test_a_call_inside_a_task_gets_its_root_and_parent_ids_each_time(redis_url, uid):
    # apply_later's short path keeps what the calls share, but each call's root and parent ids are its own.
    app = make_app(redis_url, uid, delayed_shards=2)
    store = get_store(app)

    @app.task(name="compact.outer", shared=False)
    def outer():
        return [apply_later(app, TASK, (i,), when=60, strict=False).id for i in range(2)]

    def ids(job_id):
        rec = store.lookup.get(job_id)
        headers = json.loads(store.lookup.message(job_id, int(rec["shard"])) or "")["headers"]
        return headers["root_id"], headers["parent_id"]

    before = apply_later(app, TASK, (0,), when=60, strict=False).id
    inside = outer.apply(task_id="the-outer-task").get()
    after = apply_later(app, TASK, (0,), when=60, strict=False).id
    assert ids(before) == (before, None)
    assert [ids(i) for i in inside] == [("the-outer-task", "the-outer-task")] * 2
    assert ids(after) == (after, None)


def test_a_changed_task_default_reaches_the_next_call(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=2)
    store = get_store(app)

    @app.task(name="compact.routed", shared=False)
    def routed(i):
        return i

    first = apply_later(app, "compact.routed", (1,), when=60).id
    routed.queue = f"other{uid}"
    second = apply_later(app, "compact.routed", (2,), when=60).id

    def queue_of(job_id):
        rec = store.lookup.get(job_id)
        msg = json.loads(store.lookup.message(job_id, int(rec["shard"])) or "")
        return msg["properties"]["delivery_info"]["routing_key"]

    assert queue_of(first) == app.conf.task_default_queue
    assert queue_of(second) == f"other{uid}"
