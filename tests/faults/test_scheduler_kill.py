"""Scenario 1: 4 schedulers on one store; SIGKILL one at random every ~0.5 s (and restart it)
while 20,000 jobs come due over 10 s. Direct path: 0 lost, 0 enqueued twice."""

from __future__ import annotations

import time

import pytest
from harness import FaultRun

pytestmark = pytest.mark.e2e

SEED = 1
JOBS = 20_000
SPREAD_S = 10.0
KILL_EVERY_S = 0.5


@pytest.mark.timeout(300)
def test_sigkill_schedulers_while_jobs_come_due() -> None:
    conf = {"delayed_lease_ms": 2000}
    with FaultRun(seed=SEED, conf=conf) as run:
        t = time.monotonic()
        ids = run.schedule(JOBS, start_s=3.0, spread_s=SPREAD_S)
        schedule_s = time.monotonic() - t
        scheds = [run.scheduler() for _ in range(4)]
        run.wait_ready(run.worker(concurrency=8, extra=["--prefetch-multiplier", "50"]))
        kills = 0
        deadline = time.monotonic() + SPREAD_S + 6
        while time.monotonic() < deadline and (run.pending() > 0 or kills == 0):
            time.sleep(KILL_EVERY_S * (0.5 + run.rng.random()))
            i = run.rng.randrange(len(scheds))
            run.kill(scheds[i])
            kills += 1
            scheds[i] = run.scheduler()
        released_s = time.monotonic() - t
        assert run.wait_executed(ids, 120), f"{len(set(ids) - set(run.counts()))} jobs never ran"
        executed_s = time.monotonic() - t
        time.sleep(0.5)  # a late duplicate would show up now
        out = run.outcome("scheduler SIGKILL x4", ids, kills)
        out.notes.update(schedule_s=round(schedule_s, 1), released_s=round(released_s, 1),
                         executed_s=round(executed_s, 1))
        out.report()
        assert out.lost == 0 and out.duplicated == 0 and out.delivered_twice == 0, out.line()
        assert sum(run.deliveries().values()) == JOBS
        assert run.store_problems() == []
        assert run.pending() == 0
        assert kills >= 15
