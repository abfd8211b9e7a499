"""``spread=`` end to end: a flood due at one moment runs as a ramp over the window, each job once,
none before its place in it, on both release paths."""

from __future__ import annotations

import time

import pytest
import redis
from kombu import Connection
from support import SchedulerProcess, WorkerProcess, make_app, wait_for

from celery_delayed import apply_later_many

pytestmark = pytest.mark.e2e


def run_times(client: redis.Redis, prefix: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for x in client.lrange(f"{prefix}:ran", 0, -1):
        tid, _, _, at = str(x).split("|")
        out.setdefault(tid, []).append(float(at))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["direct", "publish"])
def test_a_flood_runs_as_a_ramp_each_job_once_never_before_its_place(redis_url, rabbitmq_url, uid, rclient,
                                                                     workers, path):
    broker = redis_url if path == "direct" else rabbitmq_url
    prefix, queue = f"t{uid}", f"q{uid}"
    app = make_app(broker, uid, delayed_redis_url=redis_url)
    workers.append(SchedulerProcess(broker, prefix, queue, store=redis_url))
    w = WorkerProcess(broker, prefix, queue, store=redis_url, concurrency=4, pool="threads")
    workers.append(w)
    w.wait_ready()
    try:
        start = time.time()
        handles = apply_later_many(app, "e2e.mark", [{"args": (i,), "when": 2} for i in range(300)], spread=4,
                                   strict=False)
        due = {h.id: h.due_ms / 1000 for h in handles}
        assert max(due.values()) - min(due.values()) > 3.5
        wait_for(lambda: len(run_times(rclient, prefix)) >= 300, 60, interval=0.2, what="300 runs")
        time.sleep(0.5)
        runs = run_times(rclient, prefix)
        assert sorted(len(v) for v in runs.values()) == [1] * 300
        assert [tid for tid, at in runs.items() if at[0] < due[tid] - 0.05] == []
        firsts = sorted(v[0] for v in runs.values())
        # a ramp: about a quarter of the jobs in each second of the window, not all at once
        per_second = [sum(1 for t in firsts if start + 2 + s <= t < start + 3 + s) for s in range(4)]
        assert all(40 <= n <= 110 for n in per_second), per_second
    finally:
        if path == "publish":
            with Connection(rabbitmq_url) as conn:
                conn.default_channel.queue_delete(queue)
