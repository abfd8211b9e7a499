"""Scenario 22: the publish path against a bare kombu loop, on RabbitMQ.

N jobs (20,000 by default; ``BENCH_PUBLISH_N`` to change), all due, released
onto one durable RabbitMQ queue in three ways, taking turns over a few rounds
(the order rotated each round):

- ``celery delayed run``, one process, publish path (claim a batch, publish
  it with kombu, wait for the broker's confirms once per batch, ack the
  claims): the figure of this design;
- the reference: a bare kombu ``Producer.publish`` loop of the same message
  bodies, headers and properties, on a channel in confirm mode
  (``confirm_select``, py-amqp's ``basic_ack`` events), waiting for the
  confirms once per batch of the scheduler's batch size: the floor of a
  publisher that knows the broker took each message;
- Celery's own ``apply_async`` loop of the same task and arguments, as
  Celery sends it by default (no publisher confirms), and with kombu's
  ``confirm_publish`` transport option (a confirm waited for per message),
  on fewer jobs as it is slower.

Each rate runs from the first message to the last one counted in the queue
(``queue.declare`` passive), so all are held to the same end: the broker has
the message. Needs RabbitMQ on 127.0.0.1:5672 (guest/guest) or
``BENCH_AMQP_URL``; skipped with a note when it is not there.
"""

from __future__ import annotations

import base64
import json
import os
import statistics
import time
from typing import Any

from kombu import Connection, Exchange, Producer, Queue

from celery_delayed.store import get_store

from .celery_app import make_app
from .common import Ctx, delayed_scheduler, delete_prefix, procs, uid, wait_for
from .s_release import _PAD, _fill

S22 = "22 publish path vs bare kombu (RabbitMQ)"
SCHEDULER = "celery-delayed scheduler (publish path)"
BARE = "bare kombu Producer.publish, confirms per batch"
CELERY = "Celery apply_async (no confirms, Celery's default)"
CELERY_CONFIRM = "Celery apply_async, confirm_publish (per message)"
BATCH = 500  # the scheduler's default delayed_batch_size: the bare loop confirms as often


def _amqp_url() -> str:
    return os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _count(conn: Connection, queue: str) -> int:
    """Messages in the queue, as the broker counts them."""
    return int(conn.default_channel.queue_declare(queue=queue, passive=True).message_count)


def _until_all(conn: Connection, queue: str, n: int, timeout_s: float) -> float | None:
    """Wait until the queue holds n messages; the perf_counter time it did, or None."""
    ok = wait_for(lambda: _count(conn, queue) >= n, timeout_s, interval=0.01)
    return time.perf_counter() if ok else None


def _declare(conn: Connection, queue: str) -> Queue:
    """The queue as Celery declares a default queue: durable, on a direct exchange of its name."""
    q = Queue(queue, Exchange(queue, "direct", durable=True), routing_key=queue, durable=True)
    q(conn.default_channel).declare()
    return q


def _drop(conn: Connection, queue: str) -> None:
    ch = conn.default_channel
    ch.queue_delete(queue)
    ch.exchange_delete(queue)


def _envelopes(ctx: Ctx, amqp: str, u: str) -> list[tuple[bytes, dict[str, Any], dict[str, Any]]]:
    """(body, headers, properties) of BATCH messages as the scheduler publishes them (one per job id)."""
    prefix, queue = f"b22t{u}", f"q22t{u}"
    app = make_app(amqp, prefix, queue, delayed_redis_url=ctx.redis_url)
    store = get_store(app)
    now_ms = store.redis.now_ms()
    _fill(store, app, BATCH, u, lambda i: str(now_ms + 3_600_000))
    ids = [f"{u}-{i}" for i in range(BATCH)]
    out = []
    for text in store.lookup.messages([(store.layout.shard_of(j), j) for j in ids]):
        env = json.loads(text or "{}")
        props = dict(env["properties"])
        body = base64.b64decode(env["body"]) if props.pop("body_encoding", None) == "base64" else env["body"]
        for name in ("delivery_info", "delivery_tag"):
            props.pop(name, None)
        props.update(content_type=env["content-type"], content_encoding=env["content-encoding"])
        out.append((body if isinstance(body, bytes) else str(body).encode(), env["headers"], props))
    delete_prefix(ctx.client(), f"{prefix}:*")
    return out


def _scheduler(ctx: Ctx, amqp: str, n: int, watch: Connection) -> float | None:
    u = uid()
    prefix, queue = f"b22{u}", f"q22{u}"
    conf = {"delayed_redis_url": ctx.redis_url}
    app = make_app(amqp, prefix, queue, **conf)
    store = get_store(app)
    _declare(watch, queue)
    now_ms = store.redis.now_ms()
    _fill(store, app, n, u, lambda i: str(now_ms - 1000))
    try:
        with procs() as ps:
            ps.append(delayed_scheduler(amqp, prefix, queue, conf=conf))
            seen = wait_for(lambda: _count(watch, queue), 120, interval=0.002)
            t0 = time.perf_counter()
            first = int(seen or 0)
            t1 = _until_all(watch, queue, n, 300)
    finally:
        delete_prefix(ctx.client(), f"{prefix}:*")
        _drop(watch, queue)
    if t1 is None or first >= n:
        return None
    return (n - first) / (t1 - t0)


def _bare(amqp: str, n: int, envs: list[tuple[bytes, dict[str, Any], dict[str, Any]]],
          watch: Connection) -> float | None:
    u = uid()
    queue = f"q22b{u}"
    q = _declare(watch, queue)
    # py-amqp's own confirm_publish would wait after every message; off, and
    # the channel put in confirm mode by hand, the acks are collected per batch.
    with Connection(amqp, transport_options={"confirm_publish": False}) as conn:
        channel = conn.channel()
        channel.confirm_select()
        pending: dict[int, None] = {}  # delivery tags not yet confirmed, in publish order
        nacked = 0

        def settle(tag: int, multiple: bool) -> None:
            if not multiple:
                pending.pop(tag, None)
                return
            for t in list(pending):
                if t > tag:
                    break
                del pending[t]

        def on_nack(tag: int, multiple: bool) -> None:
            nonlocal nacked
            nacked += 1
            settle(tag, multiple)

        channel.events["basic_ack"].add(settle)
        channel.events["basic_nack"].add(on_nack)
        producer = Producer(channel, exchange=q.exchange, routing_key=queue, auto_declare=False)
        seq = 0
        try:
            t0 = time.perf_counter()
            for start in range(0, n, BATCH):
                for i in range(start, min(n, start + BATCH)):
                    body, headers, props = envs[i % len(envs)]
                    producer.publish(body, headers=headers, retry=False, **props)
                    seq += 1
                    pending[seq] = None
                while pending:
                    conn.drain_events(timeout=30)
            t1 = _until_all(watch, queue, n, 60)
        finally:
            _drop(watch, queue)
    if t1 is None or nacked:
        return None
    return n / (t1 - t0)


def _celery(amqp: str, n: int, watch: Connection, confirm: bool) -> float | None:
    u = uid()
    prefix, queue = f"b22c{u}", f"q22c{u}"
    conf: dict[str, Any] = {"broker_transport_options": {"confirm_publish": True}} if confirm else {}
    app = make_app(amqp, prefix, queue, **conf)
    _declare(watch, queue)
    task = app.tasks["bench.late_d"]
    with app.producer_pool.acquire(block=True) as producer:  # connected before the clock starts
        producer.connection.ensure_connection(max_retries=1)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            task.apply_async(args=(0.0,), kwargs={"pad": _PAD})
        t1 = _until_all(watch, queue, n, 60)
    finally:
        _drop(watch, queue)
        app.close()
    return None if t1 is None else n / (t1 - t0)


def publish(ctx: Ctx) -> None:
    # 20,000 keeps three rounds of the four under about two minutes on 2 quiet cores
    # (BENCH_PUBLISH_N=30000 for more); confirm_publish waits per message: a tenth of that.
    n = ctx.size(int(os.environ.get("BENCH_PUBLISH_N", "20000")), 3_000)
    n_confirm = max(1, n // 10)
    rounds = ctx.size(3, 1)
    amqp = _amqp_url()
    print(f"[{S22}] {n} due jobs onto RabbitMQ, {rounds} rounds: the scheduler, a bare kombu loop, apply_async",
          flush=True)
    try:
        watch = Connection(amqp, connect_timeout=3)
        watch.ensure_connection(max_retries=1)
    except Exception as exc:
        ctx.notes.append(f"scenario 22 skipped: RabbitMQ not reachable at {amqp.split('@')[-1]} ({exc})"[:300])
        return
    with watch:
        envs = _envelopes(ctx, amqp, uid())
        runners = {
            SCHEDULER: lambda: _scheduler(ctx, amqp, n, watch),
            BARE: lambda: _bare(amqp, n, envs, watch),
            CELERY: lambda: _celery(amqp, n, watch, confirm=False),
            CELERY_CONFIRM: lambda: _celery(amqp, n_confirm, watch, confirm=True),
        }
        names = list(runners)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                rate = runners[name]()
                print(f"    round {r + 1}: {name}: {'n/a' if rate is None else f'{rate:,.0f}'} msg/s", flush=True)
                if rate is not None:
                    rates[name].append(rate)
    size = len(envs[0][0])
    for name in names:
        got = rates[name]
        count = n_confirm if name == CELERY_CONFIRM else n
        ctx.add(S22, name, "publish rate", statistics.median(got) if got else None, "msg/s",
                note=f"median of {len(got)} rounds of {count:,} ({', '.join(f'{x:,.0f}' for x in got)})")
    ctx.relate(S22, "publish rate", BARE)
    for name in (SCHEDULER, CELERY):
        # The machine's noise drifts between rounds: each round's own ratio too.
        if len(rates[name]) != len(rates[BARE]) or not rates[name]:
            continue  # a round failed: no pairs to compare
        pairs = [a / b for a, b in zip(rates[name], rates[BARE], strict=True)]
        if pairs:
            ctx.add(S22, name, "publish rate / bare kombu's, same round", statistics.median(pairs), "x",
                    note=f"median of {len(pairs)} rounds ({', '.join(f'{x:.2f}' for x in pairs)})")
    ctx.notes.append(f"scenario 22: {n:,} messages a round (body {size} B, persistent) onto one durable RabbitMQ "
                     f"queue; rates from the first publish (the scheduler: the first message counted in the "
                     f"queue) to the last message counted in the queue; the bare loop confirms every {BATCH} "
                     f"messages, as the scheduler's batch; apply_async with confirm_publish on {n_confirm:,}")
