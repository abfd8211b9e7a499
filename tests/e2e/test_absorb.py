"""``delayed absorb``: a broker's ETA backlog moved into the store, exactly once, through any crash.

Messages are sent the way an app sends them (``send_task`` with a
``countdown``, interception off), on a real Redis broker and on RabbitMQ;
``celery -A e2e_app delayed absorb`` runs as a user runs it, and real
workers and schedulers then run what it moved. Runs are counted by the task
bodies (``support.processes.ran``: id, pid, retries, time).
"""

from __future__ import annotations

import base64
import collections
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime

import pytest
import redis
from kombu import Connection
from support import SchedulerProcess, WorkerProcess, app_env, make_app, ran, run_celery, wait_for
from support.processes import WORKER_APPS

from celery_delayed import get_store

pytestmark = pytest.mark.e2e

TASK = "e2e.plain"


def send(app, n: int, countdown, task: str = TASK, **options) -> dict[str, float]:
    """Send ``n`` messages of ``task``; their ids and due times (epoch s; 0 for no eta)."""
    out = {}
    with app.producer_or_acquire() as producer:
        for i in range(n):
            delay = countdown(i) if callable(countdown) else countdown
            res = app.send_task(task, (i,), countdown=delay, producer=producer, **options)
            out[res.id] = 0.0 if delay is None else time.time() + delay
    return out


def runs(client: redis.Redis, prefix: str) -> dict[str, list[float]]:
    """Run times per task id."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    for x in client.lrange(f"{prefix}:ran", 0, -1):
        tid, _, _, at = str(x).split("|")
        out[tid].append(float(at))
    return out


def absorb(broker: str, prefix: str, queue: str, *args: str, store: str | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_celery(broker, prefix, queue, "delayed", "absorb", "-Q", queue, *args, store=store,
                      timeout=timeout)


def absorb_with_kills(broker: str, prefix: str, queue: str, store: str | None, remaining: Callable[[], int],
                      kills: int, rng: random.Random, stay: int) -> tuple[list[int], str]:
    """Run absorb, SIGKILLed ``kills`` times at a random moment of its work, then to its end.

    ``remaining()``: the messages the broker holds; ``stay`` of them are not to be absorbed.
    Returns how many messages the broker still held at each kill that landed, and the last run's output.
    """
    env = app_env(broker, prefix, queue, store)
    args = [sys.executable, "-m", "celery", "-A", "e2e_app", "delayed", "absorb", "-Q", queue]
    landed: list[int] = []
    for _ in range(2 * kills):
        if len(landed) == kills or remaining() <= stay:
            break
        proc = subprocess.Popen(args, env=env, cwd=str(WORKER_APPS), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        # A random point of the work left: once the broker holds at most `target` messages (between a fifth
        # and four fifths of the way), and a moment more (Redis loses them a batch at a time, so this falls
        # anywhere in a batch's cycle).
        target = stay + int((remaining() - stay) * rng.uniform(0.2, 0.8))
        wait_for(lambda p=proc, n=target: remaining() <= n or p.poll() is not None, 60, interval=0.001,
                 what="absorb to take messages")
        time.sleep(rng.uniform(0, 0.01))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            landed.append(remaining())
        proc.wait(30)
        settle(remaining)  # RabbitMQ puts back what the killed run held (as a user's next run would find)
    done = subprocess.run(args, env=env, cwd=str(WORKER_APPS), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return landed, done.stdout


def settle(count: Callable[[], int], quiet_s: float = 0.5, timeout: float = 30) -> None:
    """Wait until ``count()`` has not changed for ``quiet_s``."""
    deadline = time.monotonic() + timeout
    last, since = count(), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.05)
        now = count()
        if now != last:
            last, since = now, time.monotonic()


def redis_messages(client: redis.Redis, queue: str) -> list[dict]:
    """The messages of a queue's list, in the order a consumer takes them."""
    return [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]


@pytest.mark.timeout(120)
def test_redis_absorbs_future_eta_messages_whole_and_leaves_the_rest_in_place(redis_url, uid, rclient, workers):
    app = make_app(redis_url, uid)
    prefix, queue = f"t{uid}", f"q{uid}"
    later = send(app, 30, lambda i: 8 + i * 0.1, headers={"tenant": "acme"}, stamped_headers=["mark"],
                 mark=["m1"], priority=0)
    now = send(app, 5, None)  # no eta
    soon = send(app, 5, 0.2)  # due before absorb runs: left for a worker
    retried = app.send_task(TASK, (99,), countdown=9, retries=3)
    later[retried.id] = time.time() + 9
    urgent = send(app, 4, 9, priority=5)  # on the queue's priority list
    before = redis_messages(rclient, queue)
    urgent_list = f"{queue}\x06\x163"
    sent = {m["headers"]["id"]: m for m in before + redis_messages(rclient, urgent_list)}
    assert rclient.llen(urgent_list) == 4

    dry = absorb(redis_url, prefix, queue, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would move 35 ETA message(s)" in dry.stdout and "task e2e.plain: 35" in dry.stdout
    assert "left in the broker: 5 (no eta)" in dry.stdout, dry.stdout
    assert redis_messages(rclient, queue) == before  # a dry run changes nothing

    out = absorb(redis_url, prefix, queue, "--min-delay", "1")
    assert out.returncode == 0, out.stderr
    assert "moved 35 ETA message(s) from the Redis broker" in out.stdout, out.stdout
    assert rclient.llen(urgent_list) == 0
    later.update(urgent)
    left = redis_messages(rclient, queue)
    assert left == [m for m in before if m["headers"]["id"] not in later]  # the rest untouched, in order
    assert {m["headers"]["id"] for m in left} == set(now) | set(soon)

    # Each job holds its message: body, headers, stamps and retries as sent, the eta moved to delayed_eta.
    store = get_store(app)
    for tid in later:
        env = json.loads(store.lookup.message(tid, store.lookup.locate(tid)))
        orig = sent[tid]
        assert env["body"] == orig["body"] and env["content-type"] == orig["content-type"]
        assert env["headers"]["eta"] is None
        assert env["headers"]["delayed_eta"] == orig["headers"]["eta"]
        for k in ("task", "id", "retries", "root_id", "argsrepr", "stamps", "stamped_headers", "tenant"):
            assert env["headers"].get(k) == orig["headers"].get(k), k
        assert env["properties"]["priority"] == orig["properties"]["priority"]
        assert env["properties"]["correlation_id"] == orig["properties"]["correlation_id"]
        due = int(store.lookup.get(tid)["due"])
        assert abs(due / 1000 - datetime.fromisoformat(orig["headers"]["eta"]).timestamp()) < 0.002
    assert json.loads(base64.b64decode(sent[retried.id]["body"]))[0] == [99]
    assert sent[retried.id]["headers"]["retries"] == 3
    assert sent[next(iter(set(later) - set(urgent) - {retried.id}))]["headers"]["stamps"] == {"mark": ["m1"]}

    # Run again: nothing more to move, nothing stored twice.
    again = absorb(redis_url, prefix, queue)
    assert again.returncode == 0 and "moved 0 ETA message(s)" in again.stdout, again.stdout

    workers.append(SchedulerProcess(redis_url, prefix, queue))
    w = WorkerProcess(redis_url, prefix, queue)
    workers.append(w)
    w.wait_ready()
    everything = set(later) | set(now) | set(soon)
    wait_for(lambda: set(runs(rclient, prefix)) >= everything, 60, interval=0.2, what="every task to run")
    time.sleep(1.0)
    got = runs(rclient, prefix)
    assert {tid: len(at) for tid, at in got.items() if len(at) != 1} == {}
    early = {tid: later[tid] - got[tid][0] for tid in later if got[tid][0] < later[tid] - 0.05}
    assert early == {}
    assert ran(rclient, prefix).count(retried.id) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task", ["e2e.plain", "e2e.mark"])  # a plain task, a DelayedTask
def test_a_copy_of_an_absorbed_message_that_reaches_a_worker_is_dropped(redis_url, uid, rclient, workers, task):
    """A run stopped between storing a job and removing its message leaves a copy: it never runs twice."""
    app = make_app(redis_url, uid)
    prefix, queue = f"t{uid}", f"q{uid}"
    ids = send(app, 10, 6, task=task)
    raws = rclient.lrange(queue, 0, -1)
    assert absorb(redis_url, prefix, queue).returncode == 0
    assert rclient.llen(queue) == 0
    rclient.lpush(queue, *raws)  # as if absorb had died before taking them from the broker
    workers.append(SchedulerProcess(redis_url, prefix, queue))
    w = WorkerProcess(redis_url, prefix, queue)
    workers.append(w)
    w.wait_ready()
    wait_for(lambda: set(runs(rclient, prefix)) >= set(ids), 60, interval=0.2, what="every task to run")
    wait_for(lambda: w.output().count("the store holds as a job") >= 10, 30, what="the ten copies to be dropped")
    got = runs(rclient, prefix)
    assert sorted(len(got[tid]) for tid in ids) == [1] * 10


@pytest.mark.timeout(60)
def test_limit_and_min_delay_bound_a_run(redis_url, uid, rclient):
    app = make_app(redis_url, uid)
    prefix, queue = f"t{uid}", f"q{uid}"
    near = send(app, 10, 30)
    far = send(app, 20, 600)
    out = absorb(redis_url, prefix, queue, "--min-delay", "120", "--limit", "15")
    assert out.returncode == 0 and "moved 15 ETA message(s)" in out.stdout, out.stdout + out.stderr
    store = get_store(app)
    assert len(store.lookup.locate_many(list(far))) == 15 and not store.lookup.locate_many(list(near))
    rest = absorb(redis_url, prefix, queue, "--min-delay", "120")
    assert "moved 5 ETA message(s)" in rest.stdout and "left in the broker: 10 (due or about to be)" in rest.stdout
    assert rclient.llen(queue) == 10
    bad = absorb(redis_url, prefix, queue, "--limit", "0")
    assert bad.returncode == 2 and "--limit" in bad.stderr
    # Several pages of messages: a dry run reads each once.
    send(app, 1190, 600)
    dry = absorb(redis_url, prefix, queue, "--dry-run")
    assert "would move 1200 ETA message(s)" in dry.stdout and "1200 of 1200 message(s) read" in dry.stdout, dry.stdout


@pytest.mark.timeout(120)
def test_with_a_database_absorbed_jobs_get_their_rows_and_a_second_run_writes_none(redis_url, uid, rclient,
                                                                                    database_url):
    from celery_delayed.sql.rows import get_rows

    prefix, queue = f"t{uid}", f"q{uid}"
    app = make_app(redis_url, uid, delayed_database_url=database_url)
    rows = get_rows(app)
    rows.init_schema()
    ids = send(app, 25, 60)
    raws = rclient.lrange(queue, 0, -1)
    conf = {"delayed_database_url": database_url}
    out = run_celery(redis_url, prefix, queue, "delayed", "absorb", "-Q", queue, conf=conf, timeout=60)
    assert out.returncode == 0 and "moved 25 ETA message(s)" in out.stdout, out.stdout + out.stderr
    assert rows.existing(list(ids)) == set(ids)
    rclient.lpush(queue, *raws)  # as if a run had stopped before taking them from the broker
    again = run_celery(redis_url, prefix, queue, "delayed", "absorb", "-Q", queue, conf=conf, timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "25 of them were stored already" in again.stdout, again.stdout
    assert rclient.llen(queue) == 0
    assert rows.counts().get("SCHEDULED") == 25
    store = get_store(app)
    assert set(store.lookup.locate_many(list(ids))) == set(ids)
    rows.dispose()


@pytest.mark.timeout(150)
def test_redis_absorbs_what_a_killed_worker_left_unacknowledged_never_what_a_live_one_holds(
        redis_url, uid, rclient, workers):
    app = make_app(redis_url, uid)
    prefix, queue = f"t{uid}", f"q{uid}"
    dead = WorkerProcess(redis_url, prefix, queue)
    dead.wait_ready()
    orphans = send(app, 20, 60)
    wait_for(lambda: dead.output().count("received") >= 20, 30, what="the worker to take the ETA messages")
    dead.kill()  # SIGKILL: its messages stay in kombu's unacked hash (until the visibility timeout)
    unacked = [json.loads(v)[0]["headers"]["id"] for v in rclient.hvals("unacked")]
    assert set(orphans) <= set(unacked)

    live = WorkerProcess(redis_url, prefix, queue, extra=["--prefetch-multiplier", "1"])
    workers.append(live)
    live.wait_ready()
    held = send(app, 5, 60)
    wait_for(lambda: sum(live.output().count(f"[{t}] received") for t in held) >= 5, 30,
             what="the live worker to take its ETA messages")

    out = absorb(redis_url, prefix, queue, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "moved 20 ETA message(s)" in out.stdout, out.stdout
    assert "left alone: 5 message(s) held by running workers" in out.stdout, out.stdout
    store = get_store(app)
    assert set(store.lookup.locate_many(list(orphans))) == set(orphans)
    assert not store.lookup.locate_many(list(held))
    still = {json.loads(v)[0]["headers"]["id"] for v in rclient.hvals("unacked")}
    assert still & set(orphans) == set() and set(held) <= still
    assert rclient.zscore("unacked_index", next(iter(orphans))) is None


def rabbit_count(rabbitmq_url: str, queue: str) -> int:
    """How many messages a RabbitMQ queue holds that nobody holds unacknowledged."""
    with Connection(rabbitmq_url) as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True).message_count)


def rabbit_ids(rabbitmq_url: str, queue: str) -> list[str]:
    """The task ids of a RabbitMQ queue's messages, in order (read and given back)."""
    out, held = [], []
    with Connection(rabbitmq_url) as conn:
        ch = conn.channel()
        while (m := ch.basic_get(queue, no_ack=False)) is not None:
            held.append(m)
            out.append(m.headers["id"])
        ch.close()  # gives every message back, in place
    return out


@pytest.mark.timeout(120)
def test_rabbitmq_absorbs_eta_messages_and_refuses_a_queue_with_consumers(
        rabbitmq_url, redis_url, uid, rclient, rabbit_queue, workers):
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url)
    prefix, queue = f"t{uid}", rabbit_queue
    app.connection_for_write().default_channel.queue_declare(queue, durable=True, auto_delete=False)
    mixed = {}
    for i in range(40):
        mixed.update(send(app, 1, None if i % 4 == 0 else 12 + i * 0.05, headers={"n": i}))
    order = rabbit_ids(rabbitmq_url, queue)

    out = absorb(rabbitmq_url, prefix, queue, store=redis_url)
    assert out.returncode == 0, out.stderr
    assert "moved 30 ETA message(s) from the RabbitMQ broker" in out.stdout, out.stdout
    assert "left in the broker: 10 (no eta)" in out.stdout
    eta_ids = {tid for tid, due in mixed.items() if due}
    assert rabbit_ids(rabbitmq_url, queue) == [t for t in order if t not in eta_ids]  # given back in place
    store = get_store(app)
    assert set(store.lookup.locate_many(list(eta_ids))) == eta_ids

    workers.append(SchedulerProcess(rabbitmq_url, prefix, queue, store=redis_url))
    w2 = WorkerProcess(rabbitmq_url, prefix, queue, store=redis_url)
    workers.append(w2)
    w2.wait_ready()
    wait_for(lambda: set(runs(rclient, prefix)) >= set(mixed), 60, interval=0.2, what="every task to run")
    time.sleep(1.0)
    got = runs(rclient, prefix)
    assert {tid: len(at) for tid, at in got.items() if len(at) != 1} == {}
    assert [tid for tid in eta_ids if got[tid][0] < mixed[tid] - 0.05] == []

    # A queue a worker consumes from is refused: the worker holds ETA messages absorb cannot see.
    refused = absorb(rabbitmq_url, prefix, queue, store=redis_url)
    assert refused.returncode != 0 and "consumer(s) attached" in refused.stderr, refused.stderr
    assert "Stop the workers" in refused.stderr


N_KILL = 10_000


def check_exactly_once(client: redis.Redis, prefix: str, sent: dict[str, float], timeout: float) -> dict[str, int]:
    wait_for(lambda: client.llen(f"{prefix}:ran") >= len(sent), timeout, interval=0.5,
             what=f"{len(sent)} runs")
    time.sleep(2.0)  # anything that would run twice has had its chance
    got = runs(client, prefix)
    counts = collections.Counter(len(at) for at in got.values())
    early = sum(1 for tid, at in got.items() if sent.get(tid) and min(at) < sent[tid] - 0.05)
    return {"messages": len(sent), "ran": len(got), "ran twice or more": sum(n for k, n in counts.items() if k > 1),
            "unknown": len(set(got) - set(sent)), "early": early, "missing": len(set(sent) - set(got))}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_kill_absorb_at_random_points_every_task_runs_exactly_once(request, redis_url, uid, rclient, workers,
                                                                    broker):
    """10,000 ETA messages and 200 without an eta; absorb SIGKILLed at random points, then run to its end."""
    if broker == "redis":
        url, store_url, queue = redis_url, None, f"q{uid}"

        def held() -> int:
            return int(rclient.llen(queue))
    else:
        url, store_url = request.getfixturevalue("rabbitmq_url"), redis_url
        queue = request.getfixturevalue("rabbit_queue")

        def held() -> int:
            return rabbit_count(url, queue)
    app = make_app(url, uid, delayed_redis_url=redis_url)
    prefix = f"t{uid}"
    rng = random.Random(int(uid, 16))
    sent = send(app, N_KILL, lambda i: 30 + (i % 100) * 0.05)
    sent.update(send(app, 200, None))
    landed, out = absorb_with_kills(url, prefix, queue, store_url, held, 5, rng, 200)
    assert len([n for n in landed if n > 200]) >= 2, (landed, out)  # killed with work left, twice or more
    store = get_store(app)
    eta_ids = [tid for tid, due in sent.items() if due]
    assert len(store.lookup.locate_many(eta_ids)) == N_KILL
    assert held() == 200
    workers.append(SchedulerProcess(url, prefix, queue, store=store_url))
    w = WorkerProcess(url, prefix, queue, store=store_url, concurrency=4, pool="threads")
    workers.append(w)
    w.wait_ready()
    report = check_exactly_once(rclient, prefix, sent, timeout=200)
    print(f"{broker} kill test: kills landed with {landed} messages left in the broker; {report}")
    assert report == {"messages": N_KILL + 200, "ran": N_KILL + 200, "ran twice or more": 0, "unknown": 0,
                      "early": 0, "missing": 0}
