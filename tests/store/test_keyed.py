"""Debounce and throttle keys of apply_later, on a real redis-server (``lua/schedule_keyed.lua``)."""

from __future__ import annotations

import base64
import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from support import make_app

from celery_delayed import (
    ConfigurationError,
    DelayedTask,
    InvalidOption,
    apply_later,
    apply_later_many,
    cancel,
    get_store,
)
from celery_delayed.store import Pending

NAME = "keyed.refresh"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tapp(redis_url: str, uid: str) -> Celery:
    app = make_app(redis_url, uid, delayed_shards=4)

    @app.task(base=DelayedTask, name=NAME, shared=False)
    def refresh(item: Any, note: str = "") -> None:
        return None

    return app


def body(app: Celery, job_id: str) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """(args, kwargs, headers) of a stored job's message, rendered as the release script sends it."""
    store = get_store(app)
    shard = store.lookup.locate(job_id)
    raw = store.lookup.message(job_id, shard)
    assert raw is not None
    env = json.loads(raw)
    args, kwargs, _ = json.loads(base64.b64decode(env["body"]))
    return args, kwargs, env["headers"]


def raw(app: Celery, job_id: str) -> dict[str, str]:
    """The job's record as stored."""
    store = get_store(app)
    key = store.keys.shard(store.lookup.locate(job_id)).job(job_id)
    return {str(k): str(v) for k, v in store.redis.client.hgetall(key).items()}


def pending_ids(app: Celery) -> list[str]:
    store = get_store(app)
    out = []
    for s in range(store.config.shards):
        for page in store.lookup.scheduled_pages(s):
            out += page
    return out


def test_debounce_replaces_arguments_and_pushes_due_back(tapp: Celery) -> None:
    first = apply_later(tapp, NAME, (1,), when=30, debounce_key="user:7")
    second = apply_later(tapp, NAME, (2,), {"note": "x"}, when=60, debounce_key="user:7")
    assert first.created and not second.created
    assert second.id == first.id
    assert second.due_ms >= first.due_ms + 29_000
    assert body(tapp, first.id)[:2] == ([2], {"note": "x"})
    assert pending_ids(tapp) == [first.id]
    rec = get_store(tapp).lookup.get(first.id)
    assert int(rec["due"]) == second.due_ms and rec["st"] == "SCHEDULED"
    # the message's delayed_eta header follows the due time
    eta = body(tapp, first.id)[2]["delayed_eta"]
    assert eta is not None


def test_debounce_never_beyond_max_wait(tapp: Celery) -> None:
    first = apply_later(tapp, NAME, (1,), when=2, debounce_key="k", max_wait=5)
    created = int(get_store(tapp).lookup.get(first.id)["created"])
    later = apply_later(tapp, NAME, (2,), when=3600, debounce_key="k", max_wait=5)
    assert later.id == first.id and not later.created
    assert later.due_ms == created + 5000
    assert int(get_store(tapp).lookup.get(first.id)["created"]) == created  # the first call's time is kept


def test_debounce_after_release_or_cancel_creates_a_new_job(tapp: Celery) -> None:
    store = get_store(tapp)
    first = apply_later(tapp, NAME, (1,), when=0, debounce_key="k")
    batch = store.release.release_due(store.lookup.locate(first.id), now_ms=store.redis.now_ms() + 1000)
    assert first.id in batch.ids
    second = apply_later(tapp, NAME, (2,), when=60, debounce_key="k")
    assert second.created and second.id != first.id
    cancel(tapp, second.id)
    third = apply_later(tapp, NAME, (3,), when=60, debounce_key="k")
    assert third.created and third.id not in (first.id, second.id)
    assert body(tapp, third.id)[0] == [3]


def test_debounce_between_compact_and_full_records(redis_url: str, uid: str) -> None:
    app = make_app(redis_url, uid, delayed_shards=2, delayed_max_payload_bytes=16384)

    @app.task(base=DelayedTask, name=NAME, shared=False)
    def refresh(item: Any, note: str = "") -> None:
        return None

    big = "x" * 6000  # too large for a compact record: the full message is stored
    store = get_store(app)
    a = apply_later(app, NAME, ("small",), when=60, debounce_key="k")
    assert "tp" in raw(app, a.id) and "msg" not in raw(app, a.id)
    b = apply_later(app, NAME, (big,), when=60, debounce_key="k")
    assert b.id == a.id and body(app, a.id)[0] == [big]
    assert "msg" in raw(app, a.id) and "tp" not in raw(app, a.id)
    c = apply_later(app, NAME, ("small again",), when=60, debounce_key="k", queue=f"other{uid}")
    assert c.id == a.id and body(app, a.id)[0] == ["small again"]
    rec = raw(app, a.id)
    assert "tp" in rec and "msg" not in rec
    assert store.lookup.route_of(store.lookup.locate(a.id), rec.get("task"), rec.get("q"), rec.get("tp"))[1] \
        == f"other{uid}"


def test_debounce_from_many_threads(tapp: Celery) -> None:
    threads, calls = 16, 50
    results: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)
    t0 = get_store(tapp).redis.now_ms()

    def run(t: int) -> None:
        try:
            start.wait()
            for i in range(calls):
                r = apply_later(tapp, NAME, (t, i), when=30, debounce_key="hot", max_wait=10)
                with lock:
                    results.append(r)
        except BaseException as exc:  # reported below
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors
    assert len(results) == threads * calls
    assert sum(r.created for r in results) == 1
    assert len({r.id for r in results}) == 1
    last = apply_later(tapp, NAME, ("last", -1), when=30, debounce_key="hot", max_wait=10)
    assert not last.created and last.id == results[0].id
    assert pending_ids(tapp) == [last.id]
    assert body(tapp, last.id)[0] == ["last", -1]
    created = int(get_store(tapp).lookup.get(last.id)["created"])
    assert t0 <= created and last.due_ms == created + 10_000  # 30 s asked, capped by max_wait


def test_throttle_one_job_per_window(tapp: Celery) -> None:
    first = apply_later(tapp, NAME, (1,), when=60, throttle_key="mail:7", window=0.4)
    again = apply_later(tapp, NAME, (2,), when=120, throttle_key="mail:7", window=0.4)
    assert first.created and not again.created
    assert again.id == first.id and again.due_ms == first.due_ms
    assert body(tapp, first.id)[0] == [1]  # a throttled call changes nothing
    time.sleep(0.5)
    third = apply_later(tapp, NAME, (3,), when=60, throttle_key="mail:7", window=timedelta(seconds=0.4))
    assert third.created and third.id != first.id
    assert sorted(pending_ids(tapp)) == sorted([first.id, third.id])


def test_throttle_from_many_threads(tapp: Celery) -> None:
    results: list[Any] = []
    lock = threading.Lock()

    def run() -> None:
        for _ in range(20):
            r = apply_later(tapp, NAME, (1,), when=60, throttle_key="t", window=60)
            with lock:
                results.append(r)

    workers = [threading.Thread(target=run) for _ in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert len(results) == 160 and sum(r.created for r in results) == 1
    assert len(pending_ids(tapp)) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_wait": 5}, "give debounce_key"),
        ({"window": 5}, "give throttle_key"),
        ({"throttle_key": "t"}, "needs window"),
        ({"debounce_key": "d", "throttle_key": "t", "window": 1}, "not both"),
        ({"debounce_key": "d", "max_wait": -1}, "more than 0"),
        ({"debounce_key": "d", "max_wait": 0}, "more than 0"),
        ({"debounce_key": "d", "max_wait": "5"}, "number of seconds"),
        ({"throttle_key": "t", "window": float("nan")}, "more than 0"),
        ({"debounce_key": "d", "window": 3}, "goes with throttle_key"),
        ({"throttle_key": "t", "window": 3, "max_wait": 3}, "goes with debounce_key"),
        ({"debounce_key": "d", "idempotency_key": "i"}, "idempotency_key"),
        ({"debounce_key": "d", "task_id": "i"}, "task_id"),
        ({"debounce_key": ""}, "must not be empty"),
        ({"throttle_key": 5, "window": 1}, "must be a string"),
    ],
)
def test_bad_input_is_refused_and_stores_nothing(tapp: Celery, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidOption, match=message):
        apply_later(tapp, NAME, (1,), when=10, **kwargs)
    assert pending_ids(tapp) == []


def test_apply_later_many_refuses_keys(tapp: Celery) -> None:
    with pytest.raises(InvalidOption, match="call apply_later"):
        apply_later_many(tapp, NAME, [{"args": (1,)}, {"args": (2,), "debounce_key": "k"}])
    assert pending_ids(tapp) == []


def test_refused_with_a_database(redis_url: str, uid: str, tmp_path: Any) -> None:
    app = make_app(redis_url, uid, delayed_database_url=f"sqlite:///{tmp_path / 'd.db'}")

    @app.task(base=DelayedTask, name=NAME, shared=False)
    def refresh(item: Any) -> None:
        return None

    with pytest.raises(ConfigurationError, match="delayed_database_url"):
        apply_later(app, NAME, (1,), debounce_key="k")


def queued_bodies(app: Celery, client: Any) -> dict[str, list[Any]]:
    """id -> args of every message the direct path pushed onto the app's default queue."""
    out = {}
    for raw in client.lrange(app.conf.task_default_queue, 0, -1):
        env = json.loads(raw)
        out[env["headers"]["id"]] = json.loads(base64.b64decode(env["body"]))[0]
    return out


def test_debounce_racing_the_release(tapp: Celery, rclient: Any) -> None:
    """Calls race a scheduler releasing the key's job: no call is lost, each job is released once,
    with the arguments of a call that returned it."""
    store = get_store(tapp)
    results: list[tuple[str, bool, tuple[int, int]]] = []
    lock = threading.Lock()
    stop = threading.Event()
    shard = store.layout.shard_of("", "race")  # the key decides the shard

    def call(t: int) -> None:
        for i in range(40):
            r = apply_later(tapp, NAME, (t, i), when=0, debounce_key="race")
            with lock:
                results.append((r.id, r.created, (t, i)))

    def release() -> None:
        while not stop.is_set():
            store.release.release_due(shard, now_ms=store.redis.now_ms() + 60_000)

    releaser = threading.Thread(target=release)
    releaser.start()
    callers = [threading.Thread(target=call, args=(t,)) for t in range(6)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(60)
    stop.set()
    releaser.join(60)
    store.release.release_due(shard, now_ms=store.redis.now_ms() + 60_000)
    queued = queued_bodies(tapp, rclient)
    ids = {jid for jid, _, _ in results}
    assert len(results) == 240
    assert ids == set(queued)  # every job was released, once (one message per id)
    assert rclient.llen(tapp.conf.task_default_queue) == len(ids)
    assert sum(created for _, created, _ in results) == len(ids)
    for jid, args in queued.items():
        assert tuple(args) in {a for j, _, a in results if j == jid}
    assert pending_ids(tapp) == []


def test_debounce_a_job_held_by_a_pause_and_the_pending_index(tapp: Celery) -> None:
    store = get_store(tapp)
    a = apply_later(tapp, NAME, (1,), when=0, debounce_key="p")
    shard = store.lookup.locate(a.id)
    store.jobs.pause(["all"])
    assert store.release.release_due(shard, now_ms=store.redis.now_ms() + 1000).count == 0  # held back
    b = apply_later(tapp, NAME, (2,), when=0, debounce_key="p", queue="elsewhere")
    assert b.id == a.id and not b.created
    assert [row["queue"] for row in Pending(store).page(NAME)] == ["elsewhere"]  # one entry, moved
    store.jobs.resume()
    batch = store.release.release_due(shard, now_ms=store.redis.now_ms() + 1000)
    assert batch.ids == [a.id] and get_store(tapp).lookup.get(a.id)["st"] == "QUEUED"


def _release(app: Celery, path: str, shard: int, now_ms: int, limit: int | None = None) -> Any:
    """One release (direct path) or claim (publish path, acknowledged at once) with the default look-ahead."""
    store = get_store(app)
    la = store.config.lookahead_ms
    if path == "direct":
        return store.release.release_due(shard, now_ms=now_ms, limit=limit, lookahead_ms=la)
    batch = store.release.claim_due(shard, now_ms=now_ms, limit=limit, lookahead_ms=la)
    store.release.ack_claimed(shard, batch.ids, now_ms=now_ms)
    return batch


@pytest.mark.parametrize("bucket_ms", [0, 60_000])
@pytest.mark.parametrize("path", ["direct", "publish"])
def test_debounce_job_is_not_released_a_lookahead_early(redis_url: str, uid: str, path: str, bucket_ms: int) -> None:
    """Within the look-ahead an ordinary job goes early; the debounce key's job stays, replaceable, until due."""
    app = make_app(redis_url, uid, delayed_shards=1, delayed_bucket_ms=bucket_ms)

    @app.task(base=DelayedTask, name=NAME, shared=False)
    def refresh(item: Any, note: str = "") -> None:
        return None

    store = get_store(app)
    assert store.config.lookahead_ms == 2000  # the default
    d = apply_later(app, NAME, (1,), when=1, debounce_key="k")
    plain = apply_later(app, NAME, (0,), when=1)
    far = apply_later(app, NAME, (0,), when=60)
    now = store.redis.now_ms()
    batch = _release(app, path, 0, now)
    assert batch.ids == [plain.id]  # released a look-ahead early, as before
    assert batch.hold_ms == d.due_ms  # come back when the debounce job is due
    assert batch.next_due_ms == far.due_ms  # the next one, leaving out the job that waits
    assert store.lookup.get(d.id)["st"] == "SCHEDULED"
    assert d.id in pending_ids(app) and store.lookup.get(d.id)["dk"] == "1"
    # a later call still finds it waiting and replaces it
    again = apply_later(app, NAME, (2,), when=1, debounce_key="k")
    assert again.id == d.id and not again.created and again.due_ms > d.due_ms
    assert _release(app, path, 0, again.due_ms - 1).ids == []  # 1 ms before due: still waiting
    batch = _release(app, path, 0, again.due_ms)
    assert batch.ids == [d.id] and batch.hold_ms is None
    rec = store.lookup.get(d.id)
    assert rec["st"] == "QUEUED" and int(rec["released"]) == again.due_ms
    assert body(app, d.id)[0] == [2]  # the last call's arguments
    assert sorted(pending_ids(app)) == [far.id]
    # the key's job was released: the next call makes a new one
    third = apply_later(app, NAME, (3,), when=1, debounce_key="k")
    assert third.created and third.id != d.id


def test_throttled_job_still_goes_a_lookahead_early(tapp: Celery) -> None:
    """A throttle returns its job whatever its state: nothing to wait for."""
    store = get_store(tapp)
    th = apply_later(tapp, NAME, (1,), when=1, throttle_key="t", window=60)
    shard = store.lookup.locate(th.id)
    batch = _release(tapp, "direct", shard, store.redis.now_ms())
    assert batch.ids == [th.id] and batch.hold_ms is None
    again = apply_later(tapp, NAME, (2,), when=1, throttle_key="t", window=60)
    assert again.id == th.id and not again.created and again.job_state == "QUEUED"


@pytest.mark.parametrize("path", ["direct", "publish"])
def test_a_full_batch_of_waiting_debounce_jobs_neither_spins_nor_strands_the_rest(tapp: Celery, path: str) -> None:
    """Debounce jobs put back fill a batch: the release says when to come back, and each later
    job still goes no later than due."""
    store = get_store(tapp)
    ds = [apply_later(tapp, NAME, (i,), when=0.5 + i / 10, debounce_key=f"k{i}", shard_key="s") for i in range(3)]
    plain = apply_later(tapp, NAME, (9,), when=0.9, shard_key="s")
    shard = store.lookup.locate(plain.id)
    assert {store.lookup.locate(h.id) for h in ds} == {shard}
    now = store.redis.now_ms()
    batch = _release(tapp, path, shard, now, limit=2)
    assert batch.ids == [] and batch.skipped == 0  # nothing moved: not "more to do at once"
    assert batch.hold_ms == ds[0].due_ms and batch.next_due_ms is None
    batch = _release(tapp, path, shard, ds[0].due_ms, limit=2)
    assert batch.ids == [ds[0].id]  # due now; ds[1] put back
    assert batch.next_due_ms == ds[0].due_ms  # a full batch that moved a job: come again at once
    batch = _release(tapp, path, shard, ds[0].due_ms, limit=2)
    assert batch.ids == [] and batch.hold_ms == ds[1].due_ms  # ds[1], ds[2] put back: come back at ds[1]
    batch = _release(tapp, path, shard, ds[1].due_ms, limit=2)
    assert batch.ids == [ds[1].id] and batch.next_due_ms == ds[1].due_ms
    batch = _release(tapp, path, shard, ds[1].due_ms, limit=2)
    assert batch.ids == [plain.id] and batch.hold_ms == ds[2].due_ms  # before its due time, a look-ahead early
    assert _release(tapp, path, shard, ds[2].due_ms).ids == [ds[2].id]
    assert pending_ids(tapp) == []
