"""Round trip: messages released by release_due.lua are consumed and run by a REAL worker.

One worker subprocess per broker configuration; every case of that
configuration is scheduled and released (with ``DirectReleaser``, i.e.
release_due.lua plus the task-sent events) before the worker starts, so the
test also checks where each message landed, then the worker must run them all.
The task is a plain one (``e2e.plain``): a message pushed twice would run twice.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import celery
import pytest
import redis
from celery import Celery
from kombu import Connection, Exchange, Queue
from support import WorkerProcess, make_app, ran, wait_for
from support.delivery import received, undelivered

from celery_delayed import apply_later, get_store
from celery_delayed.scheduler.releaser import DirectReleaser

pytestmark = pytest.mark.e2e

SEP = "\x06\x16"
STEP = {0: "", 1: "", 2: "", 3: "3", 4: "3", 5: "3", 6: "6", 7: "6", 8: "6", 9: "9"}


def _release_all(app: Celery) -> tuple[int, list[dict[str, Any] | None]]:
    store = get_store(app)
    releaser = DirectReleaser(app, store)
    released, events = 0, []
    try:
        for shard in range(store.config.shards):
            batch = releaser.release(shard, "", "", 1000)
            released += batch.count
            events += batch.events
    finally:
        releaser.close()
    return released, events


def _conf(uid: str, **extra: Any) -> dict[str, Any]:
    """Settings shared by the test's app and the worker (JSON: queues as dicts)."""
    return {
        "task_queues": {
            f"q{uid}": {},
            f"other{uid}": {},
            f"bound{uid}": {"exchange": f"ex{uid}", "exchange_type": "direct", "routing_key": "rk.custom"},
        },
        **extra,
    }


#: The pool of the worker whose task events are checked: Celery 5.6's threads pool drops some of its
#: buffered task events (celery/celery#10434, fixed in 5.7), whatever sent the task.
EVENTS_POOL = "threads" if celery.VERSION[:2] >= (5, 7) else "prefork"


class EventLog:
    """Captures the app's events with a real ``app.events.Receiver`` in a thread."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self.conn = app.connection_for_read()
        self.recv = app.events.Receiver(self.conn, handlers={"*": self.events.append})
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        # Events travel by Redis pub/sub: wait until our subscription receives one.
        with app.connection_for_write() as conn:
            dispatcher = app.events.Dispatcher(conn, enabled=True)
            wait_for(lambda: dispatcher.send("test-hello") or self.of("test-hello"), 15, interval=0.2,
                     what="the event receiver to subscribe")
            dispatcher.close()

    def _run(self) -> None:
        # The connection is closed under it at the end of the test.
        with contextlib.suppress(Exception):
            self.recv.capture(limit=None, timeout=None, wakeup=False)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e.get("type") == kind]

    def close(self) -> None:
        self.recv.should_stop = True
        self.conn.close()
        self.thread.join(5)


@pytest.fixture
def event_log_factory() -> Iterator[list[EventLog]]:
    logs: list[EventLog] = []
    yield logs
    for log in logs:
        log.close()


@pytest.mark.timeout(120)
def test_priorities_queues_routing_keys_serializers_and_sent_events(
    redis_url: str, uid: str, workers: list[Any], rclient: redis.Redis, event_log_factory: list[EventLog],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("C_FORCE_ROOT", "1")  # a worker accepting pickle refuses to run as root otherwise
    conf = _conf(uid, task_send_sent_event=True, accept_content=["json", "pickle"])
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    assert get_store(app).broker.direct
    log = EventLog(app)
    event_log_factory.append(log)
    # The worker declares its queues at start; declare the bound one now, as it will.
    with Connection(redis_url) as conn:
        Queue(f"bound{uid}", Exchange(f"ex{uid}", type="direct"), routing_key="rk.custom",
              channel=conn.default_channel).declare()

    by_priority = {p: apply_later(app, "e2e.plain", args=(p,), when=0, priority=p, strict=False).id
                   for p in range(10)}
    other = apply_later(app, "e2e.plain", args=("other",), when=0, queue=f"other{uid}", strict=False).id
    routed = apply_later(app, "e2e.plain", args=("rk",), when=0, exchange=f"ex{uid}",
                         routing_key="rk.custom", strict=False).id
    pickled = apply_later(app, "e2e.plain", args=({1, 2},), when=0, serializer="pickle", strict=False).id
    packed = apply_later(app, "e2e.plain", args=("z" * 2000,), when=0, compression="gzip", strict=False).id
    later = apply_later(app, "e2e.plain", when=3600, strict=False).id
    ids = [*by_priority.values(), other, routed, pickled, packed]

    released, events = _release_all(app)
    assert released == len(ids)
    assert get_store(app).lookup.get(later)["st"] == "SCHEDULED"

    # Where kombu's consumer will look for them.
    lists = collections.Counter()
    for p in range(10):
        lists[queue + (SEP + STEP[p] if STEP[p] else "")] += 1
    lists[queue] += 2  # pickled, packed
    for key, n in lists.items():
        assert rclient.llen(key) == n, key
    assert rclient.llen(f"other{uid}") == 1
    assert rclient.llen(f"bound{uid}") == 1
    assert not rclient.exists("ae.undeliver") or routed not in str(rclient.lrange("ae.undeliver", 0, -1))

    # task-sent events: returned by the release, and really sent on the broker.
    assert sorted(e["uuid"] for e in events if e) == sorted(ids)
    wait_for(lambda: {e["uuid"] for e in log.of("task-sent")} >= set(ids), 15, what="task-sent events")
    sent = {e["uuid"]: e for e in log.of("task-sent")}
    assert sent[other]["queue"] == f"other{uid}"
    assert (sent[routed]["exchange"], sent[routed]["routing_key"]) == (f"ex{uid}", "rk.custom")
    assert sent[by_priority[7]]["name"] == "e2e.plain"

    w = WorkerProcess(redis_url, prefix, queue, conf=conf, pool=EVENTS_POOL, concurrency=2,
                      queues=[queue, f"other{uid}", f"bound{uid}"], extra=["-E"])
    workers.append(w)
    w.wait_ready()
    wait_for(lambda: set(ran(rclient, prefix)) >= set(ids), 60, what=f"runs, worker log: {w.output()[-2000:]}")
    # The worker saw them as ordinary Celery tasks (what Flower shows).
    wait_for(lambda: {e["uuid"] for e in log.of("task-succeeded")} >= set(ids), 15, what="task-succeeded events")
    # Stopped, the worker gives back what it held: nothing is left to deliver, so the counts are final.
    w.stop()
    all_lists = [*lists, f"other{uid}", f"bound{uid}"]
    assert undelivered(rclient, ids, all_lists) == []
    counts = collections.Counter(ran(rclient, prefix))
    assert set(counts) == set(ids) and max(counts.values()) == 1
    for key in lists:
        assert rclient.llen(key) == 0
    deliveries = received(w.output(), "e2e.plain")
    assert set(deliveries) == set(ids) and max(deliveries.values()) == 1


@pytest.mark.timeout(120)
def test_global_keyprefix_and_buckets(redis_url: str, uid: str, workers: list[Any], rclient: redis.Redis) -> None:
    gkp = f"g{uid}_"
    conf = _conf(uid, broker_transport_options={"global_keyprefix": gkp}, delayed_bucket_ms=60_000)
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    with Connection(redis_url, transport_options={"global_keyprefix": gkp}) as conn:
        Queue(f"bound{uid}", Exchange(f"ex{uid}", type="direct"), routing_key="rk.custom",
              channel=conn.default_channel).declare()
    ids = [apply_later(app, "e2e.plain", args=(p,), when=0, priority=p, strict=False).id for p in (0, 4, 9)]
    ids.append(apply_later(app, "e2e.plain", when=0, queue=f"other{uid}", strict=False).id)
    ids.append(apply_later(app, "e2e.plain", when=0, exchange=f"ex{uid}", routing_key="rk.custom",
                           strict=False).id)
    assert _release_all(app)[0] == len(ids)
    for key in (f"{gkp}{queue}", f"{gkp}{queue}{SEP}3", f"{gkp}{queue}{SEP}9", f"{gkp}other{uid}",
                f"{gkp}bound{uid}"):
        assert rclient.llen(key) == 1, key
    assert rclient.llen(queue) == 0

    w = WorkerProcess(redis_url, prefix, queue, conf=conf, pool="threads", concurrency=2,
                      queues=[queue, f"other{uid}", f"bound{uid}"])
    workers.append(w)
    w.wait_ready()
    wait_for(lambda: set(ran(rclient, prefix)) >= set(ids), 60, what=f"runs, worker log: {w.output()[-2000:]}")
    # A job released while the worker runs is picked up as well.
    late = apply_later(app, "e2e.plain", when=0, priority=6, strict=False).id
    assert _release_all(app)[0] == 1
    wait_for(lambda: late in ran(rclient, prefix), 30, what="the late job to run")
    w.stop()
    keys = [f"{gkp}{queue}", *(f"{gkp}{queue}{SEP}{step}" for step in (3, 6, 9)), f"{gkp}other{uid}",
            f"{gkp}bound{uid}"]
    assert undelivered(rclient, [*ids, late], keys, unacked=f"{gkp}unacked") == []
    counts = collections.Counter(ran(rclient, prefix))
    assert set(counts) == {*ids, late} and max(counts.values()) == 1
    deliveries = received(w.output(), "e2e.plain")
    assert set(deliveries) == {*ids, late} and max(deliveries.values()) == 1
