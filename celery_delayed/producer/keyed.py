"""Debounce and throttle keys of ``apply_later``: validate them into a :class:`KeyedSpec`.

- ``debounce_key=K`` (with an optional ``max_wait``): a call while K's job is
  still waiting replaces that job's arguments and options and moves its due
  time to this call's ``when``, but never later than ``max_wait`` after K's
  first call; the job keeps its id. It is released when due, not a
  look-ahead early (``delayed_lookahead_ms``): every call until then reaches it.
- ``throttle_key=K, window=W``: at most one job per K per W, counted from the
  call that created it; later calls get that job back.

Either way the call returns the key's job, with ``created`` False when it
already existed. The key decides the shard (as an idempotency key does), so
the check and the write are one script (``lua/schedule_keyed.lua``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

from ..errors import InvalidOption
from .prepare import MAX_KEY_BYTES, check_str

#: The longest max_wait or window accepted, seconds (a year).
MAX_SPAN_S = 366 * 86400


@dataclass(frozen=True)
class KeyedSpec:
    """A validated debounce or throttle request."""

    mode: str  # "debounce" or "throttle"
    key: str
    limit_ms: int | None  # debounce: max_wait (None: no limit); throttle: the window


def _span_ms(name: str, value: object) -> int:
    """A positive duration (seconds or a timedelta) in ms, else :class:`InvalidOption`."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise InvalidOption(f"{name} must be a number of seconds or a timedelta, got {type(value).__name__} "
                            f"{value!r}")
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_SPAN_S:
        raise InvalidOption(f"{name} must be more than 0 and at most {MAX_SPAN_S} seconds, got {value!r}")
    return max(1, round(seconds * 1000))


def keyed_spec(
    debounce_key: object = None, max_wait: object = None, throttle_key: object = None, window: object = None,
    *, task_id: object = None, idempotency_key: object = None, connection: object = None,
    database: bool = False,
) -> KeyedSpec | None:
    """The debounce or throttle request of an ``apply_later`` call (None: neither).

    Raises:
        InvalidOption: a bad key or duration, ``max_wait`` without
            ``debounce_key``, ``window`` without ``throttle_key`` (or the
            other way round), both keys, or a key with ``task_id`` or
            ``idempotency_key`` (the key's job has an id of its own).
        ConfigurationError: with ``delayed_database_url`` (not supported).
    """
    if debounce_key is None and throttle_key is None:
        if max_wait is not None:
            raise InvalidOption("max_wait= is the limit of a debounce: give debounce_key= too")
        if window is not None:
            raise InvalidOption("window= is the span of a throttle: give throttle_key= too")
        return None
    if debounce_key is not None and throttle_key is not None:
        raise InvalidOption("give debounce_key= or throttle_key=, not both")
    which = "debounce_key" if debounce_key is not None else "throttle_key"
    if task_id is not None or idempotency_key is not None:
        raise InvalidOption(f"{which}= chooses the job itself: it cannot be combined with task_id= or "
                            "idempotency_key=")
    if database or connection is not None:
        from ..errors import ConfigurationError

        raise ConfigurationError(f"{which}= is not supported with delayed_database_url (the job's row would "
                                 "have to change with it): schedule with an idempotency_key instead")
    if debounce_key is not None:
        if window is not None:
            raise InvalidOption("window= goes with throttle_key=; a debounce takes max_wait=")
        key = check_str("debounce_key", debounce_key, MAX_KEY_BYTES)
        return KeyedSpec("debounce", key, None if max_wait is None else _span_ms("max_wait", max_wait))
    if max_wait is not None:
        raise InvalidOption("max_wait= goes with debounce_key=; a throttle takes window=")
    if window is None:
        raise InvalidOption("throttle_key= needs window= (seconds or a timedelta): one job per key per window")
    key = check_str("throttle_key", throttle_key, MAX_KEY_BYTES)
    return KeyedSpec("throttle", key, _span_ms("window", window))
