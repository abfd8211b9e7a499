"""The public API on a real redis-server: apply_later and friends, DelayedResult, bad input.

Every bad call must raise its specific typed error with a message that says
what was wrong, and leave no key under the app's prefix or queue.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from celery import Celery
from support import RedisServer, free_port, make_app

from celery_delayed import (
    DelayedResult,
    DelayedTask,
    DuplicateJob,
    InvalidOption,
    InvalidState,
    InvalidWhen,
    JobNotFound,
    StoreUnavailable,
    apply_later,
    apply_later_many,
    cancel,
    cancel_by_key,
    get_store,
    job_id_for_key,
    reschedule,
)
from celery_delayed.errors import PayloadTooLarge, SerializationError, UnknownTask
from celery_delayed.store import ShardStatus

NAME = "api.remind"


@pytest.fixture
def tapp(redis_url: str, uid: str) -> Celery:
    app = make_app(redis_url, uid, delayed_shards=8, delayed_max_payload_bytes=4096)

    @app.task(base=DelayedTask, name=NAME, shared=False)
    def remind(user_id: int, note: str = "") -> None:
        return None

    return app


def keys_of(client: redis.Redis, app: Celery) -> set[str]:
    """Every key this app's store or queues may have written."""
    found: set[str] = set()
    for pattern in (f"{app.conf.delayed_key_prefix}:*", f"{app.conf.task_default_queue}*"):
        found |= {str(k) for k in client.scan_iter(match=pattern, count=1000)}
    return found


def redis_ms(app: Celery) -> int:
    return get_store(app).redis.now_ms()


# -- scheduling ----------------------------------------------------------------


def test_apply_later_with_a_delay(tapp: Celery) -> None:
    before = redis_ms(tapp)
    h = apply_later(tapp, NAME, args=(42,), kwargs={"note": "hi"}, when=timedelta(minutes=5))
    after = redis_ms(tapp)
    assert isinstance(h, DelayedResult) and h.created
    assert before + 300_000 <= h.due_ms <= after + 300_000
    assert h.eta == datetime.fromtimestamp(h.due_ms / 1000, tz=timezone.utc)
    assert h.eta.tzinfo is not None
    job = h.job()
    assert job["st"] == "SCHEDULED" and job["task"] == NAME and job["q"] == tapp.conf.task_default_queue
    assert job["due"] == str(h.due_ms) and job["id"] == h.id and "msg" not in job
    assert int(job["shard"]) == h.shard == get_store(tapp).layout.shard_of(h.id)
    assert h.job_state == "SCHEDULED"


@pytest.mark.parametrize("when", [0, 2.5, 90, timedelta(seconds=1, milliseconds=500)])
def test_apply_later_numbers_and_timedeltas(tapp: Celery, when: Any) -> None:
    delay_ms = math.ceil((when.total_seconds() if isinstance(when, timedelta) else when) * 1000)
    before = redis_ms(tapp)
    h = apply_later(tapp, NAME, args=(1,), when=when)
    assert before + delay_ms <= h.due_ms <= redis_ms(tapp) + delay_ms


def test_apply_later_with_datetimes(redis_url: str, uid: str) -> None:
    app = make_app(redis_url, uid, timezone="Europe/Berlin")
    aware = datetime(2031, 6, 1, 8, 30, tzinfo=timezone.utc)
    assert apply_later(app, NAME, when=aware, strict=False).eta == aware
    naive = datetime(2031, 6, 1, 10, 30)  # Berlin summer time: 08:30 UTC, as Celery reads eta
    assert apply_later(app, NAME, when=naive, strict=False).eta == aware
    assert apply_later(app, NAME, when=aware.astimezone(ZoneInfo("Asia/Tokyo")), strict=False).eta == aware


def test_past_time_is_released_at_once(tapp: Celery) -> None:
    h = apply_later(tapp, NAME, args=(1,), when=datetime(2001, 1, 1, tzinfo=timezone.utc))
    assert h.eta == datetime(2001, 1, 1, tzinfo=timezone.utc)
    batch = get_store(tapp).release.release_due(h.shard)
    assert batch.ids == [h.id]
    assert h.job_state == "QUEUED"


def test_options_reach_the_record(tapp: Celery) -> None:
    h = apply_later(tapp, NAME, args=(1,), when=60, queue="elsewhere", priority=9, task_id="my-id",
                    shard_key="user-7", strict=False, **{"headers": {"x": 1}})
    assert h.id == "my-id"
    job = h.job()
    assert job["q"] == "elsewhere" and job["sk"] == "user-7"
    assert h.shard == get_store(tapp).layout.shard_of("my-id", "user-7")
    assert job["lk"] == "elsewhere\x06\x169"


@pytest.mark.filterwarnings("ignore::celery.exceptions.CDeprecationWarning")  # queue= on a task (Celery 6)
def test_task_attributes_are_defaults(redis_url: str, uid: str) -> None:
    app = make_app(redis_url, uid, task_create_missing_queues=True)

    @app.task(base=DelayedTask, name="api.low", queue=f"low{uid}", priority=3, shared=False)
    def low() -> None:
        return None

    assert low.apply_later(when=10).job()["q"] == f"low{uid}"
    assert low.apply_later(when=10, queue=f"hi{uid}").job()["q"] == f"hi{uid}"  # call option wins


def test_shard_key_groups_jobs(tapp: Celery) -> None:
    hs = [apply_later(tapp, NAME, args=(i,), when=60, shard_key="tenant-1") for i in range(5)]
    assert len({h.shard for h in hs}) == 1
    assert hs[0].shard == get_store(tapp).layout.shard_of("whatever", "tenant-1")
    as_int = apply_later(tapp, NAME, args=(1,), when=60, shard_key=12345)
    assert as_int.shard == get_store(tapp).layout.shard_of("x", "12345")
    # cancel finds a job away from its id's shard.
    assert cancel(tapp, hs[0].id) == "SCHEDULED"


def test_apply_later_many(tapp: Celery, rclient: redis.Redis) -> None:
    task = tapp.tasks[NAME]
    calls = [{"args": (i,), "when": 60 + i, "shard_key": f"s{i % 3}"} for i in range(30)]
    hs = task.apply_later_many(calls)
    assert len(hs) == 30 and len({h.id for h in hs}) == 30
    # One script call per shard, each reading the Redis clock: a few ms apart at most.
    assert all(abs(h.due_ms - hs[0].due_ms - i * 1000) < 50 for i, h in enumerate(hs))
    assert sum(r["pending"] for r in ShardStatus(get_store(tapp)).rows()) == 30
    assert apply_later_many(tapp, NAME, []) == []
    more = apply_later_many(tapp, NAME, ({"args": (i,)} for i in range(3)))  # any iterable, when defaults to 0
    assert len(more) == 3 and len({h.id for h in more}) == 3
    assert all(h.created for h in more)


def test_delayed_task_apply_later(tapp: Celery) -> None:
    task = tapp.tasks[NAME]
    h = task.apply_later(args=(7,), when=30, priority=5)
    assert h.job()["task"] == NAME
    assert h.app is tapp


# -- cancel / reschedule ---------------------------------------------------------


def test_cancel(tapp: Celery) -> None:
    h = apply_later(tapp, NAME, args=(1,), when=60)
    assert cancel(tapp, h.id) == "SCHEDULED"
    assert h.job_state == "CANCELLED"
    with pytest.raises(InvalidState, match="it is CANCELLED"):
        cancel(tapp, h.id)
    assert h.cancel() is False
    with pytest.raises(JobNotFound, match="never scheduled"):
        cancel(tapp, "no-such-job")
    h2 = apply_later(tapp, NAME, args=(2,), when=60)
    assert h2.cancel() is True and h2.cancel() is False
    assert sum(r["pending"] for r in ShardStatus(get_store(tapp)).rows()) == 0


def test_cancel_a_released_job(tapp: Celery) -> None:
    h = apply_later(tapp, NAME, args=(1,), when=0)
    get_store(tapp).release.release_due(h.shard)
    assert cancel(tapp, h.id) == "QUEUED"  # the worker re-reads the state and skips it
    assert h.job_state == "CANCELLED"


def test_reschedule(tapp: Celery) -> None:
    h = apply_later(tapp, NAME, args=(1,), when=3600)
    at = datetime(2032, 1, 1, tzinfo=timezone.utc)
    assert reschedule(tapp, h.id, at) == int(at.timestamp() * 1000)
    assert h.job()["due"] == str(int(at.timestamp() * 1000))
    before = redis_ms(tapp)
    eta = h.reschedule(timedelta(seconds=10))
    assert eta == h.eta and before + 10_000 <= h.due_ms <= redis_ms(tapp) + 10_000
    with pytest.raises(InvalidWhen):
        h.reschedule(-5)
    with pytest.raises(JobNotFound):
        reschedule(tapp, "no-such-job", 5)
    h.cancel()
    with pytest.raises(InvalidState, match="cannot reschedule"):
        h.reschedule(5)


# -- idempotency -------------------------------------------------------------------


def test_idempotency_key(tapp: Celery) -> None:
    first = apply_later(tapp, NAME, args=(1,), when=60, idempotency_key="order-42")
    assert first.created and first.id == job_id_for_key("order-42")
    again = apply_later(tapp, NAME, args=(2,), when=600, idempotency_key="order-42")
    assert (again.id, again.created, again.due_ms, again.shard) == (first.id, False, first.due_ms, first.shard)
    assert first.job()["ik"] == "order-42"
    other = apply_later(tapp, NAME, args=(1,), when=60, idempotency_key="order-43")
    assert other.id != first.id and other.created
    # In one batch: the first item creates it, the repeat returns it.
    a, b = apply_later_many(tapp, NAME, [{"args": (i,), "idempotency_key": "k9"} for i in (1, 2)])
    assert a.id == b.id and (a.created, b.created) == (True, False)
    assert cancel_by_key(tapp, "order-42") == "SCHEDULED"
    # A cancel frees the key: the next call schedules the job's next generation (same id, gen 1).
    third = apply_later(tapp, NAME, args=(3,), when=60, idempotency_key="order-42")
    assert third.created is True and third.id == first.id and third.job_state == "SCHEDULED"
    assert third.job()["gen"] == "1"
    again3 = apply_later(tapp, NAME, args=(4,), when=60, idempotency_key="order-42")
    assert again3.created is False and again3.due_ms == third.due_ms
    assert cancel_by_key(tapp, "order-42") == "SCHEDULED"
    fourth = apply_later(tapp, NAME, args=(5,), when=60, idempotency_key="order-42")
    assert fourth.created and fourth.job()["gen"] == "2"
    with pytest.raises(JobNotFound):
        cancel_by_key(tapp, "never-used")


def test_duplicate_task_id(tapp: Celery) -> None:
    apply_later(tapp, NAME, args=(1,), when=60, task_id="fixed")
    with pytest.raises(DuplicateJob, match="exists already") as e:
        apply_later(tapp, NAME, args=(2,), when=5, task_id="fixed")
    assert e.value.state == "SCHEDULED"
    assert get_store(tapp).lookup.get("fixed")["due"] != ""


# -- bad input ------------------------------------------------------------------------

BAD: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("nan", {"when": float("nan")}, InvalidWhen, "finite"),
    ("inf", {"when": float("inf")}, InvalidWhen, "finite"),
    ("negative", {"when": -1}, InvalidWhen, "negative"),
    ("negative-td", {"when": timedelta(seconds=-3)}, InvalidWhen, "negative"),
    ("when-str", {"when": "tomorrow"}, InvalidWhen, "got str"),
    ("when-none", {"when": None}, InvalidWhen, "got NoneType"),
    ("when-bool", {"when": True}, InvalidWhen, "got bool"),
    ("unknown-option", {"when": 1, "frobnicate": 1}, InvalidOption, "frobnicate"),
    ("eta", {"eta": datetime(2030, 1, 1, tzinfo=timezone.utc)}, InvalidOption, "give the due time as when="),
    ("countdown", {"countdown": 10}, InvalidOption, "give the due time as when="),
    ("unserializable", {"args": (object(),)}, SerializationError, "cannot be serialized"),
    ("unserializable-kwargs", {"kwargs": {"note": {1, 2}}}, SerializationError, "cannot be serialized"),
    ("too-large", {"args": ("x" * 5000,)}, PayloadTooLarge, "delayed_max_payload_bytes"),
    ("args-type", {"args": "abc"}, InvalidOption, "args must be a list or tuple"),
    ("kwargs-type", {"kwargs": [1]}, InvalidOption, "kwargs must be a mapping"),
    ("task-id-int", {"task_id": 5}, InvalidOption, "task_id must be a string"),
    ("task-id-empty", {"task_id": ""}, InvalidOption, "task_id must not be empty"),
    ("shard-key-float", {"shard_key": 1.5}, InvalidOption, "shard_key must be a string or an int"),
    ("shard-key-bool", {"shard_key": True}, InvalidOption, "shard_key must be a string or an int"),
    ("ikey-int", {"idempotency_key": 42}, InvalidOption, "idempotency_key must be a string"),
    ("ikey-and-id", {"idempotency_key": "k", "task_id": "t"}, InvalidOption, "not both"),
    ("priority", {"priority": "urgent"}, InvalidOption, "priority"),
    ("headers", {"headers": [("a", 1)]}, InvalidOption, "headers must be a mapping"),
    ("missing-queue", {"queue": "nowhere"}, InvalidOption, "task_queues"),
    ("too-many-args", {"args": (1, "a", "b")}, InvalidOption, "do not match the signature of api.remind"),
    ("unknown-kwarg", {"kwargs": {"colour": 1}}, InvalidOption, "unexpected keyword argument 'colour'"),
    ("missing-arg", {"args": ()}, InvalidOption, "missing 1 required positional argument"),
]


@pytest.mark.parametrize(("call", "exc", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_and_stores_nothing(
    tapp: Celery, rclient: redis.Redis, call: dict[str, Any], exc: type[Exception], needle: str
) -> None:
    if call.get("queue") == "nowhere":
        tapp.conf.task_create_missing_queues = False
    call = {"args": (1,)} | call
    with pytest.raises(exc, match=needle):
        apply_later(tapp, NAME, **call)
    with pytest.raises(exc, match=needle):
        tapp.tasks[NAME].apply_later(**call)
    assert keys_of(rclient, tapp) == set()


def test_unknown_task_name(tapp: Celery, rclient: redis.Redis) -> None:
    with pytest.raises(UnknownTask, match="strict=False"):
        apply_later(tapp, "api.nope", when=1)
    with pytest.raises(UnknownTask):
        apply_later_many(tapp, "api.nope", [{"when": 1}])
    with pytest.raises(UnknownTask, match="non-empty string"):
        apply_later(tapp, "", when=1)
    assert keys_of(rclient, tapp) == set()
    # strict=False: a task only the workers define.
    assert apply_later(tapp, "api.nope", when=1, strict=False).job()["task"] == "api.nope"


@pytest.mark.parametrize(("call", "exc", "needle"), [b[1:] for b in BAD[:12]], ids=[b[0] for b in BAD[:12]])
def test_one_bad_item_in_a_batch_stores_nothing(
    tapp: Celery, rclient: redis.Redis, call: dict[str, Any], exc: type[Exception], needle: str
) -> None:
    calls = [{"args": (i,), "when": 60, "shard_key": f"s{i}"} for i in range(20)]
    calls.insert(13, {"args": (1,)} | call)
    with pytest.raises(exc, match=needle):
        apply_later_many(tapp, NAME, calls)
    assert keys_of(rclient, tapp) == set()


#: bad arguments, in a call that gives only args, kwargs and when (apply_later_many's fast path)
BAD_ARGUMENTS = [b for b in BAD if b[0] in {"unserializable", "unserializable-kwargs", "too-large", "args-type",
                                            "kwargs-type", "too-many-args", "unknown-kwarg", "missing-arg"}]


@pytest.mark.parametrize(("call", "exc", "needle"), [b[1:] for b in BAD_ARGUMENTS], ids=[b[0] for b in BAD_ARGUMENTS])
def test_bad_arguments_in_a_batch_of_plain_calls_store_nothing(
    tapp: Celery, rclient: redis.Redis, call: dict[str, Any], exc: type[Exception], needle: str
) -> None:
    # Calls with only args, kwargs and when share their options: the batch prepares them on a
    # path of its own, which checks each call's arguments as apply_later does.
    calls: list[dict[str, Any]] = [{"args": (i,), "when": 60} for i in range(20)]
    calls.insert(13, {"args": (1,), "when": 60} | call)
    with pytest.raises(exc, match=needle):
        apply_later_many(tapp, NAME, calls)
    with pytest.raises(exc, match=needle):
        tapp.tasks[NAME].apply_later_many(calls)
    assert keys_of(rclient, tapp) == set()


def test_signature_check_follows_task_typing(redis_url: str, uid: str) -> None:
    app = make_app(redis_url, uid)

    @app.task(base=DelayedTask, name="api.loose", typing=False, shared=False)
    def loose(a: int) -> None:
        return None

    @app.task(base=DelayedTask, name="api.bound", bind=True, shared=False)
    def bound(self: Any, a: int) -> None:
        return None

    assert loose.apply_later(args=(1, 2, 3), when=60).created  # typing=False: not checked, as apply_async
    assert bound.apply_later(args=(1,), when=60).created  # self is not counted
    with pytest.raises(InvalidOption, match="signature"):
        bound.apply_later(args=(1, 2), when=60)
    # The same in a batch of calls that give only args and when.
    assert all(h.created for h in loose.apply_later_many([{"args": (1, 2, 3), "when": 60}] * 3))
    assert all(h.created for h in bound.apply_later_many([{"args": (i,), "when": 60} for i in range(3)]))
    with pytest.raises(InvalidOption, match="signature"):
        bound.apply_later_many([{"args": (1,), "when": 60}, {"args": (1, 2), "when": 60}])
    # By name with strict=False nothing is known of the signature: not checked.
    assert apply_later(app, "api.elsewhere", args=(1, 2, 3), when=60, strict=False).created


@pytest.mark.parametrize("bad", [None, 42, b"id", ""])
def test_bad_job_ids_for_cancel_reschedule_and_keys(tapp: Celery, bad: Any) -> None:
    with pytest.raises(InvalidOption, match="job id must be a non-empty string"):
        cancel(tapp, bad)
    with pytest.raises(InvalidOption, match="job id must be a non-empty string"):
        reschedule(tapp, bad, 5)
    with pytest.raises(InvalidOption, match="job id must be a non-empty string"):
        get_store(tapp).lookup.get(bad)
    if bad != "":
        with pytest.raises(InvalidOption, match="idempotency_key must be a string"):
            cancel_by_key(tapp, bad)


def test_duplicate_id_in_a_batch_stores_nothing(tapp: Celery, rclient: redis.Redis) -> None:
    calls = [{"args": (i,), "when": 60} for i in range(10)]
    with pytest.raises(InvalidOption, match="'same' is given twice in this batch"):
        apply_later_many(tapp, NAME, [*calls, {"args": (1,), "task_id": "same"}, {"args": (2,), "task_id": "same"}])
    assert keys_of(rclient, tapp) == set()


def test_a_taken_task_id_in_a_batch_stores_nothing(tapp: Celery, rclient: redis.Redis) -> None:
    """Checked before writing (one round trip); only a race with another writer can still split a batch."""
    apply_later(tapp, NAME, args=(0,), when=60, task_id="taken")
    before = keys_of(rclient, tapp)
    calls = [{"args": (i,), "when": 60} for i in range(10)] + [{"args": (1,), "task_id": "taken"}]
    with pytest.raises(DuplicateJob, match="'taken' exists already"):
        apply_later_many(tapp, NAME, calls)
    assert keys_of(rclient, tapp) == before
    # Chosen ids that are free go through; idempotency keys still return the existing job.
    hs = apply_later_many(tapp, NAME, [{"args": (1,), "task_id": "free"}, {"args": (2,), "idempotency_key": "k"},
                                       {"args": (3,), "idempotency_key": "k"}])
    assert [h.created for h in hs] == [True, True, False]


# -- Redis down -------------------------------------------------------------------------


@pytest.fixture
def down_app(uid: str) -> Iterator[Celery]:
    """An app whose store points at a port nobody listens on."""
    app = make_app(f"redis://127.0.0.1:{free_port()}/0", uid)

    @app.task(base=DelayedTask, name=NAME, shared=False)
    def remind(user_id: int) -> None:
        return None

    yield app


@pytest.mark.parametrize("op", ["apply_later", "apply_later_many", "cancel", "reschedule"])
def test_store_unavailable(down_app: Celery, op: str) -> None:
    calls = {
        "apply_later": lambda: apply_later(down_app, NAME, args=(1,), when=5),
        "apply_later_many": lambda: apply_later_many(
            down_app, NAME, [{"args": (i,), "when": 5, "shard_key": str(i)} for i in range(10)]),
        "cancel": lambda: cancel(down_app, "some-id"),
        "reschedule": lambda: reschedule(down_app, "some-id", 5),
    }
    with pytest.raises(StoreUnavailable, match="cannot reach the celery-delayed store") as e:
        calls[op]()
    assert isinstance(e.value, ConnectionError)
    assert "nothing was written" in str(e.value)


@pytest.mark.timeout(60)
def test_redis_going_down_and_back(uid: str) -> None:
    """A store that restarts: calls fail with StoreUnavailable while it is down, then work again."""
    server = RedisServer().start()
    try:
        app = make_app(server.url, uid, delayed_shards=4)
        h = apply_later(app, NAME, when=60, strict=False)
        server.stop()
        with pytest.raises(StoreUnavailable):
            apply_later_many(app, NAME, [{"when": 5, "shard_key": str(i)} for i in range(8)], strict=False)
        with pytest.raises(StoreUnavailable):
            h.job()
        server.start()  # same port, empty (no persistence): the earlier job is gone
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.dbsize() == 0
        hs = apply_later_many(app, NAME, [{"when": 5, "shard_key": str(i)} for i in range(8)], strict=False)
        assert len(hs) == 8 and len({x.id for x in hs}) == 8
        assert all(x.created for x in hs)
        with pytest.raises(JobNotFound):
            h.job()
        client.close()
    finally:
        server.stop()


def test_a_cancelled_generations_message_is_refused_at_start(tapp: Celery, rclient: Any) -> None:
    """A key freed by a cancel gets a new generation; the old generation's leftover message never runs as it."""
    store = get_store(tapp)
    first = apply_later(tapp, NAME, args=(1,), when=0, idempotency_key="gen-k")
    assert store.release.release_due(first.shard).ids == [first.id]  # its message is in the queue now
    assert first.cancel() and first.job_state == "CANCELLED"
    second = apply_later(tapp, NAME, args=(2,), when=0, idempotency_key="gen-k")
    assert second.created and second.id == first.id and second.job()["gen"] == "1"
    assert store.release.release_due(second.shard).ids == [second.id]
    msgs = [json.loads(m) for m in rclient.lrange(tapp.conf.task_default_queue, 0, -1)]
    assert [m["headers"].get("delayed_gen") for m in reversed(msgs)] == [None, 1]  # FIFO: gen 0, then gen 1
    stale = store.executions.start(first.id, first.shard, "w-old", generation=0)
    assert (stale.run, stale.superseded, stale.cancelled) == (False, True, False)
    assert store.executions.start(second.id, second.shard, "w-new", generation=1).run


# -- task-sent events ------------------------------------------------------------


@pytest.mark.parametrize("events", [False, True], ids=["events-off", "events-on"])
def test_a_call_announces_task_sent_only_with_sent_events_on(
    tapp: Celery, monkeypatch: pytest.MonkeyPatch, events: bool
) -> None:
    """A call giving only args and when takes the short path; with task_send_sent_event it still announces."""
    import celery_delayed.api as api_module

    tapp.conf.task_send_sent_event = events
    announced: list[list[Any]] = []

    class Recorder:
        def scheduled(self, batch: list[Any]) -> None:
            announced.append(list(batch))

    monkeypatch.setattr(api_module, "shared_announcer", lambda app: Recorder())
    one = apply_later(tapp, NAME, args=(1,), when=60)
    many = apply_later_many(tapp, NAME, [{"args": (i,), "when": 60} for i in range(3)])
    record = one.job()
    if events:
        assert "ev" in record and "tp" not in record  # the whole message, with the event to announce
        assert json.loads(record["ev"])["uuid"] == one.id
        assert announced[0][0][0]["uuid"] == one.id
        assert [len(b) for b in announced] == [1, 3]
        assert {e["uuid"] for e, _eta in announced[1]} == {h.id for h in many}
    else:
        assert "ev" not in record and "tp" in record  # a compact record: nothing to announce
        assert announced == []


# -- the connection a call goes on ----------------------------------------------------


@pytest.mark.timeout(60)
def test_a_call_whose_connection_was_dropped_is_made_once_on_another(tapp: Celery, rclient: redis.Redis) -> None:
    """One call goes on the thread's own connection (the execution record's lane); when that connection is
    gone, the call is made on the client's pool, once: nothing lost, nothing twice."""
    store = get_store(tapp)
    first = apply_later(tapp, NAME, args=(1,), when=60)
    lane = store.redis.lane()
    lane.conn.send_command("CLIENT", "ID")
    own_id = int(lane.conn.read_response())
    assert rclient.client_kill_filter(_id=own_id) == 1
    second = apply_later(tapp, NAME, args=(2,), when=60)
    assert first.created and second.created
    jobs = [k for k in rclient.scan_iter(match=f"{tapp.conf.delayed_key_prefix}:*:job:*")]
    assert len(jobs) == 2
    assert lane.conn is None  # dropped: the next call opens a new one
    third = apply_later(tapp, NAME, args=(3,), when=60)
    assert third.created and lane.conn is not None
    assert {store.lookup.get(h.id)["st"] for h in (first, second, third)} == {"SCHEDULED"}


@pytest.mark.timeout(120)
def test_a_lane_dropped_many_times_still_gets_a_connection(tapp: Celery, rclient: redis.Redis) -> None:
    """A lane's connection is its own, not one of the client's pool: however often it is dropped (a
    worker's lane is reset twice per job while the store is down), the next call opens a new one. (Counted
    against the pool, redis-py 8's default of 100 connections ran out after about 100 resets, and every
    start then ran without the execution record.)"""
    store = get_store(tapp)
    apply_later(tapp, NAME, args=(0,), when=60)
    lane = store.redis.lane()
    for i in range(150):
        lane.conn.send_command("CLIENT", "ID")
        assert rclient.client_kill_filter(_id=int(lane.conn.read_response())) == 1
        assert apply_later(tapp, NAME, args=(i,), when=60).created  # on the pool: the lane's connection is gone
        assert lane.conn is None
        apply_later(tapp, NAME, args=(i,), when=60)
        assert lane.conn is not None, f"no new connection for the lane after {i + 1} drops"
