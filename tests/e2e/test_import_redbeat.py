"""``celery -A proj delayed schedules import --from redbeat``: entries made by redbeat's own code.

The entries are saved with ``RedBeatSchedulerEntry(...).save()`` (and their
last run with its ``reschedule``) in the private redis-server; the import
reads them with redbeat's code, plans them (``--dry-run``: nothing changes),
disables the imported ones in redbeat and resumes each after its last run.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import redbeat.schedulers as redbeat
from celery.bin.base import CLIContext
from celery.schedules import crontab, schedule
from click.testing import CliRunner, Result
from support import make_app

from celery_delayed import get_store
from celery_delayed import schedules as api
from celery_delayed.cli import delayed
from celery_delayed.schedules.rules import Cron, next_after

pytestmark = pytest.mark.timeout(60)


def invoke(app, *args: str) -> Result:
    ctx = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    return CliRunner().invoke(delayed, list(args), obj=ctx)


def mark(*args: object, **kwargs: object) -> None:
    """The entries' task."""


@pytest.fixture
def rapp(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=4, redbeat_redis_url=redis_url, redbeat_key_prefix=f"rb{uid}:",
                   timezone="UTC")
    app.task(name="e2e.mark", shared=False)(mark)
    return app


def ms(dt: datetime) -> int:
    return round(dt.timestamp() * 1000)


@pytest.fixture
def entries(rapp):
    """Five redbeat entries, saved by redbeat; the last runs of two of them recorded by redbeat."""
    Entry = redbeat.RedBeatSchedulerEntry
    now = datetime.now(timezone.utc).replace(microsecond=0)
    poll = Entry("poll", "e2e.mark", schedule(timedelta(seconds=30)), args=[1], kwargs={"x": 2},
                 options={"queue": "io", "priority": 3}, app=rapp).save()
    poll.reschedule(last_run_at=now - timedelta(seconds=10))
    nightly = Entry("nightly", "e2e.mark", crontab(minute=30, hour=2), app=rapp).save()
    nightly.reschedule(last_run_at=now)
    Entry("off", "e2e.mark", schedule(timedelta(minutes=1)), enabled=False, app=rapp).save()
    Entry("odd", "e2e.mark", schedule(timedelta(minutes=1)), options={"expires": 30, "no_such": 1},
          app=rapp).save()
    Entry("rr", "e2e.mark", redbeat_rrule("MINUTELY"), app=rapp).save()
    return {"now": now, "poll_last": now - timedelta(seconds=10)}


def redbeat_rrule(freq: str):
    from redbeat.schedules import rrule

    return rrule(freq, dtstart=datetime(2026, 1, 1, tzinfo=timezone.utc))


def old(app, name):
    return redbeat.RedBeatSchedulerEntry.from_key(redbeat.RedBeatSchedulerEntry.generate_key(app, name), app=app)


def test_dry_run_prints_the_plan_and_changes_nothing(rapp, entries):
    res = invoke(rapp, "schedules", "import", "--from", "redbeat", "--dry-run")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert [line.split()[:2] for line in lines if line.startswith("would import")] == [
        ["would", "import"]] * 4
    by_name = {line.split()[2]: line for line in lines if line.startswith("would import")}
    assert set(by_name) == {"nightly", "odd", "off", "poll"}
    assert "e2e.mark  every 30s  next " in by_name["poll"]
    assert "old entry: disabled in redbeat (enabled=False)" in by_name["poll"]
    assert "cron 30 2 * * * (UTC)" in by_name["nightly"]
    assert "paused  old entry: left as it is (disabled in redbeat)" in by_name["off"]
    assert "  left out of odd: option expires=30 (an expiry after each send" in res.stdout
    assert "  left out of odd: option no_such=1 (no equivalent)" in res.stdout
    assert "not imported (1):" in lines
    assert any(line.startswith("  rr: a rrule schedule: celery-delayed has intervals and crons only")
               for line in lines), lines
    assert "4 entries would import from redbeat, 1 not imported (dry run: nothing changed)" in res.stderr
    assert api.list(rapp) == []
    assert old(rapp, "poll").enabled is True and old(rapp, "nightly").enabled is True


def test_import_resumes_each_entry_after_its_last_run_and_disables_it_in_redbeat(rapp, entries):
    res = invoke(rapp, "schedules", "import", "--from", "redbeat", "--settle", "0")
    assert res.exit_code == 0, res.output
    assert "4 entries imported from redbeat, 1 not imported" in res.stderr
    store = get_store(rapp)
    poll = api.get(rapp, "poll")
    last = ms(entries["poll_last"])
    assert store.schedules.get("poll").origin_ms == last  # its periods count from redbeat's last run
    assert poll.next_fire_ms == last + 30_000
    assert (poll.args, poll.kwargs, poll.options) == ([1], {"x": 2}, {"queue": "io", "priority": 3})
    nightly = api.get(rapp, "nightly")
    assert nightly.next_fire_ms == next_after(Cron.from_fields("30", "2"), ms(entries["now"]), 0, timezone.utc)
    assert api.get(rapp, "off").paused and api.get(rapp, "odd").options == {}
    # redbeat's entries: the imported ones disabled (their last run kept), the others as they were
    assert old(rapp, "poll").enabled is False and old(rapp, "poll").last_run_at == entries["poll_last"]
    assert old(rapp, "nightly").enabled is False and old(rapp, "odd").enabled is False
    assert old(rapp, "rr").enabled is True
    # again: nothing is imported twice
    res = invoke(rapp, "schedules", "import", "--from", "redbeat", "--settle", "0")
    assert res.exit_code == 0, res.output
    assert "0 entries imported from redbeat, 5 not imported" in res.stderr
    assert res.stdout.count("a celery-delayed schedule of that name exists (imported before?)") == 4


def test_a_new_redbeat_entry_first_runs_a_period_after_redbeat_saved_it(rapp):
    """redbeat records a new entry's creation as its last run: imported, it keeps that first fire time."""
    e = redbeat.RedBeatSchedulerEntry("new", "e2e.mark", schedule(timedelta(hours=1)), app=rapp).save()
    created = ms(old(rapp, "new").last_run_at)
    assert abs(created - ms(e.last_run_at)) < 1_000
    res = invoke(rapp, "schedules", "import", "--from", "redbeat", "--settle", "0")
    assert res.exit_code == 0, res.output
    assert [f for _, f in get_store(rapp).schedules.occurrences("new")] == [created + 3_600_000]


def test_an_entry_disabled_and_then_not_imported_is_reported_failed(rapp):
    """Removed from redbeat during the settle: not imported, and the report says it is left to no scheduler."""
    from celery_delayed.schedules.importers import import_schedules

    e = redbeat.RedBeatSchedulerEntry("gone", "e2e.mark", schedule(timedelta(seconds=30)), app=rapp).save()
    report = import_schedules(rapp, "redbeat", sleep=lambda _s: e.delete())
    assert report.imported == [] and [n.name for n in report.failed] == ["gone"]
    assert "could not read it again from redbeat" in report.failed[0].reason
    assert "it is disabled in redbeat: enable it there again" in report.failed[0].reason
    assert api.list(rapp) == []
