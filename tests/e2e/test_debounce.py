"""Debounced and throttled jobs through a real worker and scheduler: each job the keys made runs once."""

from __future__ import annotations

import collections
import threading
from typing import Any

import pytest
from support import WorkerProcess, make_app, ran, wait_for

from celery_delayed import apply_later

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(90)
def test_debounced_and_throttled_jobs_run_once(redis_url: str, uid: str, workers: list[Any], rclient: Any) -> None:
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, concurrency=2, pool="threads", extra=["--delayed"])
    workers.append(w)
    w.wait_ready()
    results: list[Any] = []
    lock = threading.Lock()

    def call(t: int) -> None:
        for i in range(20):
            d = apply_later(app, "e2e.mark", (t, i), when=0.5, debounce_key="d", max_wait=2, strict=False)
            th = apply_later(app, "e2e.mark", (t, i), when=0.5, throttle_key="t", window=60, strict=False)
            with lock:
                results.extend([("d", d), ("t", th)])

    threads = [threading.Thread(target=call, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 320
    made = {kind: {h.id for k, h in results if k == kind} for kind in ("d", "t")}
    assert len(made["t"]) == 1  # one per window
    for kind in ("d", "t"):
        assert sum(h.created for k, h in results if k == kind) == len(made[kind])
    every = made["d"] | made["t"]
    wait_for(lambda: set(ran(rclient, prefix)) >= every, 30, what="the keys' jobs to run")
    counts = collections.Counter(ran(rclient, prefix))
    assert set(counts) == every and max(counts.values()) == 1
    print(f"\ndebounce: 160 calls made {len(made['d'])} job(s); throttle: 160 calls made 1")
