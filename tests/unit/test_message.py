"""Our stored envelope equals what kombu's Redis transport really LPUSHes.

Each case publishes one task with ``app.send_task`` through kombu onto the
private Redis, builds the same task with :func:`build_message`, and compares
the two JSON envelopes field by field (and the list key they go to). Left out
of the comparison: ``delivery_tag`` (a fresh uuid per message), ``origin`` and
``reply_to`` (process identity), and kombu's ``expiration`` property (Celery
derives it from ``expires`` at send time; the Redis transport and the worker
never read it, and the worker honours the ``expires`` header instead).
"""

from __future__ import annotations

import base64
import json
import uuid
import warnings
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Exchange, Queue
from kombu.compression import decompress
from support import make_app

from celery_delayed import get_store
from celery_delayed.errors import InvalidOption, SerializationError
from celery_delayed.producer.message import BuiltMessage, build_message, task_defaults

SEP = "\x06\x16"


def destination(app: Celery, built: Any) -> dict[str, str]:
    """Where the direct release path pushes a built message (the record's lk, or bx/rk/ps)."""
    return get_store(app).broker.destination(built.route)
NAME = "tests.message.task"


def _app(redis_url: str, uid: str, **conf: Any) -> Celery:
    app = make_app(redis_url, uid, **conf)

    @app.task(name=NAME, shared=False)
    def task(*args: Any, **kwargs: Any) -> None:  # never runs
        return None

    return app


def _lists(client: redis.Redis, before: set[str]) -> dict[str, list[str]]:
    return {k: client.lrange(k, 0, -1) for k in client.keys("*") if k not in before and client.type(k) == "list"}


def kombu_publish(app: Celery, client: redis.Redis, **send: Any) -> tuple[str, dict[str, Any]]:
    """Send one task with Celery/kombu; return the list key it landed on and the envelope."""
    before = {str(k) for k in client.keys("*")}
    app.send_task(NAME, **send)
    new = _lists(client, before)
    assert len(new) == 1, f"expected one new list, got {sorted(new)}"
    [(key, items)] = new.items()
    assert len(items) == 1
    client.delete(key)
    return key, json.loads(items[0])


def ours(
    app: Celery, task_id: str, args: Any = (), kwargs: Any = None, **options: Any
) -> tuple[BuiltMessage, dict[str, Any]]:
    built = build_message(app, NAME, args, kwargs or {}, task_id, options, app.tasks[NAME])
    return built, json.loads(built.body)


def _body(env: dict[str, Any]) -> bytes:
    raw = base64.b64decode(env["body"])
    if "compression" in env["headers"]:
        raw = decompress(raw, env["headers"]["compression"])
    return raw


def assert_same_envelope(theirs: dict[str, Any], mine: dict[str, Any]) -> None:
    for env in (theirs, mine):
        env["properties"].pop("delivery_tag")
        env["properties"].pop("reply_to")
        env["properties"].pop("expiration", None)
        env["headers"].pop("origin")
    assert set(theirs) == set(mine) == {"body", "content-encoding", "content-type", "headers", "properties"}
    assert mine["properties"] == theirs["properties"]
    assert mine["headers"] == theirs["headers"]
    assert mine["content-type"] == theirs["content-type"]
    assert mine["content-encoding"] == theirs["content-encoding"]
    assert _body(mine) == _body(theirs)
    # Bodies are deterministic for these serializers/compressors: byte-equal as well.
    assert mine["body"] == theirs["body"]


@pytest.fixture
def client(redis_url: str) -> Any:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


ARGS = (1, "two", [3.5, None, True])
KWARGS = {"k": {"nested": ["é", 2]}, "n": -1}


def test_json_default(redis_url: str, uid: str, client: redis.Redis) -> None:
    app = _app(redis_url, uid)
    tid = str(uuid.uuid4())
    key, theirs = kombu_publish(app, client, args=ARGS, kwargs=KWARGS, task_id=tid)
    built, mine = ours(app, tid, ARGS, KWARGS)
    assert key == f"q{uid}" == destination(app, built)["lk"]
    assert mine["headers"]["eta"] is None and mine["headers"]["id"] == tid
    assert mine["properties"]["delivery_info"] == {"exchange": "", "routing_key": f"q{uid}"}
    assert mine["properties"]["body_encoding"] == "base64"
    assert mine["properties"]["delivery_tag"] != theirs["properties"]["delivery_tag"]
    assert_same_envelope(theirs, mine)


def test_custom_headers_and_options(redis_url: str, uid: str, client: redis.Redis) -> None:
    app = _app(redis_url, uid)
    tid = str(uuid.uuid4())
    opts: dict[str, Any] = {"headers": {"x-tenant": "acme", "n": 3}, "time_limit": 30, "soft_time_limit": 20,
                            "shadow": "shown-name", "root_id": "r1", "parent_id": "p1", "ignore_result": True}
    _, theirs = kombu_publish(app, client, args=ARGS, task_id=tid, **opts)
    _, mine = ours(app, tid, ARGS, **opts)
    assert mine["headers"]["x-tenant"] == "acme" and mine["headers"]["timelimit"] == [30, 20]
    assert_same_envelope(theirs, mine)


def test_stamps_and_celerys_other_options(redis_url: str, uid: str, client: redis.Redis) -> None:
    """Stamps become the stamps headers; origin and replaced_task_nesting their headers; unknown options
    (what Celery hands to kombu's publish) message properties: as send_task makes them."""
    app = _app(redis_url, uid)
    tid = str(uuid.uuid4())
    send = {"stamped_headers": ["stamp", "tenant"], "stamp": 42, "tenant": {"id": "acme"},
            "origin": "gen1@host", "replaced_task_nesting": 2}
    _, theirs = kombu_publish(app, client, args=(1,), task_id=tid, x_trace="t-1", **send)
    _, mine = ours(app, tid, (1,), None, **send)
    assert mine["headers"]["stamps"] == {"stamp": 42, "tenant": {"id": "acme"}}
    assert mine["headers"]["stamped_headers"] == ["stamp", "tenant"]
    assert mine["headers"]["origin"] == theirs["headers"]["origin"] == "gen1@host"
    assert mine["headers"]["replaced_task_nesting"] == 2
    assert "x_trace" not in mine["properties"]  # apply_later takes no unknown option ...
    mine = json.loads(build_message(app, NAME, (1,), {}, tid, send, app.tasks[NAME],
                                    properties={"x_trace": "t-1"}).body)
    assert mine["properties"]["x_trace"] == theirs["properties"]["x_trace"] == "t-1"  # ... interception does
    assert_same_envelope(theirs, mine)
    with pytest.raises(InvalidOption, match="stamped_headers"):
        build_message(app, NAME, (), {}, tid, {"stamped_headers": "stamp", "stamp": 1}, app.tasks[NAME])


@pytest.mark.parametrize("accept", [["json", "pickle"], ["pickle"]])
def test_pickle_serializer(redis_url: str, uid: str, client: redis.Redis, accept: list[str]) -> None:
    app = _app(redis_url, uid, task_serializer="pickle", accept_content=accept)
    tid = str(uuid.uuid4())
    args = (datetime(2030, 1, 1, tzinfo=timezone.utc), {1, 2}, b"\x00bytes")
    _, theirs = kombu_publish(app, client, args=args, task_id=tid)
    _, mine = ours(app, tid, args)
    assert mine["content-type"] == "application/x-python-serialize"
    assert_same_envelope(theirs, mine)


def test_pickle_per_call_needs_accept_content(redis_url: str, uid: str, client: redis.Redis) -> None:
    app = _app(redis_url, uid, accept_content=["json", "pickle"])
    tid = str(uuid.uuid4())
    _, theirs = kombu_publish(app, client, args=(b"x",), task_id=tid, serializer="pickle")
    _, mine = ours(app, tid, (b"x",), serializer="pickle")
    assert_same_envelope(theirs, mine)
    # Without pickle in accept_content a worker would refuse the message: refused now.
    strict = _app(redis_url, uid)
    with pytest.raises(SerializationError, match="accept_content"):
        ours(strict, tid, (b"x",), serializer="pickle")


@pytest.mark.parametrize("compression", ["gzip", "bzip2"])
def test_compression(redis_url: str, uid: str, client: redis.Redis, compression: str) -> None:
    app = _app(redis_url, uid)
    tid = str(uuid.uuid4())
    args = ("x" * 5000,)
    _, theirs = kombu_publish(app, client, args=args, task_id=tid, compression=compression)
    _, mine = ours(app, tid, args, compression=compression)
    assert mine["headers"]["compression"] == theirs["headers"]["compression"]
    assert len(mine["body"]) < 1000
    assert_same_envelope(theirs, mine)


def test_task_compression_setting(redis_url: str, uid: str, client: redis.Redis) -> None:
    app = _app(redis_url, uid, task_compression="gzip")
    tid = str(uuid.uuid4())
    _, theirs = kombu_publish(app, client, args=("y" * 100,), task_id=tid)
    _, mine = ours(app, tid, ("y" * 100,))
    assert mine["headers"]["compression"] == "application/x-gzip"
    assert_same_envelope(theirs, mine)


def test_priorities_go_to_kombus_priority_lists(redis_url: str, uid: str, client: redis.Redis) -> None:
    app = _app(redis_url, uid)
    steps = {0: "", 1: "", 2: "", 3: "3", 4: "3", 5: "3", 6: "6", 7: "6", 8: "6", 9: "9"}
    for priority in range(10):
        tid = str(uuid.uuid4())
        key, theirs = kombu_publish(app, client, args=(priority,), task_id=tid, priority=priority)
        built, mine = ours(app, tid, (priority,), priority=priority)
        want = f"q{uid}" + (SEP + steps[priority] if steps[priority] else "")
        assert key == want == destination(app, built)["lk"], priority
        assert mine["properties"]["priority"] == priority
        assert_same_envelope(theirs, mine)


def test_custom_priority_steps(redis_url: str, uid: str, client: redis.Redis) -> None:
    app = _app(redis_url, uid, broker_transport_options={"priority_steps": list(range(10))})
    for priority in (0, 1, 5, 9):
        tid = str(uuid.uuid4())
        key, _ = kombu_publish(app, client, task_id=tid, priority=priority)
        built, _ = ours(app, tid, priority=priority)
        assert key == destination(app, built)["lk"]


def test_priority_out_of_range_is_clamped_like_kombu(redis_url: str, uid: str, client: redis.Redis) -> None:
    app = _app(redis_url, uid)
    tid = str(uuid.uuid4())
    key, theirs = kombu_publish(app, client, task_id=tid, priority=42)
    built, mine = ours(app, tid, priority=42)
    assert key == destination(app, built)["lk"] == f"q{uid}{SEP}9"
    assert_same_envelope(theirs, mine)  # the message keeps 42, as kombu's does; only the list is clamped
    assert mine["properties"]["priority"] == 42
    with pytest.raises(InvalidOption, match="priority must be an integer"):
        ours(app, tid, priority="high")


def test_task_default_priority(redis_url: str, uid: str, client: redis.Redis) -> None:
    """task_default_priority is a task attribute: apply_async uses it (send_task does not)."""
    app = _app(redis_url, uid, task_default_priority=7)
    task = app.tasks[NAME]
    tid = str(uuid.uuid4())
    before = {str(k) for k in client.keys("*")}
    task.apply_async(task_id=tid)
    [(key, [raw])] = _lists(client, before).items()
    client.delete(key)
    built, mine = ours(app, tid, **task_defaults(task))
    assert key == destination(app, built)["lk"] == f"q{uid}{SEP}6"
    assert_same_envelope(json.loads(raw), mine)


def test_expires(redis_url: str, uid: str, client: redis.Redis) -> None:
    app = _app(redis_url, uid)
    tid = str(uuid.uuid4())
    expires = datetime.now(timezone.utc) + timedelta(hours=2)
    _, theirs = kombu_publish(app, client, task_id=tid, expires=expires)
    _, mine = ours(app, tid, expires=expires)
    assert mine["headers"]["expires"] == expires.isoformat()
    assert_same_envelope(theirs, mine)


def test_non_default_queue(redis_url: str, uid: str, client: redis.Redis) -> None:
    app = _app(redis_url, uid, task_create_missing_queues=True)
    tid = str(uuid.uuid4())
    key, theirs = kombu_publish(app, client, task_id=tid, queue=f"other{uid}")
    built, mine = ours(app, tid, queue=f"other{uid}")
    assert key == f"other{uid}" == destination(app, built)["lk"] == built.route.queue
    assert_same_envelope(theirs, mine)


def test_task_routes(redis_url: str, uid: str, client: redis.Redis) -> None:
    app = _app(redis_url, uid, task_routes={NAME: {"queue": f"routed{uid}", "priority": 4}})
    tid = str(uuid.uuid4())
    key, theirs = kombu_publish(app, client, task_id=tid)
    built, mine = ours(app, tid)
    assert key == f"routed{uid}{SEP}3" == destination(app, built)["lk"]
    assert_same_envelope(theirs, mine)


def test_queue_on_a_named_direct_exchange(redis_url: str, uid: str, client: redis.Redis) -> None:
    """queue= alone: Celery sends through the anonymous exchange to the queue's name."""
    ex = Exchange(f"ex{uid}", type="direct")
    queue = Queue(f"qx{uid}", ex, routing_key=f"rk.{uid}")
    app = _app(redis_url, uid, task_queues=[Queue(f"q{uid}"), queue])
    with Connection(redis_url) as conn:  # as a worker consuming the queue would
        queue(conn.default_channel).declare()
    for priority in (0, 7):
        tid = str(uuid.uuid4())
        key, theirs = kombu_publish(app, client, task_id=tid, queue=f"qx{uid}", priority=priority)
        built, mine = ours(app, tid, queue=f"qx{uid}", priority=priority)
        assert key == f"qx{uid}" + (f"{SEP}6" if priority else "") == destination(app, built)["lk"]
        assert_same_envelope(theirs, mine)


def test_named_direct_exchange_by_route(redis_url: str, uid: str, client: redis.Redis) -> None:
    """A route naming exchange and routing key goes through the exchange's bindings."""
    ex = Exchange(f"ex{uid}", type="direct")
    queue = Queue(f"qx{uid}", ex, routing_key=f"rk.{uid}")
    route = {"exchange": f"ex{uid}", "routing_key": f"rk.{uid}"}
    app = _app(redis_url, uid, task_queues=[Queue(f"q{uid}"), queue], task_routes={NAME: route})
    with Connection(redis_url) as conn:
        queue(conn.default_channel).declare()
    for priority in (0, 7):
        tid = str(uuid.uuid4())
        key, theirs = kombu_publish(app, client, task_id=tid, priority=priority)
        built, mine = ours(app, tid, priority=priority)
        assert key == f"qx{uid}" + (f"{SEP}6" if priority else "")
        dest = destination(app, built)
        assert dest == {"bx": f"_kombu.binding.ex{uid}", "rk": f"rk.{uid}", "ps": f"{SEP}6" if priority else ""}
        assert mine["properties"]["delivery_info"] == {"exchange": f"ex{uid}", "routing_key": f"rk.{uid}"}
        assert_same_envelope(theirs, mine)


def test_exchange_and_routing_key_options(redis_url: str, uid: str, client: redis.Redis) -> None:
    ex = Exchange(f"ex{uid}", type="direct")
    with Connection(redis_url) as conn:
        Queue(f"bound{uid}", ex, routing_key="custom.rk", channel=conn.default_channel).declare()
    app = _app(redis_url, uid)
    tid = str(uuid.uuid4())
    key, theirs = kombu_publish(app, client, task_id=tid, exchange=f"ex{uid}", routing_key="custom.rk")
    built, mine = ours(app, tid, exchange=f"ex{uid}", routing_key="custom.rk")
    assert key == f"bound{uid}"
    assert destination(app, built) == {"bx": f"_kombu.binding.ex{uid}", "rk": "custom.rk", "ps": ""}
    assert_same_envelope(theirs, mine)


def test_topic_exchange_is_refused_for_the_direct_path(redis_url: str, uid: str) -> None:
    ex = Exchange(f"tx{uid}", type="topic")
    app = _app(redis_url, uid, task_queues=[Queue(f"q{uid}"), Queue(f"tq{uid}", ex, routing_key="a.#")])
    built, _ = ours(app, "id1", queue=f"tq{uid}")
    with pytest.raises(InvalidOption, match="delayed_release_mode = 'publish'"):
        destination(app, built)


def test_global_keyprefix(redis_url: str, uid: str, client: redis.Redis) -> None:
    gkp = f"g{uid}_"
    opts = {"global_keyprefix": gkp}
    ex = Exchange(f"ex{uid}", type="direct")
    queue = Queue(f"qx{uid}", ex, routing_key="rk")
    app = _app(redis_url, uid, broker_transport_options=opts, task_queues=[Queue(f"q{uid}"), queue])
    with Connection(redis_url, transport_options=opts) as conn:
        queue(conn.default_channel).declare()
    tid = str(uuid.uuid4())
    key, theirs = kombu_publish(app, client, task_id=tid, priority=9)
    built, mine = ours(app, tid, priority=9)
    assert key == f"{gkp}q{uid}{SEP}9" == destination(app, built)["lk"]
    assert_same_envelope(theirs, mine)
    tid = str(uuid.uuid4())
    route = {"exchange": f"ex{uid}", "routing_key": "rk"}
    key, theirs = kombu_publish(app, client, task_id=tid, **route)
    built, mine = ours(app, tid, **route)
    assert key == f"{gkp}qx{uid}"
    assert destination(app, built)["bx"] == f"{gkp}_kombu.binding.ex{uid}"
    assert client.exists(destination(app, built)["bx"])
    assert_same_envelope(theirs, mine)


def test_sent_event_fields(redis_url: str, uid: str) -> None:
    app = _app(redis_url, uid, task_send_sent_event=True)
    built, _ = ours(app, "id-ev", (1,), priority=3)
    assert built.sent_event is not None
    ev = built.sent_event
    assert ev["uuid"] == "id-ev" and ev["name"] == NAME and ev["args"] == "(1,)"
    assert (ev["queue"], ev["exchange"], ev["routing_key"]) == (f"q{uid}", "", f"q{uid}")
    json.dumps(ev)  # stored as JSON in the record
    off = _app(redis_url, uid)
    assert ours(off, "id-ev")[0].sent_event is None


def test_apply_later_message_equals_apply_async(redis_url: str, uid: str, client: redis.Redis) -> None:
    """The whole API path (task defaults, router, options) against Celery's apply_async."""
    from celery_delayed import DelayedTask
    from celery_delayed.producer.prepare import prepare

    app = make_app(redis_url, uid, task_default_priority=4, task_compression="gzip",
                   task_routes={"tests.message.dt": {"queue": f"r{uid}"}})

    @app.task(base=DelayedTask, name="tests.message.dt", time_limit=60, acks_late=True, shared=False)
    def dt(a: int, b: str = "") -> None:
        return None

    opts = {"headers": {"h": 1}, "expires": datetime(2031, 1, 1, tzinfo=timezone.utc), "priority": 8}
    tid = str(uuid.uuid4())
    before = {str(k) for k in client.keys("*")}
    dt.apply_async((1,), {"b": "x"}, task_id=tid, **opts)
    [(key, [raw])] = _lists(client, before).items()
    client.delete(key)
    p = prepare(app, get_store(app), dt.name, (1,), {"b": "x"}, 5, task_id=tid, task_type=dt,
                options=task_defaults(dt) | opts)
    assert key == p.job.full_fields()["lk"] == f"r{uid}{SEP}6"
    mine = json.loads(p.job.full_fields()["msg"])
    assert mine["headers"].pop("delayed_shard") == p.job.shard
    assert mine["headers"].pop("delayed_store") == app.conf.delayed_key_prefix
    # the due time, as Celery writes an eta: what the task sees as request.eta (no eta: not held)
    eta = datetime.fromisoformat(mine["headers"].pop("delayed_eta"))
    assert abs((eta - datetime.now(timezone.utc)).total_seconds() - 5) < 2 and eta.utcoffset() == timedelta(0)
    assert_same_envelope(json.loads(raw), mine)


TRICKY_ARGS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((1,), {}),
    ((2, "plain"), {"b": "x"}),
    (("it's", 'say "hi"', "back\\slash", "tab\tnl\n", "ünï😀"), {}),
    ((10**30, -0.0, 1e300, 2.5e-10, True, None), {"z": False}),
    (([1, [2, [3, {"k": (4, 5)}]]],), {"nested": {"a": [None, {}], "é": "ß"}}),
    (("x" * 3000,), {"long": list(range(300))}),
    ((), {}),
    ((float("nan"),), {}),
    (({"b": 1, "a": 2},), {"order": {"z": 1, "a": 0}}),
]


def test_repeated_calls_match_apply_async(redis_url: str, uid: str, client: redis.Redis) -> None:
    """Many calls of one task and option set (the shape a cached envelope template serves)."""
    from celery_delayed import DelayedTask
    from celery_delayed.producer.prepare import prepare

    app = make_app(redis_url, uid)

    @app.task(base=DelayedTask, name="tests.message.rep", shared=False)
    def rep(*args: Any, **kwargs: Any) -> None:
        return None

    for opts in ({}, {"priority": 5, "headers": {"h": "v"}}, {"queue": f"q{uid}", "time_limit": 9}):
        for i, (args, kwargs) in enumerate(TRICKY_ARGS * 2):
            tid = f"id-{i}-{uuid.uuid4()}"
            before = {str(k) for k in client.keys("*")}
            rep.apply_async(args, kwargs, task_id=tid, **opts)
            [(key, [raw])] = _lists(client, before).items()
            client.delete(key)
            p = prepare(app, get_store(app), rep.name, args, kwargs, 5, task_id=tid, task_type=rep,
                        options=task_defaults(rep) | opts)
            assert key == p.job.full_fields()["lk"]
            mine = json.loads(p.job.full_fields()["msg"])
            assert mine["headers"].pop("delayed_shard") == p.job.shard
            assert mine["headers"].pop("delayed_store") == app.conf.delayed_key_prefix
            assert datetime.fromisoformat(mine["headers"].pop("delayed_eta")) > datetime.now(timezone.utc)
            assert mine["properties"]["delivery_tag"] != json.loads(raw)["properties"]["delivery_tag"]
            theirs = json.loads(raw)
            assert mine["body"] == theirs["body"] or json.loads(_body(mine)) == json.loads(_body(theirs))
            mine["body"] = theirs["body"]
            assert_same_envelope(theirs, mine)


@pytest.mark.parametrize("dead", [None, "dlq"])
def test_unroutable_message_on_a_named_exchange(redis_url: str, uid: str, client: redis.Redis,
                                                 dead: str | None) -> None:
    """What kombu does when no queue is bound for the routing key (release_due.lua does the same)."""
    opts = {"deadletter_queue": f"{dead}{uid}"} if dead else {}
    with Connection(redis_url, transport_options=opts) as conn:
        Queue(f"bound{uid}", Exchange(f"ex{uid}", type="direct"), routing_key="r1",
              channel=conn.default_channel).declare()
    app = _app(redis_url, uid, broker_transport_options=opts)
    before = {str(k) for k in client.keys("*")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kombu's UndeliverableWarning (with a dead-letter queue only)
        app.send_task(NAME, exchange=f"ex{uid}", routing_key="nobody", priority=9)
    new = _lists(client, before)
    if dead:
        assert list(new) == [f"{dead}{uid}{SEP}9"]
        client.delete(*new)
    else:
        assert new == {}  # dropped
    built, _ = ours(app, "id", exchange=f"ex{uid}", routing_key="nobody", priority=9)
    assert destination(app, built) == {"bx": f"_kombu.binding.ex{uid}", "rk": "nobody", "ps": f"{SEP}9"}


@pytest.mark.parametrize("kind", ["routing_key_alone", "queue_object", "exchange_object"])
def test_more_routing_spellings(redis_url: str, uid: str, client: redis.Redis, kind: str) -> None:
    ex = Exchange(f"ex{uid}", type="direct")
    qobj = Queue(f"qo{uid}", ex, routing_key="rk.o")
    app = _app(redis_url, uid, task_queues=[Queue(f"q{uid}"), qobj])
    with Connection(redis_url) as conn:
        qobj(conn.default_channel).declare()
    opts: dict[str, Any] = {
        "routing_key_alone": {"routing_key": "ignored.without.exchange"},
        "queue_object": {"queue": qobj},
        "exchange_object": {"exchange": ex, "routing_key": "rk.o"},
    }[kind]
    tid = str(uuid.uuid4())
    key, theirs = kombu_publish(app, client, task_id=tid, **opts)
    built, mine = ours(app, tid, **opts)
    dest = destination(app, built)
    if "lk" in dest:
        assert key == dest["lk"]
    else:
        assert key == f"qo{uid}" and dest["bx"] == f"_kombu.binding.ex{uid}" and dest["rk"] == "rk.o"
    assert_same_envelope(theirs, mine)
