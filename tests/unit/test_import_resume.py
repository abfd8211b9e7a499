"""Where a schedule imported from beat resumes (pure: no Redis, no clock), and the missing package's error."""

from __future__ import annotations

import sys
from datetime import timezone

import pytest
from celery import Celery

from celery_delayed.errors import ConfigurationError
from celery_delayed.schedules.importers.entry import after_runs, first_run, late_start, resume_point
from celery_delayed.schedules.importers.options import split_options
from celery_delayed.schedules.rules import Cron, Every

UTC = timezone.utc
T = 1_800_000_000_000  # 2027-01-15T08:00:00Z
EVERY = Every(10_000)
HOURLY = Cron.from_fields("0")


def test_an_interval_resumes_from_its_last_run():
    assert resume_point(EVERY, UTC, T - 4_000, T) == T - 4_000
    assert first_run(EVERY, UTC, T - 4_000, T) == T + 6_000  # the old scheduler's next run


def test_a_fire_time_missed_during_the_hand_over_runs_once_now_and_an_interval_counts_from_it():
    cursor = late_start(EVERY, resume_point(EVERY, UTC, T - 13_000, T), T)
    assert cursor == T - 10_000 and first_run(EVERY, UTC, cursor, T) == T
    # a cron keeps its fire times: the missed one (08:00) runs now, the next at 09:00
    cron_cursor = late_start(HOURLY, resume_point(HOURLY, UTC, T - 60_000, T + 120_000), T + 120_000)
    assert first_run(HOURLY, UTC, cron_cursor, T + 120_000) == T + 120_000


def test_never_run_runs_once_now_and_a_future_start_time_is_its_first_fire():
    assert first_run(EVERY, UTC, resume_point(EVERY, UTC, None, T), T) == T
    assert first_run(HOURLY, UTC, resume_point(HOURLY, UTC, None, T + 5_000), T + 5_000) == T + 5_000
    start = T + 86_400_000 + 1_234
    assert first_run(EVERY, UTC, resume_point(EVERY, UTC, T - 1_000, T, start), T) == start
    assert first_run(HOURLY, UTC, resume_point(HOURLY, UTC, None, T, start), T) == T + 90_000_000  # 09:00 next day


def test_runs_counted_but_not_timed_move_the_cursor_by_that_many_fire_times_at_most_to_now():
    assert after_runs(EVERY, UTC, T, 0, T + 100_000) == T
    assert after_runs(EVERY, UTC, T, 2, T + 100_000) == T + 20_000
    assert after_runs(EVERY, UTC, T, 50, T + 100_000) == T + 100_000


def test_options_without_an_equivalent_are_listed_not_dropped_silently():
    kept, dropped = split_options({"queue": "io", "expires": 30, "bogus": 1, "priority": None}, recurring=True)
    assert kept == {"queue": "io"}
    assert [d.split("=")[0] for d in dropped] == ["option expires", "option bogus"]
    assert split_options({"expires": 30}, recurring=False) == ({"expires": 30}, [])


def test_a_missing_redbeat_names_the_package(monkeypatch):
    from celery_delayed.schedules.importers.redbeat import RedbeatSource

    monkeypatch.setitem(sys.modules, "redbeat", None)
    with pytest.raises(ConfigurationError, match=r"needs the package celery-redbeat.*pip install celery-redbeat"):
        RedbeatSource(Celery(set_as_current=False))
