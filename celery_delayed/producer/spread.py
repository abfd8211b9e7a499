"""Spreading a flood: each job placed at a deterministic offset within a window after its due time.

``apply_later(..., spread=600)`` (or ``apply_later_many(..., spread=600)``,
or a task's ``delayed_spread``) moves a job due at midnight to a moment in
the ten minutes after it, chosen from its id: "every user at midnight"
becomes a ramp the broker and the workers can take, the same job always lands
at the same offset (an idempotency key's job too), and the offset is kept in
the job's record (``spr``, ms). A job due in the past (as soon as possible)
is spread over the window from now.

The offset is a hash of the id (BLAKE2b, not the CRC-32 that picks the
shard, so that a shard's jobs still spread over the whole window), scaled to
``[0, window)``.
"""

from __future__ import annotations

import hashlib
import math
import time
from datetime import datetime, timedelta
from typing import Any

from ..errors import InvalidOption
from ..timeutil import MAX_DELAY_MS, due_spec, localize


def spread_ms(value: object, what: str = "spread") -> int:
    """A spread window (seconds or a timedelta; None or 0 for none) in ms.

    Raises:
        InvalidOption: not a non-negative, finite number of seconds within the longest delay.
    """
    if value is None:
        return 0
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds < 0:
        raise InvalidOption(f"{what} must be a non-negative number of seconds or a timedelta, got {value!r}")
    ms = round(seconds * 1000)
    if ms > MAX_DELAY_MS:
        raise InvalidOption(f"{what} is {seconds} s, over the longest delay ({MAX_DELAY_MS // 1000} s)")
    return ms


def offset_ms(job_id: str, window_ms: int) -> int:
    """The job's offset within a window of ``window_ms``: the same for the same id, in ``[0, window_ms)``."""
    if window_ms <= 0:
        return 0
    h = int.from_bytes(hashlib.blake2b(job_id.encode("utf-8"), digest_size=8).digest(), "big")
    return h * window_ms >> 64


def spread_when(when: object, offset: int, tz: Any) -> object:
    """``when`` moved ``offset`` ms later (a time already past: ``offset`` ms from now).

    Raises:
        InvalidWhen: ``when`` is not a due time (as :func:`~celery_delayed.timeutil.due_spec`).
    """
    due = due_spec(when, tz)  # validates it
    if due.startswith("+"):
        return timedelta(milliseconds=int(due[1:]) + offset)
    if int(due) <= time.time() * 1000:
        return timedelta(milliseconds=offset)
    assert isinstance(when, datetime)  # (a fixed time is a datetime; delays are relative)
    # kept in its own timezone: the eta the task sees reads as the call's
    aware = when if when.tzinfo is not None and when.utcoffset() is not None else localize(when, tz)
    return aware + timedelta(milliseconds=offset)
