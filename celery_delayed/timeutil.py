"""Turn ``when`` into a due time. Pure: no Redis, no clock but the one passed in."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone, tzinfo

from .errors import InvalidWhen

#: Largest |epoch ms| a due time may have: Lua formats numbers with "%.14g", so
#: a 15-digit time would come back from the scripts in exponent notation.
MAX_DUE_MS = 10**14 - 1  # about the year 5138
#: Longest delay (about 316 years), so that now + delay stays under MAX_DUE_MS.
MAX_DELAY_MS = 10**13


def due_spec(when: object, tz: tzinfo) -> str:
    """Return the due time as the schedule script takes it.

    ``"<ms>"`` is an absolute epoch time in milliseconds (from a datetime);
    ``"+<ms>"`` is a delay that the script adds to the Redis server's clock
    (from a timedelta or a number of seconds), so an app server's skewed clock
    cannot move a job.

    Args:
        when: an aware datetime; a naive datetime, read in ``tz`` as Celery
            reads a naive ``eta``; a non-negative timedelta; or a non-negative
            number of seconds. A time in the past means "as soon as possible".
        tz: the app's timezone (``app.timezone``).

    Raises:
        InvalidWhen: for any other type, NaN, infinity, a negative delay, a
            delay over :data:`MAX_DELAY_MS` or a datetime beyond :data:`MAX_DUE_MS`.
    """
    if isinstance(when, datetime):
        aware = when if when.tzinfo is not None and when.utcoffset() is not None else localize(when, tz)
        try:
            ms = math.floor(aware.timestamp() * 1000)
        except (OverflowError, ValueError, OSError) as exc:
            raise InvalidWhen(f"when {when!r} cannot be converted to an epoch time: {exc}") from exc
        if abs(ms) > MAX_DUE_MS:
            raise InvalidWhen(f"when {when!r} is too far away; the latest supported due time is the year 5138")
        return str(ms)
    if isinstance(when, timedelta):
        return _delay(when.total_seconds(), repr(when))
    if isinstance(when, bool) or not isinstance(when, (int, float)):
        raise InvalidWhen(
            f"when must be a datetime, a timedelta or a number of seconds, "
            f"got {type(when).__name__} {when!r}"
        )
    try:
        seconds = float(when)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    return _delay(seconds, repr(when))


def _delay(seconds: float, shown: str) -> str:
    if math.isnan(seconds) or math.isinf(seconds):
        raise InvalidWhen(f"when must be a finite delay, got {shown}")
    if seconds < 0:
        raise InvalidWhen(
            f"when is a negative delay ({shown}); pass 0 to run as soon as possible, "
            "or a datetime for a fixed time"
        )
    if seconds * 1000 > MAX_DELAY_MS:
        raise InvalidWhen(
            f"when is a delay of {shown}, over the limit of {MAX_DELAY_MS // 1000} seconds (about 316 years)"
        )
    return f"+{math.ceil(seconds * 1000)}"


def eta_iso(when: object, tz: tzinfo) -> str:
    """The ``eta`` of ``when`` as Celery writes it in a message (ISO 8601), for a ``when`` that
    :func:`due_spec` accepted: a datetime as given (a naive one read in ``tz``); a delay added
    to this host's clock, in ``tz`` (as ``apply_async(countdown=)`` does).

    The due time itself is the store's (the Redis server's clock); this is what the task sees
    as ``request.eta``.
    """
    if isinstance(when, datetime):
        aware = when if when.tzinfo is not None and when.utcoffset() is not None else localize(when, tz)
        return aware.isoformat()
    seconds = when.total_seconds() if isinstance(when, timedelta) else float(when)  # type: ignore[arg-type]
    return (datetime.now(tz) + timedelta(seconds=seconds)).isoformat()


def eta_is_due(due: str, tz: tzinfo) -> bool:
    """Whether the ``eta`` of a job due at ``due`` (a :func:`due_spec`) may be its due time by the store's clock.

    True for a delay in an app whose timezone is UTC: :func:`eta_iso` would
    write the same instant as it (in ``+00:00``), give or take this host's
    clock and the round trip. A compact record then renders the header from
    its due time (``store/compact.py``), as the scripts that move a job do.
    """
    return due.startswith("+") and tz.utcoffset(None) == timedelta(0)


def localize(naive: datetime, tz: tzinfo) -> datetime:
    """A naive datetime read in ``tz`` (pytz zones through their ``localize``)."""
    pytz_localize = getattr(tz, "localize", None)  # pytz-style zones
    if callable(pytz_localize):
        out: datetime = pytz_localize(naive)
        return out
    return naive.replace(tzinfo=tz)


def from_ms(ms: int) -> datetime:
    """Return the aware UTC datetime of an epoch time in milliseconds."""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def to_ms(dt: datetime) -> int:
    """Return the epoch milliseconds of an aware datetime."""
    return math.floor(dt.timestamp() * 1000)
