"""Fire times of recurring schedules across real DST transitions (pure: no Redis)."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone

import pytest
from celery.schedules import crontab, schedule, solar
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_delayed.errors import InvalidOption
from celery_delayed.schedules.rules import (
    MAX_INTERVAL_S,
    Cron,
    Every,
    fires_between,
    latest_at_or_before,
    local_instant,
    next_after,
    parse_spec,
    period_ms,
    zone,
)

pytestmark = pytest.mark.timeout(30)


def utc(text: str) -> int:
    """Epoch ms of a UTC time written 'YYYY-MM-DD HH:MM'."""
    return int(datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp() * 1000)


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M")


def fires(spec: Cron, zone_name: str, start: str, end: str) -> list[str]:
    return [iso(t) for t in fires_between(spec, utc(start), utc(end), 0, zone(zone_name))]


# -- the three rules, in three zones ------------------------------------------------------


def test_berlin_spring_forward_nonexistent_time_runs_at_the_jump():
    # 29 March 2026: 02:00 CET -> 03:00 CEST (01:00 UTC); 02:30 does not exist.
    daily = Cron.from_fields(minute="30", hour="2")
    assert fires(daily, "Europe/Berlin", "2026-03-27 12:00", "2026-03-30 12:00") == [
        "2026-03-28 01:30",  # 02:30 CET
        "2026-03-29 01:00",  # the jump: 03:00 CEST, the first valid instant after 02:30
        "2026-03-30 00:30",  # 02:30 CEST
    ]


def test_berlin_several_times_in_one_gap_run_once():
    every_15 = Cron.from_fields(minute="*/15", hour="1-3")
    got = fires(every_15, "Europe/Berlin", "2026-03-29 00:00", "2026-03-29 02:00")
    # 01:00..01:45 CET (00:00..00:45 UTC), the gap's four times once at 01:00 UTC, then 03:15.. CEST
    assert got == ["2026-03-29 00:15", "2026-03-29 00:30", "2026-03-29 00:45", "2026-03-29 01:00",
                   "2026-03-29 01:15", "2026-03-29 01:30", "2026-03-29 01:45"]
    assert len(got) == len(set(got))


def test_berlin_fall_back_repeated_time_runs_once_first_occurrence():
    # 25 October 2026: 03:00 CEST -> 02:00 CET (01:00 UTC); 02:30 happens twice.
    daily = Cron.from_fields(minute="30", hour="2")
    assert fires(daily, "Europe/Berlin", "2026-10-24 12:00", "2026-10-26 12:00") == [
        "2026-10-25 00:30",  # 02:30 CEST, the first of the two
        "2026-10-26 01:30",  # 02:30 CET
    ]


def test_new_york_spring_forward_and_fall_back():
    daily_0230 = Cron.from_fields(minute="30", hour="2")
    # 8 March 2026: 02:00 EST -> 03:00 EDT (07:00 UTC)
    assert fires(daily_0230, "America/New_York", "2026-03-07 12:00", "2026-03-09 12:00") == [
        "2026-03-08 07:00",  # the jump (03:00 EDT)
        "2026-03-09 06:30",  # 02:30 EDT
    ]
    daily_0130 = Cron.from_fields(minute="30", hour="1")
    # 1 November 2026: 02:00 EDT -> 01:00 EST (06:00 UTC); 01:30 happens twice
    assert fires(daily_0130, "America/New_York", "2026-10-31 12:00", "2026-11-02 12:00") == [
        "2026-11-01 05:30",  # 01:30 EDT, once
        "2026-11-02 06:30",  # 01:30 EST
    ]


def test_new_york_hourly_through_fall_back_runs_each_wall_hour_once():
    hourly = Cron.from_fields(minute="0")
    got = fires(hourly, "America/New_York", "2026-11-01 03:30", "2026-11-01 08:30")
    # local 00:00 EDT, 01:00 EDT, (01:00 EST skipped: repeated), 02:00 EST, 03:00 EST
    assert got == ["2026-11-01 04:00", "2026-11-01 05:00", "2026-11-01 07:00", "2026-11-01 08:00"]


def test_lord_howe_half_hour_shifts():
    # 4 October 2026: 02:00 +10:30 -> 02:30 +11:00 (15:30 UTC on the 3rd); 02:15 does not exist.
    daily = Cron.from_fields(minute="15", hour="2")
    assert fires(daily, "Australia/Lord_Howe", "2026-10-02 00:00", "2026-10-05 00:00") == [
        "2026-10-02 15:45",  # 02:15 +10:30
        "2026-10-03 15:30",  # the jump (02:30 +11:00)
        "2026-10-04 15:15",  # 02:15 +11:00
    ]
    # 5 April 2026: 02:00 +11:00 -> 01:30 +10:30 (15:00 UTC on the 4th); 01:45 happens twice.
    daily_0145 = Cron.from_fields(minute="45", hour="1")
    assert fires(daily_0145, "Australia/Lord_Howe", "2026-04-03 00:00", "2026-04-06 00:00") == [
        "2026-04-03 14:45",  # 01:45 +11:00
        "2026-04-04 14:45",  # 01:45 +11:00, the first of the two
        "2026-04-05 15:15",  # 01:45 +10:30
    ]


@pytest.mark.parametrize("zone_name", ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe"])
def test_interval_is_elapsed_time_across_transitions(zone_name):
    hourly = Every(3_600_000)
    origin = utc("2026-01-01 00:00")
    got = fires_between(hourly, utc("2026-03-07 00:00"), utc("2026-11-02 00:00"), origin, zone(zone_name),
                        limit=100_000)
    gaps = {b - a for a, b in itertools.pairwise(got)}
    assert gaps == {3_600_000}


@pytest.mark.parametrize("zone_name", ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe"])
def test_every_quarter_hour_over_a_year_is_strictly_increasing_and_never_repeats_a_wall_time(zone_name):
    tz = zone(zone_name)
    spec = Cron.from_fields(minute="*/15")
    got = fires_between(spec, utc("2026-01-01 00:00"), utc("2027-01-01 00:00"), 0, tz, limit=100_000)
    assert all(a < b for a, b in itertools.pairwise(got))
    walls = [datetime.fromtimestamp(t / 1000, tz).replace(tzinfo=None, fold=0) for t in got]
    assert len(walls) == len(set(walls))
    # 365 days of 96, less what two gaps swallow (gap times collapse into one fire)
    assert 365 * 96 - 8 <= len(got) <= 365 * 96


def test_local_instant_rules_directly():
    tz = zone("Europe/Berlin")
    assert local_instant(datetime(2026, 3, 29, 2, 30), tz) == utc("2026-03-29 01:00")
    assert local_instant(datetime(2026, 10, 25, 2, 30), tz) == utc("2026-10-25 00:30")
    assert local_instant(datetime(2026, 6, 1, 12, 0), tz) == utc("2026-06-01 10:00")


# -- arithmetic ------------------------------------------------------------------------------


def test_interval_fires_are_anchored_to_the_origin():
    spec = Every(10_000)
    assert next_after(spec, 1_000_005, 1_000_000, timezone.utc) == 1_010_000
    assert next_after(spec, 1_010_000, 1_000_000, timezone.utc) == 1_020_000
    assert next_after(spec, 999_999, 1_000_000, timezone.utc) == 1_000_000
    assert latest_at_or_before(spec, 1_025_000, 1_000_000, timezone.utc) == 1_020_000
    assert period_ms(spec, 1_020_000, 1_000_000, timezone.utc) == 10_000


def test_latest_at_or_before_cron_is_the_inverse_of_next_after():
    tz = zone("America/New_York")
    spec = Cron.from_fields(minute="0,30", hour="1-3")
    for start in ("2026-11-01 04:10", "2026-03-08 06:50", "2026-03-08 07:10", "2026-11-01 06:40"):
        t = utc(start)
        prev = latest_at_or_before(spec, t, 0, tz)
        assert prev is not None and prev <= t
        assert next_after(spec, prev, 0, tz) > t


def test_weekday_and_month_day_both_must_match_as_celery():
    spec = Cron.from_fields(minute="0", hour="9", day_of_week="mon", day_of_month="1-7")
    got = fires(spec, "UTC", "2026-01-01 00:00", "2026-04-01 00:00")
    assert got == ["2026-01-05 09:00", "2026-02-02 09:00", "2026-03-02 09:00"]


# -- parsing -----------------------------------------------------------------------------------


def test_parse_spec_accepts_celery_objects_numbers_and_lines():
    assert parse_spec(30) == Every(30_000)
    assert parse_spec(0.5) == Every(500)
    assert parse_spec(timedelta(minutes=2)) == Every(120_000)
    assert parse_spec(schedule(timedelta(seconds=5))) == Every(5_000)
    c = parse_spec(crontab(minute="*/15", hour="9-17", day_of_week="mon-fri"))
    assert isinstance(c, Cron) and c.minutes == (0, 15, 30, 45) and c.weekdays == frozenset({1, 2, 3, 4, 5})
    assert parse_spec("*/15 9-17 * * mon-fri") == c
    assert parse_spec(c.to_json()) == c
    assert parse_spec(Every(5_000).to_json()) == Every(5_000)


@pytest.mark.parametrize("bad", [0, -1, 0.05, float("nan"), float("inf"), float("-inf"), 1e12, MAX_INTERVAL_S + 1,
                                 timedelta(days=366 * 400), {"every_ms": 10**15}, True, "* * *", "61 * * * *",
                                 {"x": 1}, object()])
def test_parse_spec_refuses_bad_input_clearly(bad):
    with pytest.raises(InvalidOption):
        parse_spec(bad)


def test_an_interval_is_bounded_by_the_longest_delay_so_its_fire_times_stay_dates():
    with pytest.raises(InvalidOption, match=r"between 0.1 s and 10,000,000,000 s .*got 1000000000000.0"):
        parse_spec(1e12)
    longest = parse_spec(MAX_INTERVAL_S)
    assert longest == Every(MAX_INTERVAL_S * 1000)
    now = utc("2026-01-01 00:00")
    fire = next_after(longest, now, now, timezone.utc)
    assert datetime.fromtimestamp(fire / 1000, timezone.utc).year == 2342  # a date, due before the year 5138


def test_solar_and_unknown_zone_are_refused():
    with pytest.raises(InvalidOption, match="solar"):
        parse_spec(object.__new__(solar))
    with pytest.raises(InvalidOption, match="time zone"):
        zone("Mars/Olympus")


def test_a_cron_that_never_fires_is_refused():
    with pytest.raises(InvalidOption, match="never occurs"):
        Cron.from_fields(minute="0", hour="0", day_of_month="31", month_of_year="2")


def test_a_rare_cron_is_found_years_ahead():
    leap_monday = Cron.from_fields(minute="0", hour="0", day_of_month="29", month_of_year="2", day_of_week="mon")
    assert iso(next_after(leap_monday, utc("2026-01-01 00:00"), 0, timezone.utc)) == "2044-02-29 00:00"


# -- properties over random crons, zones and instants ----------------------------------------


ZONES = ["Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata", "UTC",
         "America/St_Johns", "Pacific/Chatham", "Europe/London"]
_2026 = utc("2026-01-01 00:00")
_YEAR_MS = 366 * 86_400_000


@st.composite
def crons(draw):
    minutes = draw(st.sets(st.integers(0, 59), min_size=1, max_size=4))
    hours = draw(st.one_of(st.just("*"), st.sets(st.integers(0, 23), min_size=1, max_size=4).map(
        lambda s: ",".join(map(str, sorted(s))))))
    dow = draw(st.sampled_from(["*", "mon-fri", "sun", "sat,sun"]))
    return Cron.from_fields(minute=",".join(map(str, sorted(minutes))), hour=hours, day_of_week=dow)


@settings(max_examples=150, deadline=None)
@given(spec=crons(), zone_name=st.sampled_from(ZONES), t=st.integers(_2026, _2026 + _YEAR_MS))
def test_next_and_latest_agree_and_fires_increase(spec, zone_name, t):
    tz = zone(zone_name)
    nxt = next_after(spec, t, 0, tz)
    assert nxt > t
    prev = latest_at_or_before(spec, t, 0, tz)
    assert prev is not None and prev <= t
    assert next_after(spec, prev, 0, tz) == nxt  # nothing fires between them
    got = fires_between(spec, t, t + 3 * 86_400_000, 0, tz, limit=10_000)
    assert all(a < b for a, b in itertools.pairwise(got))
    # each fire shows a wall time the cron names (or is the jump of a gap the cron named a time in)
    for f in got[:50]:
        wall = datetime.fromtimestamp(f / 1000, tz)
        named = wall.minute in spec.minutes and wall.hour in spec.hours
        jumped = wall.utcoffset() != datetime.fromtimestamp(f / 1000 - 1, tz).utcoffset()
        assert named or jumped, (zone_name, wall)


@settings(max_examples=100, deadline=None)
@given(period_s=st.integers(1, 90_000), origin=st.integers(0, 10**12), t=st.integers(0, 10**12))
def test_interval_fires_are_elapsed_multiples_of_the_period_from_the_origin(period_s, origin, t):
    spec = Every(period_s * 1000)
    nxt = next_after(spec, t, origin, timezone.utc)
    prev = latest_at_or_before(spec, t, origin, timezone.utc)
    assert prev is not None and prev <= t < nxt == prev + spec.period_ms
    assert (nxt - origin) % spec.period_ms == 0
