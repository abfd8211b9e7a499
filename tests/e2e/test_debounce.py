"""Debounced and throttled jobs through a real worker and scheduler, with the default look-ahead (2 s).

Calls closer together than ``when`` coalesce into one run, even when ``when``
is shorter than ``delayed_lookahead_ms`` (a debounce key's job is released
when it is due, not a look-ahead early); ``max_wait`` bounds how long one job
collects calls; each job the keys made runs once.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import pytest
from support import WorkerProcess, make_app, ran, wait_for

from celery_delayed import apply_later, get_store

pytestmark = pytest.mark.e2e


def _worker(redis_url: str, app: Any, workers: list[Any]) -> None:
    """A worker with the scheduler embedded (``--delayed``), at the default look-ahead."""
    w = WorkerProcess(redis_url, app.conf.delayed_key_prefix, app.conf.task_default_queue, concurrency=2,
                      pool="threads", extra=["--delayed"])
    workers.append(w)
    w.wait_ready()


def _check_ran_once(app: Any, rclient: Any, ids: set[str], debounced: set[str]) -> None:
    """Every job of ``ids`` runs, once, and nothing else does; none of ``debounced`` was released before
    it was due (a throttled job goes a look-ahead early, as any job)."""
    prefix = app.conf.delayed_key_prefix
    wait_for(lambda: set(ran(rclient, prefix)) >= ids, 30, what="the keys' jobs to run")
    time.sleep(0.3)  # a second run, if there were one, would show by now
    counts = collections.Counter(ran(rclient, prefix))
    assert set(counts) == ids and max(counts.values()) == 1, counts
    store = get_store(app)
    for jid in debounced:
        rec = store.lookup.get(jid)
        assert int(rec["released"]) >= int(rec["due"]), ("released before it was due", rec)


@pytest.mark.timeout(90)
def test_calls_closer_than_when_make_one_run(redis_url: str, uid: str, workers: list[Any], rclient: Any) -> None:
    """Twenty calls 0.3 s apart with when=1 (within the 2 s look-ahead): one job, run once, after the last."""
    app = make_app(redis_url, uid)
    assert get_store(app).config.lookahead_ms == 2000
    _worker(redis_url, app, workers)
    handles = []
    for i in range(20):
        handles.append(apply_later(app, "e2e.mark", (i,), when=1, debounce_key="k", strict=False))
        time.sleep(0.3)
    ids = {h.id for h in handles}
    assert len(ids) == 1, f"20 calls 0.3 s apart made {len(ids)} jobs"
    assert [h.created for h in handles] == [True] + [False] * 19
    _check_ran_once(app, rclient, ids, ids)
    rec = get_store(app).lookup.get(handles[0].id)
    assert int(rec["due"]) == handles[-1].due_ms  # the last call's due time


@pytest.mark.timeout(120)
def test_debounced_and_throttled_jobs_from_many_threads(
    redis_url: str, uid: str, workers: list[Any], rclient: Any,
) -> None:
    app = make_app(redis_url, uid)
    _worker(redis_url, app, workers)
    results: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def burst(t: int) -> None:  # 800 calls in a second or two: well within when=2 and max_wait=30
        for i in range(50):
            d = apply_later(app, "e2e.mark", (t, i), when=2, debounce_key="d", max_wait=30, strict=False)
            th = apply_later(app, "e2e.mark", (t, i), when=0.5, throttle_key="t", window=60, strict=False)
            with lock:
                results.extend([("d", d), ("t", th)])

    threads = [threading.Thread(target=burst, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 1600
    made = {kind: {h.id for k, h in results if k == kind} for kind in ("d", "t")}
    assert len(made["d"]) == 1, f"800 debounce calls made {len(made['d'])} jobs"
    assert len(made["t"]) == 1  # one per window
    for kind in ("d", "t"):
        assert sum(h.created for k, h in results if k == kind) == 1

    # Calls that never pause for `when` (1 s) for ~4.5 s, max_wait=1.5: each job takes the calls of
    # 1.5 s from its first one, then runs; the next call makes the next job.
    max_wait_ms, span_s = 1500, 4.5
    steady: list[Any] = []
    t0 = time.monotonic()

    def steady_calls(t: int) -> None:
        i = 0
        while time.monotonic() - t0 < span_s:
            h = apply_later(app, "e2e.mark", ("m", t, i), when=1, debounce_key="m", max_wait=1.5, strict=False)
            with lock:
                steady.append(h)
            i += 1
            time.sleep(0.1)

    threads = [threading.Thread(target=steady_calls, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    span_ms = (time.monotonic() - t0) * 1000
    jobs = {h.id for h in steady}
    # Each job but the last holds max_wait of calls: at most span / max_wait + 1 jobs. Without
    # max_wait there would be one; the calls last three max_waits, so at least two.
    assert 2 <= len(jobs) <= span_ms // max_wait_ms + 1, f"{len(steady)} calls over {span_ms:.0f} ms made {len(jobs)}"
    assert sum(h.created for h in steady) == len(jobs)
    _check_ran_once(app, rclient, made["d"] | made["t"] | jobs, made["d"] | jobs)
    store = get_store(app)
    for jid in jobs:  # max_wait holds: none is due later than max_wait after its first call
        rec = store.lookup.get(jid)
        assert int(rec["due"]) - int(rec["created"]) <= max_wait_ms, rec
