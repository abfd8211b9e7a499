"""due_spec: when -> '<ms>' (absolute) or '+<ms>' (relative to the Redis clock). Pure."""

from __future__ import annotations

import importlib.util
import math
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest
from support import need

from celery_delayed.errors import InvalidWhen
from celery_delayed.timeutil import due_spec, from_ms, to_ms

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")


def test_aware_datetime_is_absolute_epoch_ms() -> None:
    dt = datetime(2030, 1, 2, 3, 4, 5, 678_901, tzinfo=UTC)
    assert due_spec(dt, BERLIN) == str(int(dt.timestamp() * 1000)) == "1893553445678"
    # The same instant in another zone gives the same ms; the app timezone is ignored.
    assert due_spec(dt.astimezone(BERLIN), UTC) == "1893553445678"
    assert due_spec(dt.astimezone(timezone(timedelta(hours=-7))), UTC) == "1893553445678"


def test_naive_datetime_is_read_in_the_app_timezone() -> None:
    naive = datetime(2030, 7, 1, 12, 0, 0)
    assert due_spec(naive, UTC) == str(to_ms(naive.replace(tzinfo=UTC)))
    # Berlin is UTC+2 in July: the same wall time is two hours earlier in UTC.
    assert int(due_spec(naive, UTC)) - int(due_spec(naive, BERLIN)) == 2 * 3600 * 1000
    # ... and UTC+1 in January.
    winter = datetime(2030, 1, 1, 12, 0, 0)
    assert int(due_spec(winter, UTC)) - int(due_spec(winter, BERLIN)) == 3600 * 1000


def test_naive_datetime_with_pytz_style_zone() -> None:
    need("pytz (the test extra)", importlib.util.find_spec("pytz") is not None)  # skipped locally, failed in CI
    import pytz
    naive = datetime(2030, 7, 1, 12, 0, 0)
    assert due_spec(naive, pytz.timezone("Europe/Berlin")) == due_spec(naive, BERLIN)


def test_past_datetime_is_allowed() -> None:
    """A past time means "release as soon as possible"; the script releases it at once."""
    assert due_spec(datetime(2000, 1, 1, tzinfo=UTC), UTC) == "946684800000"
    assert due_spec(datetime(1960, 1, 1, tzinfo=UTC), UTC).startswith("-")


@pytest.mark.parametrize(
    ("when", "spec"),
    [
        (timedelta(0), "+0"),
        (timedelta(minutes=5), "+300000"),
        (timedelta(milliseconds=1.5), "+2"),  # rounded up: never released early
        (timedelta(microseconds=1), "+1"),
        (0, "+0"),
        (90, "+90000"),
        (0.25, "+250"),
        (0.0001, "+1"),
        (1.0005, "+1001"),
        (10**9, "+1000000000000"),
    ],
)
def test_delays_are_relative_ms_rounded_up(when: object, spec: str) -> None:
    assert due_spec(when, UTC) == spec


@pytest.mark.parametrize(
    "when",
    [float("nan"), float("inf"), float("-inf"), -1, -0.001, timedelta(seconds=-1), timedelta(microseconds=-1)],
)
def test_bad_numbers_raise(when: object) -> None:
    with pytest.raises(InvalidWhen) as e:
        due_spec(when, UTC)
    msg = str(e.value)
    assert "when" in msg
    if isinstance(when, float) and not math.isfinite(when):
        assert "finite" in msg
    else:
        assert "negative" in msg and "pass 0" in msg


@pytest.mark.parametrize("when", [True, False, "10", None, b"1", [1], Decimal("1"), object(), 1j])
def test_wrong_types_raise(when: object) -> None:
    with pytest.raises(InvalidWhen, match="datetime, a timedelta or a number of seconds"):
        due_spec(when, UTC)


def test_invalid_when_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        due_spec("soon", UTC)


def test_from_ms_to_ms_round_trip() -> None:
    for ms in (0, 1, 1_893_553_445_678, 946_684_800_000):
        dt = from_ms(ms)
        assert dt.tzinfo is not None and dt.utcoffset() == timedelta(0)
        assert to_ms(dt) == ms


def test_bounds_keep_due_times_exact_in_lua() -> None:
    """Lua prints numbers with %.14g: due times must stay under 10**14 ms."""
    from celery_delayed.timeutil import MAX_DELAY_MS, MAX_DUE_MS

    assert len(str(MAX_DUE_MS)) == 14
    assert due_spec(MAX_DELAY_MS / 1000, UTC) == f"+{MAX_DELAY_MS}"
    with pytest.raises(InvalidWhen, match="over the limit"):
        due_spec(MAX_DELAY_MS / 1000 + 1, UTC)
    with pytest.raises(InvalidWhen):
        due_spec(10**400, UTC)  # an int too large for a float
    with pytest.raises(InvalidWhen, match="too far away"):
        due_spec(datetime(9999, 12, 31, tzinfo=UTC), UTC)
    assert due_spec(datetime(4000, 1, 1, tzinfo=UTC), UTC) == str(to_ms(datetime(4000, 1, 1, tzinfo=UTC)))
