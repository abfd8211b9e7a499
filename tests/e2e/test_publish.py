"""The publish path: claim, publish with kombu, acknowledge (RabbitMQ; a separate Redis broker).

The promise here is at-least-once enqueue: a job may be published more than
once (its ``claims`` count says how often), and the worker side drops the
copies. So the tests count both: every publish reached a worker once (its
"received" lines equal the job's claims) and every job's body ran once.
"""

from __future__ import annotations

import collections
import logging
import signal
import socket
import sys
import time

import pytest
import redis
from kombu import Connection, Exchange, Queue
from support import Proc, SchedulerProcess, WorkerProcess, app_env, free_port, make_app, ran, wait_for
from support.delivery import claims, pending, queue_keys, received, undelivered

from celery_delayed import apply_later, apply_later_many, get_store
from celery_delayed.scheduler import PublishReleaser
from celery_delayed.scheduler.confirms import ConfirmTimeout

pytestmark = pytest.mark.e2e

SHARDS = 16

# A scheduler whose PublishReleaser SIGKILLs its own process after publishing its
# first batch and before acknowledging it: the claims stay in flight.
DIE_BEFORE_ACK = """
import os, signal
import e2e_app
from celery_delayed.scheduler import Scheduler

sched = Scheduler(e2e_app.app)
sched.releaser.before_ack = lambda batch: os.kill(os.getpid(), signal.SIGKILL)
sched.run()
"""


def inflight(client: redis.Redis, prefix: str) -> int:
    return sum(int(client.zcard(f"{prefix}:{{{s}}}:inflight")) for s in range(SHARDS))


def schedule(app, n: int, when) -> list[str]:
    calls = [{"args": (i,), "when": when(i)} for i in range(n)]
    return [h.id for h in apply_later_many(app, "e2e.mark", calls, strict=False)]


def wait_all_ran(app, client: redis.Redis, worker: WorkerProcess, ids: list[str],
                 timeout: float = 60) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """Wait until every job ran and every publish reached the worker, then stop the worker.

    Nothing is left to arrive after that: nothing is scheduled or claimed, and each
    job was received as many times as it was claimed (published). Returns the runs,
    the deliveries and the claims per job.
    """
    prefix = app.conf.delayed_key_prefix

    def settled() -> bool:
        if not set(ran(client, prefix)) >= set(ids) or pending(app):
            return False
        got, want = received(worker.output(), "e2e.mark"), claims(app, ids)
        return all(got[i] >= want[i] for i in ids)

    wait_for(settled, timeout, interval=0.2, what=f"{len(ids)} jobs to run and every publish to arrive")
    worker.stop()
    return collections.Counter(ran(client, prefix)), received(worker.output(), "e2e.mark"), claims(app, ids)


def rabbit_ready(rabbitmq_url: str, queue: str) -> int:
    """Messages ready on a RabbitMQ queue (a stopped worker's unacked ones are back there)."""
    with Connection(rabbitmq_url) as conn:
        return int(conn.default_channel.queue_declare(queue=queue, passive=True).message_count)


def rabbit_ids(rabbitmq_url: str, queue: str) -> collections.Counter:
    """Take every message off a RabbitMQ queue; count them per task id."""
    out: collections.Counter = collections.Counter()
    with Connection(rabbitmq_url) as conn, conn.SimpleQueue(queue) as q:
        while True:
            try:
                msg = q.get(timeout=1)
            except q.Empty:
                return out
            out[msg.headers["id"]] += 1
            msg.ack()


@pytest.mark.timeout(60)
def test_publish_releaser_publishes_with_confirms_to_rabbitmq(redis_url, rabbitmq_url, uid, rabbit_queue):
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, delayed_shards=SHARDS)
    store = get_store(app)
    assert not store.broker.direct, "RabbitMQ broker: auto must pick the publish path"
    h = apply_later(app, "e2e.mark", args=(7,), strict=False)
    releaser = PublishReleaser(app, store)
    try:
        batch = releaser.release(h.shard, "", "", 10)
        assert batch.ids == [h.id]
        assert releaser.confirms, "publisher confirms are off"
        assert releaser.confirmed == 1, "the broker's confirm was not received"
    finally:
        releaser.close()
    assert store.lookup.get(h.id)["st"] == "QUEUED"
    assert inflight(store.redis.client, app.conf.delayed_key_prefix) == 0
    with Connection(rabbitmq_url) as conn, conn.SimpleQueue(rabbit_queue) as q:
        msg = q.get(timeout=5)
        assert msg.headers["id"] == h.id and msg.headers["task"] == "e2e.mark"
        assert msg.headers["delayed_shard"] == h.shard
        msg.ack()


@pytest.mark.timeout(60)
def test_nacked_messages_are_put_back_at_once(redis_url, rabbitmq_url, uid, rabbit_queue):
    """RabbitMQ nacks publishes to a full queue (reject-publish): only the confirmed claims are acknowledged;
    the nacked ones go back to the due set at once (they stayed claimed for a whole claim lease before)."""
    full = Queue(rabbit_queue, Exchange(rabbit_queue), routing_key=rabbit_queue,
                 queue_arguments={"x-max-length": 3, "x-overflow": "reject-publish"})
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, delayed_shards=1, task_queues=[full])
    store = get_store(app)
    ids = schedule(app, 5, lambda i: 0)
    releaser = PublishReleaser(app, store)
    try:
        batch = releaser.release(0, "", "", 10)
    finally:
        releaser.close()
    assert sorted(batch.ids) == sorted(ids)
    assert (releaser.confirmed, releaser.refused) == (3, 2)
    states = collections.Counter(store.lookup.get(j)["st"] for j in ids)
    # The nacked ones are put back at once (not held until their claim lease passes), and a nack does not
    # count toward dead-lettering: the queue may have room later.
    assert states == {"QUEUED": 3, "SCHEDULED": 2}
    assert inflight(store.redis.client, app.conf.delayed_key_prefix) == 0
    assert all("refused" not in store.lookup.get(j) for j in ids)


@pytest.mark.timeout(150)
def test_publish_path_rabbitmq_end_to_end(redis_url, rabbitmq_url, uid, workers, rclient, rabbit_queue):
    """Every job runs once; SIGTERM mid-stream strands no claimed job."""
    conf = {"delayed_shards": SHARDS, "delayed_lease_ms": 2000}
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, **conf)
    prefix = app.conf.delayed_key_prefix
    assert not get_store(app).broker.direct
    w = WorkerProcess(rabbitmq_url, prefix, rabbit_queue, store=redis_url, conf=conf,
                      concurrency=4, pool="threads")
    workers.append(w)
    s1 = SchedulerProcess(rabbitmq_url, prefix, rabbit_queue, store=redis_url, conf=conf)
    workers.append(s1)
    w.wait_ready()
    # due over 3 s after the look-ahead window: SIGTERM comes when some are out, some not
    la = get_store(app).config.lookahead_ms / 1000
    ids = schedule(app, 600, lambda i: la + 3.0 * i / 600)
    time.sleep(1.5)
    s1.proc.send_signal(signal.SIGTERM)
    s1.proc.wait(10)
    assert s1.proc.returncode == 0, s1.output()[-3000:]
    assert inflight(rclient, prefix) == 0, "a stopped scheduler left claims in flight"
    released_before = sum(1 for j in ids if get_store(app).lookup.get(j)["st"] != "SCHEDULED")
    assert 0 < released_before < len(ids), s1.output()[-3000:]
    s2 = SchedulerProcess(rabbitmq_url, prefix, rabbit_queue, store=redis_url, conf=conf)
    workers.append(s2)
    counts, deliveries, published = wait_all_ran(app, rclient, w, ids)
    print(f"\nRabbitMQ publish path: {len(ids)} jobs, {released_before} released before SIGTERM, "
          f"duplicates {sum(v - 1 for v in counts.values())}, published {sum(published.values())}, "
          f"delivered {sum(deliveries.values())}")
    assert set(counts) == set(ids)
    assert max(counts.values()) == 1
    assert inflight(rclient, prefix) == 0
    assert deliveries == published, "a publish did not reach the worker exactly once"
    assert rabbit_ready(rabbitmq_url, rabbit_queue) == 0, "messages left on the queue"


@pytest.mark.timeout(150)
def test_publish_path_scheduler_killed_between_publish_and_ack(
    redis_url, rabbitmq_url, uid, workers, rclient, rabbit_queue
):
    """The claim lease expires, another scheduler claims and publishes again: nothing is lost."""
    conf = {"delayed_shards": SHARDS, "delayed_lease_ms": 2000, "delayed_claim_lease_ms": 1000}
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, **conf)
    prefix = app.conf.delayed_key_prefix
    ids = schedule(app, 64, lambda i: 0.5)
    doomed = Proc([sys.executable, "-c", DIE_BEFORE_ACK], app_env(rabbitmq_url, prefix, rabbit_queue, redis_url, conf))
    workers.append(doomed)  # type: ignore[arg-type]
    doomed.proc.wait(30)
    assert doomed.proc.returncode == -signal.SIGKILL, doomed.output()[-3000:]
    stranded = inflight(rclient, prefix)
    assert stranded > 0, "the killed scheduler left nothing in flight"
    killed_at = time.monotonic()

    # The worker starts after the re-claim, so that the stale claims are still
    # CLAIMED (not yet run from the first publish) and must be published again.
    workers.append(SchedulerProcess(rabbitmq_url, prefix, rabbit_queue, store=redis_url, conf=conf))
    wait_for(lambda: inflight(rclient, prefix) == 0, 30, interval=0.05, what="the stale claims to be re-published")
    recovered = time.monotonic() - killed_at
    w = WorkerProcess(rabbitmq_url, prefix, rabbit_queue, store=redis_url, conf=conf, concurrency=4, pool="threads")
    workers.append(w)
    counts, deliveries, published = wait_all_ran(app, rclient, w, ids)
    store = get_store(app)
    twice = [j for j in ids if int(store.lookup.get(j).get("claims", 0)) > 1]
    print(f"\nkilled between publish and ack: {stranded} claims stranded, re-published "
          f"{recovered:.2f}s after the kill; {len(ids)} jobs, 0 lost, "
          f"{sum(v - 1 for v in counts.values())} duplicate runs, "
          f"{sum(1 for v in deliveries.values() if v > 1)} delivered twice")
    assert set(counts) == set(ids), "jobs lost"
    assert len(twice) == stranded
    assert not [j for j in ids if store.lookup.get(j)["st"] in ("SCHEDULED", "CLAIMED")]
    # At-least-once enqueue: each stranded job reached the worker twice (both publishes)...
    assert deliveries == published
    assert {j for j, n in deliveries.items() if n == 2} == set(twice) and max(deliveries.values()) == 2
    # ... and the worker side dropped the copy: every body ran once.
    assert max(counts.values()) == 1, "a copy of a job ran again"
    assert rabbit_ready(rabbitmq_url, rabbit_queue) == 0, "messages left on the queue"


@pytest.mark.timeout(120)
def test_publish_path_with_a_separate_redis_broker(redis_url, uid, workers, rclient):
    """Store on db 0, broker on db 1 of the private server: auto picks the publish path."""
    broker = redis_url.rsplit("/", 1)[0] + "/1"
    conf = {"delayed_shards": SHARDS}
    app = make_app(broker, uid, delayed_redis_url=redis_url, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    assert not get_store(app).broker.direct
    w = WorkerProcess(broker, prefix, queue, store=redis_url, conf=conf, concurrency=4, pool="threads")
    workers.append(w)
    workers.append(SchedulerProcess(broker, prefix, queue, store=redis_url, conf=conf))
    ids = schedule(app, 300, lambda i: 2.0 * i / 300)
    counts, deliveries, published = wait_all_ran(app, rclient, w, ids)
    assert set(counts) == set(ids) and max(counts.values()) == 1
    assert inflight(rclient, prefix) == 0
    assert rclient.llen(queue) == 0, "nothing may go to the store's database"
    assert deliveries == published
    with redis.Redis.from_url(broker, decode_responses=True) as bclient:
        assert undelivered(bclient, ids, queue_keys(queue)) == [], "messages left on the broker"


@pytest.mark.timeout(90)
def test_broker_down_keeps_the_claims_and_stops_promptly(redis_url, rabbitmq_url, uid, workers, rclient,
                                                         rabbit_queue):
    """RabbitMQ unreachable: the scheduler logs and backs off without claiming anything, SIGTERM still
    stops it at once, and the next scheduler publishes every job."""
    conf = {"delayed_shards": SHARDS, "delayed_claim_lease_ms": 1000}
    down = f"amqp://guest:guest@127.0.0.1:{free_port()}//"
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, **conf)
    prefix = app.conf.delayed_key_prefix
    ids = schedule(app, 20, lambda i: 0)
    s1 = SchedulerProcess(down, prefix, rabbit_queue, store=redis_url, conf=conf)
    workers.append(s1)
    wait_for(lambda: s1.output().count("unavailable") >= 2, 30, what="the scheduler to report the broker down")
    assert s1.proc.poll() is None
    t0 = time.monotonic()
    s1.proc.send_signal(signal.SIGTERM)
    s1.proc.wait(10)
    stopped = time.monotonic() - t0
    assert s1.proc.returncode == 0 and stopped < 3.0, (stopped, s1.output()[-3000:])
    states = collections.Counter(get_store(app).lookup.get(j)["st"] for j in ids)
    assert states == {"SCHEDULED": len(ids)}, "jobs were claimed although the broker was down"

    workers.append(SchedulerProcess(rabbitmq_url, prefix, rabbit_queue, store=redis_url, conf=conf))
    wait_for(lambda: inflight(rclient, prefix) == 0 and all(
        get_store(app).lookup.get(j)["st"] == "QUEUED" for j in ids), 30, what="the claims to be published")
    with Connection(rabbitmq_url) as conn, conn.SimpleQueue(rabbit_queue) as q:
        got = set()
        while len(got) < len(ids):
            msg = q.get(timeout=5)
            got.add(msg.headers["id"])
            msg.ack()
    assert got == set(ids)
    print(f"\nbroker down: SIGTERM honoured in {stopped * 1000:.0f} ms; {len(ids)} jobs published after")


@pytest.mark.timeout(90)
def test_a_message_the_broker_refuses_is_put_back_at_once_then_dead_lettered(redis_url, rabbitmq_url, uid,
                                                                           rabbit_queue, rclient):
    """No such exchange: the broker closes the channel. The rest of the batch still goes out at once; the bad job
    is retried a little later each time, then dead-lettered with the broker's reason (not every claim lease)."""
    conf = {"delayed_shards": 1, "delayed_claim_lease_ms": 60_000, "delayed_publish_max_refusals": 3}
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, result_backend=redis_url, **conf)
    store = get_store(app)
    good = [apply_later(app, "e2e.mark", args=(i,), strict=False) for i in range(3)]
    bad = apply_later(app, "e2e.mark", args=("bad",), exchange=f"no-such-exchange-{uid}", routing_key="rk",
                      strict=False)
    good += [apply_later(app, "e2e.mark", args=(i,), strict=False) for i in range(3, 6)]
    releaser = PublishReleaser(app, store)
    try:
        t0 = time.monotonic()
        batch = releaser.release(0, "", "", 100)
        assert len(batch.ids) == 7
        assert all(store.lookup.get(h.id)["st"] == "QUEUED" for h in good)  # the batch was not held up
        rec = store.lookup.get(bad.id)
        assert (rec["st"], rec["refused"]) == ("SCHEDULED", "1") and "NOT_FOUND" in rec["reason"]
        assert inflight(store.redis.client, app.conf.delayed_key_prefix) == 0
        deadline = time.monotonic() + 30
        while store.lookup.get(bad.id)["st"] != "DEAD" and time.monotonic() < deadline:
            releaser.release(0, "", "", 100)  # as the scheduler would, when the job is due again
            time.sleep(0.1)
        rec = store.lookup.get(bad.id)
        assert (rec["st"], rec["refused"]) == ("DEAD", "3"), rec
        assert time.monotonic() - t0 < 15  # 1 s + 2 s of back-off, not two 60 s claim leases
        assert "no exchange" in rec["emsg"] and rec["etype"] == "Unpublishable"
        assert bad.id in rclient.zrange(store.keys.shard(0).dlq, 0, -1)
        assert releaser.refused == 3
    finally:
        releaser.close()
    from celery_delayed.errors import Unpublishable

    with pytest.raises(Unpublishable, match="no exchange"):
        bad.get(timeout=5)
    got: list[str] = []
    with Connection(rabbitmq_url) as conn, conn.SimpleQueue(rabbit_queue) as q:
        while True:
            try:
                got.append(q.get(timeout=2).headers["id"])
            except q.Empty:
                break
    # Each good job went out (those published before the channel closed may go out twice: at-least-once,
    # the worker side drops the copy); the refused one never did.
    assert set(got) == {h.id for h in good} and len(got) <= 2 * len(good)


@pytest.mark.timeout(60)
def test_publish_releaser_reconnects_and_publishes_the_batch_again(redis_url, rabbitmq_url, uid, rabbit_queue,
                                                                caplog):
    """The broker connection breaks under the releaser: the batch is published again on a new one."""
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, delayed_shards=1)
    store = get_store(app)
    first = apply_later(app, "e2e.mark", args=(1,), strict=False)
    releaser = PublishReleaser(app, store)
    try:
        assert releaser.release(0, "", "", 10).ids == [first.id]
        broken = releaser._conn.connection.sock  # the releaser's socket to RabbitMQ
        broken.shutdown(socket.SHUT_RDWR)  # as a RabbitMQ restart or a dropped NAT entry would
        second = apply_later(app, "e2e.mark", args=(2,), strict=False)
        with caplog.at_level(logging.WARNING, logger="celery_delayed.scheduler"):
            batch = releaser.release(0, "", "", 10)
        assert batch.ids == [second.id]
        assert "reconnecting to publish it again" in caplog.text
        assert releaser._conn.connection.sock is not broken
        assert releaser.confirmed == 2, "the second batch was not confirmed on the new connection"
    finally:
        releaser.close()
    assert store.lookup.get(second.id)["st"] == "QUEUED"
    assert inflight(store.redis.client, app.conf.delayed_key_prefix) == 0
    got = rabbit_ids(rabbitmq_url, rabbit_queue)
    assert set(got) == {first.id, second.id} and got[first.id] == 1


@pytest.mark.timeout(60)
def test_unconfirmed_batch_stays_claimed_and_is_published_again(redis_url, rabbitmq_url, uid, rabbit_queue):
    """Confirms that do not arrive in time: the claims are not acknowledged; once their lease
    passes they are claimed and published again (at-least-once: the broker has every copy)."""
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, delayed_shards=1,
                   delayed_claim_lease_ms=1000)
    store = get_store(app)
    h = apply_later(app, "e2e.mark", strict=False)
    releaser = PublishReleaser(app, store)
    try:
        releaser._confirm_timeout_s = 0.0  # test hook: no confirm can arrive in time
        with pytest.raises(ConfirmTimeout):
            releaser.release(0, "", "", 10)
        assert store.lookup.get(h.id)["st"] == "CLAIMED"
        assert inflight(store.redis.client, app.conf.delayed_key_prefix) == 1
        releaser._confirm_timeout_s = 5.0
        assert releaser.release(0, "", "", 10).ids == [], "claimed again before its claim lease passed"
        wait_for(lambda: releaser.release(0, "", "", 10).ids == [h.id], 10, interval=0.1,
                 what="the claim to be published again after its lease")
        assert releaser.confirmed == 1
    finally:
        releaser.close()
    assert store.lookup.get(h.id)["st"] == "QUEUED" and store.lookup.get(h.id)["claims"] == "2"
    assert inflight(store.redis.client, app.conf.delayed_key_prefix) == 0
    got = rabbit_ids(rabbitmq_url, rabbit_queue)
    assert set(got) == {h.id} and got[h.id] >= 2, got


@pytest.mark.timeout(60)
def test_confirm_publish_false_publishes_without_confirms(redis_url, rabbitmq_url, uid, rabbit_queue):
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, delayed_shards=1,
                   broker_transport_options={"confirm_publish": False})
    store = get_store(app)
    ids = schedule(app, 3, lambda i: 0)
    releaser = PublishReleaser(app, store)
    try:
        assert sorted(releaser.release(0, "", "", 10).ids) == sorted(ids)
        assert not releaser.confirms, "publisher confirms are on although confirm_publish is False"
        assert (releaser.confirmed, releaser.refused) == (0, 0)
    finally:
        releaser.close()
    assert {store.lookup.get(j)["st"] for j in ids} == {"QUEUED"}
    assert inflight(store.redis.client, app.conf.delayed_key_prefix) == 0
    assert rabbit_ids(rabbitmq_url, rabbit_queue) == collections.Counter({j: 1 for j in ids})
