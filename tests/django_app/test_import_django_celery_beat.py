"""``celery -A proj delayed schedules import --from django-celery-beat``: rows made by its own models.

The rows (interval, crontab with its time zone, solar, clocked, disabled,
one-off, expires, start time, options) are created with django-celery-beat's
models in the session's database; the import reads them with the same
models. The hand-over runs a real ``celery beat -S
django_celery_beat.schedulers:DatabaseScheduler``, a worker and a
celery-delayed scheduler across the switch.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from support import WORKER_APPS, Proc, SchedulerProcess, WorkerProcess, app_env, make_app, run_celery, wait_for

from celery_delayed import get_store, lookup
from celery_delayed import schedules as api
from celery_delayed.cli import delayed
from celery_delayed.schedules.rules import Cron, next_after, zone

pytestmark = pytest.mark.timeout(90)

HERE = Path(__file__).parent


def invoke(app: Celery, *args: str) -> Result:
    ctx = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    return CliRunner().invoke(delayed, list(args), obj=ctx)


def ms(dt: datetime) -> int:
    return round(dt.timestamp() * 1000)


@pytest.fixture
def beat(dj: str) -> Iterator[Any]:
    """django-celery-beat's models, no PeriodicTask before or after the test."""
    from django_celery_beat import models

    def clear() -> None:
        for model in (models.PeriodicTask, models.IntervalSchedule, models.CrontabSchedule, models.SolarSchedule,
                      models.ClockedSchedule):
            model.objects.all().delete()

    clear()
    yield models
    clear()


@pytest.fixture
def rows(beat: Any, admin_app: Celery) -> dict[str, Any]:
    """One row of each kind, saved by django-celery-beat's models."""
    m = beat
    now = datetime.now(timezone.utc).replace(microsecond=0)
    every30 = m.IntervalSchedule.objects.create(every=30, period=m.IntervalSchedule.SECONDS)
    hourly = m.IntervalSchedule.objects.create(every=1, period=m.IntervalSchedule.HOURS)
    berlin = m.CrontabSchedule.objects.create(minute="30", hour="2", timezone=ZoneInfo("Europe/Berlin"))
    solar = m.SolarSchedule.objects.create(event="sunset", latitude=52.5, longitude=13.4)
    clock = m.ClockedSchedule.objects.create(clocked_time=now + timedelta(hours=2))
    T = m.PeriodicTask.objects.create
    T(name="poll", task="e2e.mark", interval=every30, args="[1]", kwargs='{"x": 2}', queue="io", priority=3,
      headers='{"h": "v"}', last_run_at=now - timedelta(seconds=10))
    T(name="nightly", task="e2e.mark", crontab=berlin, last_run_at=now)
    T(name="sunset", task="e2e.mark", solar=solar)
    T(name="at-two", task="e2e.mark", clocked=clock, one_off=True, expire_seconds=60)
    T(name="off", task="e2e.mark", interval=hourly, enabled=False)
    T(name="ending", task="e2e.mark", interval=hourly, expires=now + timedelta(days=1))
    T(name="ended", task="e2e.mark", interval=hourly, expires=now - timedelta(days=1))
    T(name="later", task="e2e.mark", interval=hourly, start_time=now + timedelta(days=1))
    T(name="short-lived", task="e2e.mark", interval=hourly, expire_seconds=30, last_run_at=now)
    return {"now": now, "clock": clock.clocked_time}


def enabled(beat: Any, name: str) -> bool:
    return bool(beat.PeriodicTask.objects.get(name=name).enabled)


def test_dry_run_prints_the_plan_and_changes_nothing(beat: Any, rows: dict[str, Any], admin_app: Celery) -> None:
    before = list(beat.PeriodicTask.objects.order_by("name").values())
    res = invoke(admin_app, "schedules", "import", "--from", "django-celery-beat", "--dry-run")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    planned = {line.split()[2]: line for line in lines if line.startswith("would import ")}
    assert set(planned) == {"at-two", "later", "nightly", "off", "poll", "short-lived"}, lines
    assert "every 30s  next " in planned["poll"] and "disabled in django-celery-beat" in planned["poll"]
    assert "cron 30 2 * * * (Europe/Berlin)" in planned["nightly"]
    assert "  once  next " in planned["at-two"] and "paused  old entry: left as it is" in planned["off"]
    assert "  left out of short-lived: expire_seconds=30 (an expiry after each send" in res.stdout
    not_imported = lines[lines.index("not imported (3):") + 1:]
    assert [line.split(":")[0].strip() for line in not_imported] == ["ended", "ending", "sunset"]
    assert "a solar schedule" in not_imported[2] and "a celery-delayed schedule has no end" in not_imported[1]
    assert "expired at" in not_imported[0]
    assert "(dry run: nothing changed)" in res.stderr
    assert list(beat.PeriodicTask.objects.order_by("name").values()) == before
    assert api.list(admin_app) == []


def test_import_maps_each_kind_and_disables_the_imported_rows(beat: Any, rows: dict[str, Any],
                                                               admin_app: Celery) -> None:
    res = invoke(admin_app, "schedules", "import", "--from", "django-celery-beat", "--settle", "0")
    assert res.exit_code == 0, res.output
    assert "6 entries imported from django-celery-beat, 3 not imported" in res.stderr, res.output
    now = rows["now"]
    store = get_store(admin_app)
    poll = api.get(admin_app, "poll")
    assert store.schedules.get("poll").origin_ms == ms(now - timedelta(seconds=10))
    assert poll.next_fire_ms == ms(now + timedelta(seconds=20))
    assert poll.args == [1] and poll.kwargs == {"x": 2}
    assert poll.options == {"queue": "io", "priority": 3, "headers": {"h": "v", "periodic_task_name": "poll"}}
    nightly = api.get(admin_app, "nightly")
    assert nightly.timezone == "Europe/Berlin"
    assert nightly.next_fire_ms == next_after(Cron.from_fields("30", "2"), ms(now), 0, zone("Europe/Berlin"))
    assert api.get(admin_app, "off").paused
    later = api.get(admin_app, "later")
    assert later.next_fire_ms == ms(now + timedelta(days=1))  # its start time
    assert api.get(admin_app, "short-lived").options.get("expires") is None
    # the clocked one-off: one delayed job at its time, expiring 60 s after it
    job_line = next(line for line in res.stdout.splitlines() if line.startswith("imported at-two"))
    h = lookup(admin_app, job_line.rsplit("job ", 1)[1])
    assert h.eta == rows["clock"] and h.job_state == "SCHEDULED"
    assert int(h.job()["exp"]) == ms(rows["clock"]) + 60_000  # expire_seconds, from its run time
    # the rows: the imported ones disabled, the others as they were
    assert not any(enabled(beat, n) for n in ("poll", "nightly", "at-two", "later", "short-lived"))
    assert enabled(beat, "sunset") and enabled(beat, "ending")
    again = invoke(admin_app, "schedules", "import", "--from", "django-celery-beat", "--settle", "0")
    assert again.exit_code == 0, again.output
    assert "0 entries imported from django-celery-beat, 9 not imported" in again.stderr, again.output
    assert "at-two: a one-off entry that ran already (or was disabled)" in again.stdout


def test_without_django_settings_the_command_says_what_to_set(redis_url: str, uid: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH")}
    res = run_celery(redis_url, f"t{uid}", f"q{uid}", "delayed", "schedules", "import", "--from",
                     "django-celery-beat", "--dry-run", env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Django is not configured; set DJANGO_SETTINGS_MODULE" in res.stdout + res.stderr
    env |= {"DJANGO_SETTINGS_MODULE": "beat_settings", "E2E_DJANGO_NO_BEAT": "1",
            "PYTHONPATH": os.pathsep.join([str(WORKER_APPS), str(HERE), os.environ.get("PYTHONPATH", "")])}
    res = run_celery(redis_url, f"t{uid}", f"q{uid}", "delayed", "schedules", "import", "--from",
                     "django-celery-beat", "--dry-run", env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "'django_celery_beat' is not in the Django project's INSTALLED_APPS" in res.stdout + res.stderr


PERIOD_S = 2.0


def test_from_django_celery_beat_with_both_schedulers_running_across_the_switch(
        beat: Any, dj: str, redis_url: str, uid: str, workers: list[Any]) -> None:
    import itertools

    prefix, queue = f"t{uid}", f"q{uid}"
    conf = {"delayed_shards": 2, "beat_max_loop_interval": 1, "timezone": "UTC"}
    app = make_app(redis_url, uid, **conf)
    every = beat.IntervalSchedule.objects.create(every=int(PERIOD_S), period=beat.IntervalSchedule.SECONDS)
    beat.PeriodicTask.objects.create(name="tick", task="e2e.mark", interval=every)
    env = app_env(redis_url, prefix, queue, conf=conf)
    env.update(DJANGO_SETTINGS_MODULE="beat_settings", E2E_DJANGO_DB=dj.split(":///", 1)[1],
               PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(HERE)]))
    worker = WorkerProcess(redis_url, prefix, queue, conf=conf)
    workers.append(worker)
    workers.append(SchedulerProcess(redis_url, prefix, queue, conf=conf))
    old = Proc([sys.executable, "-m", "celery", "-A", "e2e_app", "beat", "-S",
                "django_celery_beat.schedulers:DatabaseScheduler", "-l", "INFO"], env)
    workers.append(old)
    worker.wait_ready()
    client = get_store(app).redis.client

    def runs() -> list[tuple[float, str]]:
        out = []
        for row in client.lrange(f"{prefix}:ran", 0, -1):
            task_id, _pid, _retries, at = (row.decode() if isinstance(row, bytes) else row).split("|")
            out.append((float(at), task_id))
        return sorted(out)

    wait_for(lambda: len(runs()) >= 3, 40, what=f"three runs sent by beat: {old.output()[-2000:]}")
    started = time.time()
    res = run_celery(redis_url, prefix, queue, "delayed", "schedules", "import", "--from", "django-celery-beat",
                     conf=conf, timeout=60, env=env)
    ended = time.time()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "imported tick  e2e.mark  every 2s  next " in res.stdout, res.stdout
    time.sleep(2 * PERIOD_S)
    old.stop()
    time.sleep(3 * PERIOD_S)
    worker.stop()
    got = runs()
    times = [t for t, _ in got]
    print("runs (s after the import began):", [round(t - started, 2) for t in times])
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(times)]
    assert len({i for _, i in got}) == len(got), got
    assert min(gaps) >= PERIOD_S / 2, f"two runs closer than half a period (doubled at the switch): {gaps}"
    # The occurrence due while the old scheduler may still send it (the settle: it sees a change at its next
    # tick, beat_max_loop_interval = 1 s, + 2 s) runs late, once, at the end of the hand-over; every other
    # gap is a period.
    settle_s = 1 + 2
    late = [g for g in gaps if g > PERIOD_S * 1.5]
    assert len(late) <= 1 and all(g <= PERIOD_S + settle_s + 1.5 for g in late), f"an occurrence skipped: {gaps}"
    assert len([t for t in times if t < started]) >= 3 and len([t for t in times if t > ended]) >= 4, times
    ours = {i for i, _ in get_store(app).schedules.occurrences("tick")}
    assert all(i in ours for t, i in got if t > ended + PERIOD_S), "beat still ran it after the import"
