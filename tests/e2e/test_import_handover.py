"""The switch from redbeat with both schedulers running: every occurrence runs once, none is skipped.

A real ``celery beat -S redbeat.RedBeatScheduler`` runs an every-2-s entry
(made by redbeat's own code) on a real worker while a celery-delayed
scheduler runs; ``delayed schedules import --from redbeat`` runs as a user
runs it, beat is stopped a few seconds later, and the runs recorded by the
worker are read: no two runs closer than half a period, and no gap over one
and a half but the one occurrence that fell due during the hand-over (it
runs late, once).
"""

from __future__ import annotations

import itertools
import sys
import time
from datetime import timedelta

import pytest
import redbeat.schedulers as redbeat
from celery.schedules import schedule
from support import Proc, SchedulerProcess, WorkerProcess, app_env, make_app, run_celery, wait_for

from celery_delayed import get_store

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


PERIOD_S = 2.0
#: redbeat's default settle (RedbeatSource.settle_s)
SETTLE_S = 1.0


def run_times(app, prefix: str) -> list[tuple[float, str]]:
    """(time, task id) of each recorded run, the earliest first."""
    rows = get_store(app).redis.client.lrange(f"{prefix}:ran", 0, -1)
    out = []
    for row in rows:
        task_id, _pid, _retries, at = (row.decode() if isinstance(row, bytes) else row).split("|")
        out.append((float(at), task_id))
    return sorted(out)


def check_runs(runs: list[tuple[float, str]], switch: tuple[float, float]) -> None:
    times = [t for t, _ in runs]
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(times)]
    assert len({i for _, i in runs}) == len(runs), f"a task id ran twice: {runs}"
    assert min(gaps) >= PERIOD_S / 2, f"two runs closer than half a period (doubled at the switch): {gaps}"
    # The occurrence due while redbeat may still send it (the settle, 1 s, and the moments the import takes
    # around it) runs late, once, at the end of the hand-over; every other gap is a period.
    late = [g for g in gaps if g > PERIOD_S * 1.5]
    assert len(late) <= 1 and all(g <= PERIOD_S + SETTLE_S + 1.5 for g in late), f"an occurrence skipped: {gaps}"
    before = [t for t in times if t < switch[0]]
    after = [t for t in times if t > switch[1]]
    assert len(before) >= 3 and len(after) >= 4, (before, after, switch)


def test_from_redbeat_with_both_schedulers_running_across_the_switch(redis_url, uid, workers):
    prefix, queue = f"t{uid}", f"q{uid}"
    conf = {"delayed_shards": 2, "redbeat_redis_url": redis_url, "redbeat_key_prefix": f"rb{uid}:",
            "timezone": "UTC"}
    app = make_app(redis_url, uid, **conf)
    redbeat.RedBeatSchedulerEntry("tick", "e2e.mark", schedule(timedelta(seconds=PERIOD_S)), app=app).save()
    worker = WorkerProcess(redis_url, prefix, queue, conf=conf)
    workers.append(worker)
    workers.append(SchedulerProcess(redis_url, prefix, queue, conf=conf))
    beat = Proc([sys.executable, "-m", "celery", "-A", "e2e_app", "beat", "-S", "redbeat.RedBeatScheduler",
                 "-l", "INFO"], app_env(redis_url, prefix, queue, conf=conf))
    workers.append(beat)
    worker.wait_ready()
    wait_for(lambda: len(run_times(app, prefix)) >= 3, 30, what=f"three runs sent by redbeat: {beat.output()[-2000:]}")
    started = time.time()
    res = run_celery(redis_url, prefix, queue, "delayed", "schedules", "import", "--from", "redbeat", conf=conf,
                     timeout=60)
    ended = time.time()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "imported tick  e2e.mark  every 2s  next " in res.stdout, res.stdout
    time.sleep(2 * PERIOD_S)
    beat.stop()  # the old scheduler stopped after the import, as a user would
    time.sleep(3 * PERIOD_S)
    worker.stop()
    runs = run_times(app, prefix)
    print("runs (s after the import began):", [round(t - started, 2) for t, _ in runs])
    check_runs(runs, (started, ended))
    assert "Sending due task tick" in beat.output()
    ours = {i for i, _ in get_store(app).schedules.occurrences("tick")}
    assert all(i in ours for t, i in runs if t > ended + PERIOD_S), "beat still ran it after the import"
    assert all(i not in ours for t, i in runs if t < started), runs
