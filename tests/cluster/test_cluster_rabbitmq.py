"""The store on the Redis Cluster, the broker on RabbitMQ, a real worker (issue 13).

The deployment the README recommends for a cluster: kombu cannot use a
cluster, so release publishes (with publisher confirms) to RabbitMQ. The
store URL is a plain ``redis://`` URL of one node with no cluster setting
(``"auto"`` finds the cluster). Each test uses its own queue (``q<uid>``),
deleted with its exchange afterwards, so parallel runs do not collide.
"""

from __future__ import annotations

import collections
import json
import time

import pytest
from kombu import Connection
from redis.cluster import RedisCluster
from support import SchedulerProcess, WorkerProcess, make_app, run_celery, wait_for
from support.delivery import claims, pending, received

from celery_delayed import apply_later, apply_later_many, cancel, dlq, get_store, reschedule

pytestmark = pytest.mark.e2e


def ready(rabbitmq_url: str, queue: str) -> int:
    """Messages ready on the queue (a stopped worker's unacknowledged ones are back there)."""
    with Connection(rabbitmq_url) as conn:
        return int(conn.default_channel.queue_declare(queue=queue, passive=True).message_count)


def run_log(client: RedisCluster, prefix: str) -> list[tuple[str, int]]:
    """(task id, retries) of each run, in order."""
    out = []
    for x in client.lrange(f"{prefix}:ran", 0, -1):
        tid, _pid, retries = str(x).split("|")[:3]
        out.append((tid, int(retries)))
    return out


@pytest.mark.timeout(150)
def test_schedule_release_cancel_retry_with_a_rabbitmq_broker(rabbitmq_url, cluster_url, uid, workers,
                                                              rabbit_queue):
    conf = {"delayed_shards": 8, "delayed_lease_ms": 2000, "imports": ["retry_tasks"],
            "delayed_backoff": "fixed", "delayed_backoff_base_s": 0.3}
    app = make_app(rabbitmq_url, uid, delayed_redis_url=cluster_url, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    assert queue == rabbit_queue
    store = get_store(app)
    assert store.redis.cluster and store.layout.release_path[0] == "publish"
    w = WorkerProcess(rabbitmq_url, prefix, queue, store=cluster_url, conf=conf, concurrency=4, pool="threads")
    workers.append(w)
    workers.append(SchedulerProcess(rabbitmq_url, prefix, queue, store=cluster_url, conf=conf))
    w.wait_ready()

    n = 400
    plain = [h.id for h in apply_later_many(app, "e2e.plain", [{"args": (i,), "when": 3.0 + 3.0 * i / n}
                                                               for i in range(n)], strict=False)]
    marked = [apply_later(app, "e2e.mark", when=1.5, strict=False).id for _ in range(20)]
    cancelled = plain[-30:]
    for i in cancelled:
        assert cancel(app, i) == "SCHEDULED"
    moved = plain[n // 2:n // 2 + 10]  # due in 4.5 s, beyond the look-ahead (2 s): still scheduled
    for i in moved:
        reschedule(app, i, 6.0)
    flaky = [apply_later(app, "rt.flaky", args=(2,), when=0.5, strict=False).id for _ in range(8)]
    doomed = [apply_later(app, "rt.doomed", args=(i,), when=0.5, strict=False).id for i in range(4)]
    far = [apply_later(app, "e2e.mark", when=3600, strict=False).id for _ in range(8)]

    res = run_celery(rabbitmq_url, prefix, queue, "delayed", "status", "--json", store=cluster_url, conf=conf)
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    assert status["cluster"] is True and status["release_path"] == "publish", status

    cclient = RedisCluster.from_url(cluster_url, decode_responses=True)
    once = set(plain) - set(cancelled) | set(marked)

    def settled() -> bool:
        log = run_log(cclient, prefix)
        ran = {tid for tid, _ in log}
        retries = collections.Counter(tid for tid, _ in log)
        return (ran >= once and all(retries[i] == 3 for i in flaky) and dlq.count(app) == len(doomed)
                and pending(app) == len(far))

    wait_for(settled, 90, interval=0.3, what="every job to run, the retries and the dead letters")
    time.sleep(1.0)  # a duplicate would show up now
    for i in far:
        assert cancel(app, i) == "SCHEDULED"
    w.stop()
    log = run_log(cclient, prefix)
    runs = collections.Counter(tid for tid, _ in log)
    attempts = collections.Counter(log)
    assert set(runs) == once | set(flaky) | set(doomed), (
        "a cancelled job ran" if set(runs) & set(cancelled) else "a job was lost")
    assert all(runs[i] == 1 for i in once), [i for i in once if runs[i] != 1][:5]
    # Each attempt of a retried job ran once: attempts 0, 1, 2 (it fails twice), and 0, 1 for the doomed.
    assert all(attempts[(i, r)] == 1 for i in flaky for r in range(3)), {i: runs[i] for i in flaky}
    assert all(attempts[(i, r)] == 1 for i in doomed for r in range(2)) and all(runs[i] == 2 for i in doomed)
    assert {d.id for d in dlq.list_dead(app, limit=100)} == set(doomed)
    for i in moved:  # rescheduled: released after the new time
        rec = store.lookup.get(i)
        assert int(rec["released"]) >= int(rec["due"]) - store.config.lookahead_ms
    # Every publish reached the worker once; nothing is left on the queue or in flight.
    got, published = received(w.output(), "e2e.plain"), claims(app, list(once - set(marked)))
    assert all(got[i] == published[i] for i in once - set(marked)), "a publish did not arrive exactly once"
    assert ready(rabbitmq_url, queue) == 0, "messages left on the queue"
    assert pending(app) == 0
    assert dlq.purge(app) == len(doomed)
    cclient.close()
