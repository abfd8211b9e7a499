"""When a recurring schedule fires: pure fire-time arithmetic, no Redis, no clock.

A schedule is :class:`Every` (an interval, elapsed time) or :class:`Cron`
(Celery's ``crontab`` fields, read in a time zone). Times are integer epoch
milliseconds (UTC instants); a cron's wall-clock times are resolved in its
zone with :mod:`zoneinfo` by three explicit rules:

- **A local time that does not exist** (the clock jumps forward over it, e.g.
  02:30 in Europe/Berlin on the last Sunday of March) fires at the first
  valid instant after it: the instant of the jump (03:00 CEST). Several such
  times of one gap fire once, at that instant.
- **A local time that happens twice** (the clock falls back over it) fires
  once, at its first occurrence (before the fall-back).
- **An interval is elapsed time**: ``Every(3600 s)`` fires every 3,600 s of
  real time, whatever the wall clock does; its fires are ``origin + k *
  period`` for an origin the store keeps once per schedule, so every scheduler
  derives the same fire times.

Celery's ``crontab`` semantics apply: a day fires when its month, day of
month *and* day of week all match (``day_of_week`` 0 = Sunday).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ..errors import InvalidOption
from ..timeutil import MAX_DELAY_MS

#: How far ahead (and back) a cron is searched for a matching day (covers 29 February on a given weekday).
_MAX_DAYS = 366 * 30
#: The shortest interval (each occurrence is a stored job: a shorter one would be a busy loop).
MIN_INTERVAL_S = 0.1
#: The longest interval: ``apply_later``'s longest delay (about 316 years), so that every fire time
#: stays a valid due time (and a valid ``datetime``).
MAX_INTERVAL_S = MAX_DELAY_MS // 1000
#: Fields of a crontab, in the order of a five-field cron line's last three, as Celery names them.
CRON_FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")


@dataclass(frozen=True)
class Every:
    """Fire every ``period_ms`` milliseconds of elapsed time (from the schedule's origin)."""

    period_ms: int

    def to_json(self) -> dict[str, Any]:
        """The spec as stored (JSON-safe)."""
        return {"every_ms": self.period_ms}

    def describe(self) -> str:
        """A short human form (``every 30s``)."""
        s = self.period_ms / 1000
        return f"every {s:g}s"


@dataclass(frozen=True)
class Cron:
    """Fire at the wall-clock times a Celery ``crontab`` names, in its zone.

    The ``text`` fields are the crontab's own spelling (``"*/15"``, ``"mon-fri"``);
    the sets are their expansion by Celery.
    """

    text: tuple[str, str, str, str, str]  # minute, hour, day_of_month, month_of_year, day_of_week
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday, as Celery

    @classmethod
    def from_fields(cls, minute: str = "*", hour: str = "*", day_of_month: str = "*",
                    month_of_year: str = "*", day_of_week: str = "*") -> Cron:
        """A cron from Celery's crontab fields (strings, as ``crontab()`` takes them).

        Raises:
            InvalidOption: a field Celery's crontab refuses.
        """
        from celery.schedules import crontab

        try:
            c = crontab(minute=minute, hour=hour, day_of_week=day_of_week,
                        day_of_month=day_of_month, month_of_year=month_of_year)
        except Exception as exc:  # Celery raises ValueError or its own ParseException
            raise InvalidOption(f"bad crontab ({minute!r} {hour!r} {day_of_month!r} {month_of_year!r} "
                                f"{day_of_week!r}): {exc}") from exc
        return cls.from_crontab(c)

    @classmethod
    def from_crontab(cls, c: Any) -> Cron:
        """A cron from a ``celery.schedules.crontab``."""
        text = tuple(str(getattr(c, f"_orig_{f}")) for f in CRON_FIELDS)
        return cls(
            text=(text[0], text[1], text[2], text[3], text[4]),
            minutes=tuple(sorted(c.minute)), hours=tuple(sorted(c.hour)),
            days=frozenset(c.day_of_month), months=frozenset(c.month_of_year),
            weekdays=frozenset(d % 7 for d in c.day_of_week),
        )

    @classmethod
    def from_line(cls, line: str) -> Cron:
        """A cron from a five-field line: ``"minute hour day-of-month month day-of-week"``."""
        parts = line.split()
        if len(parts) != 5:
            raise InvalidOption(f"a cron line has five fields (minute hour day-of-month month day-of-week), "
                                f"got {line!r}")
        return cls.from_fields(*parts)

    def to_json(self) -> dict[str, Any]:
        """The spec as stored (JSON-safe)."""
        return {"cron": dict(zip(CRON_FIELDS, self.text, strict=True))}

    def describe(self) -> str:
        """A short human form: the five-field cron line."""
        return "cron " + " ".join(self.text)

    def matches(self, day: date) -> bool:
        """True when the schedule fires on ``day`` (a local date)."""
        return (day.month in self.months and day.day in self.days
                and (day.weekday() + 1) % 7 in self.weekdays)


Spec = Every | Cron


def parse_spec(value: object) -> Spec:
    """A schedule spec from what ``delayed_schedule`` / ``beat_schedule`` entries hold.

    Accepts Celery's ``crontab``, Celery's ``schedule`` (its ``run_every``), a
    ``timedelta``, a number of seconds, a five-field cron line, or a stored
    spec (:meth:`Every.to_json` / :meth:`Cron.to_json`).

    Raises:
        InvalidOption: anything else (Celery's ``solar`` included), or a
            period that is not positive.
    """
    from celery.schedules import crontab, schedule, solar

    if isinstance(value, Every | Cron):
        return value
    if isinstance(value, crontab):
        return Cron.from_crontab(value)
    if isinstance(value, solar):
        raise InvalidOption("solar schedules are not supported by delayed_schedule; use crontab or an interval")
    if isinstance(value, schedule):
        value = value.run_every
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, str):
        return Cron.from_line(value)
    if isinstance(value, dict):
        if "every_ms" in value:
            return _every(value["every_ms"] / 1000 if isinstance(value["every_ms"], int | float) else None)
        if isinstance(value.get("cron"), dict):
            return Cron.from_fields(**{k: str(v) for k, v in value["cron"].items() if k in CRON_FIELDS})
        raise InvalidOption(f"not a stored schedule spec: {value!r}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _every(value)
    raise InvalidOption(f"schedule must be a crontab, a celery schedule, a timedelta, seconds or a cron line, "
                        f"got {type(value).__name__} {value!r}")


def _every(seconds: object) -> Every:
    if (not isinstance(seconds, int | float) or not math.isfinite(seconds)
            or not MIN_INTERVAL_S <= seconds <= MAX_INTERVAL_S):
        raise InvalidOption(f"an interval must be between {MIN_INTERVAL_S} s and {MAX_INTERVAL_S:,} s "
                            f"(about 316 years, the longest delay apply_later takes), got {seconds!r}; "
                            "for a rare schedule use a cron line")
    return Every(round(seconds * 1000))


def zone(name: str | None) -> tzinfo:
    """The time zone ``name`` (``None`` or ``"UTC"``: UTC).

    Raises:
        InvalidOption: an unknown zone name.
    """
    if name is None or name.upper() == "UTC":
        return timezone.utc
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise InvalidOption(f"unknown time zone {name!r} (an IANA name such as 'Europe/Berlin')") from exc


# -- wall clock -> instant ------------------------------------------------------------


def _ms(ts: float) -> int:
    return round(ts * 1000)


def _local(ts: float, tz: tzinfo) -> datetime:
    return datetime.fromtimestamp(ts, tz).replace(tzinfo=None)


def local_instant(wall: datetime, tz: tzinfo) -> int:
    """The instant (epoch ms) a naive local time fires at, by the module's rules.

    Existing and unambiguous: that instant. Repeated (fall-back): the first
    one. Non-existent (spring-forward gap): the first valid instant after it,
    the instant the clock jumps.
    """
    a = wall.replace(tzinfo=tz, fold=0).timestamp()
    b = wall.replace(tzinfo=tz, fold=1).timestamp()
    if a == b:
        return _ms(a)
    lo, hi = min(a, b), max(a, b)
    if _local(lo, tz) == wall:  # repeated: both instants show it; the first one
        return _ms(lo)
    # In the gap: the clock shows less than `wall` before the jump and more after it.
    lo_s, hi_s = math.floor(lo), math.ceil(hi)
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if _local(mid, tz) > wall:
            hi_s = mid
        else:
            lo_s = mid
    return hi_s * 1000


# -- fire times -------------------------------------------------------------------------


def _cron_day(spec: Cron, day: date, tz: tzinfo, reverse: bool = False) -> Iterator[int]:
    hours = reversed(spec.hours) if reverse else iter(spec.hours)
    minutes = tuple(reversed(spec.minutes)) if reverse else spec.minutes
    for h in hours:
        for m in minutes:
            yield local_instant(datetime(day.year, day.month, day.day, h, m), tz)


def _cron_fires(spec: Cron, after_ms: int, tz: tzinfo) -> Iterator[int]:
    """A cron's fire times strictly after ``after_ms``, in order (each instant once)."""
    day = _local(after_ms / 1000, tz).date()
    last = after_ms
    for _ in range(_MAX_DAYS):
        if spec.matches(day):
            for t in _cron_day(spec, day, tz):
                if t > last:  # times of one gap share an instant: once
                    last = t
                    yield t
        day += timedelta(days=1)


def next_after(spec: Spec, after_ms: int, origin_ms: int, tz: tzinfo) -> int:
    """The first fire time strictly after ``after_ms``.

    ``origin_ms`` anchors an interval (its fires are ``origin + k * period``);
    ``tz`` is a cron's zone.

    Raises:
        InvalidOption: a cron that does not fire within 30 years.
    """
    if isinstance(spec, Every):
        k = (after_ms - origin_ms) // spec.period_ms + 1
        return origin_ms + k * spec.period_ms
    for t in _cron_fires(spec, after_ms, tz):
        return t
    raise InvalidOption(f"the cron {spec.describe()!r} never fires")


def latest_at_or_before(spec: Spec, at_ms: int, origin_ms: int, tz: tzinfo) -> int | None:
    """The last fire time at or before ``at_ms`` (None: none in the searched range)."""
    if isinstance(spec, Every):
        k = (at_ms - origin_ms) // spec.period_ms
        return origin_ms + k * spec.period_ms
    day = _local(at_ms / 1000, tz).date() + timedelta(days=1)  # a gap may move a time past midnight
    for _ in range(_MAX_DAYS):
        if spec.matches(day):
            for t in _cron_day(spec, day, tz, reverse=True):
                if t <= at_ms:
                    return t
        day -= timedelta(days=1)
    return None


def fires_between(spec: Spec, after_ms: int, until_ms: int, origin_ms: int, tz: tzinfo,
                  limit: int = 1000) -> list[int]:
    """Fire times in ``(after_ms, until_ms]``, the earliest first, at most ``limit``."""
    out: list[int] = []
    if isinstance(spec, Every):
        t = next_after(spec, after_ms, origin_ms, tz)
        while t <= until_ms and len(out) < limit:
            out.append(t)
            t += spec.period_ms
        return out
    for t in _cron_fires(spec, after_ms, tz):
        if t > until_ms or len(out) >= limit:
            break
        out.append(t)
    return out


def period_ms(spec: Spec, fire_ms: int, origin_ms: int, tz: tzinfo) -> int:
    """Time from the fire at ``fire_ms`` to the next one (the lateness after which it misfired)."""
    return next_after(spec, fire_ms, origin_ms, tz) - fire_ms


def spec_digest(entry: Any) -> str:
    """A stable text of a JSON-safe value (its keys sorted): the config hash's input."""
    return json.dumps(entry, sort_keys=True, separators=(",", ":"), default=str)


def describe_fires(fires: Iterable[int], tz: tzinfo) -> list[str]:
    """Fire times as local ISO strings (for listings)."""
    return [datetime.fromtimestamp(t / 1000, tz).isoformat() for t in fires]
