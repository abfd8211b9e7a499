"""Misfire policy and expiry: what the release script does with a job it cannot send on time.

Both are decided at release time, inside ``release_due.lua`` / ``claim_due.lua``
(``lua/includes/misfire.lua``), from fields stored in the record when the job
is scheduled:

- ``expires`` (Celery's option: seconds from the call, or a datetime): a job
  released at or after it is not sent; its state becomes EXPIRED and
  ``reason`` says when it expired.
- ``max_lateness`` (seconds) with ``misfire``: a job released more than
  ``max_lateness`` after its due time (the schedulers were down, the backlog
  was long) is handled by the policy:

  ========  ===========================================================
  "run"     send it anyway (the default; ``max_lateness`` is ignored)
  "skip"    do not send it; state SKIPPED with the lateness in ``reason``
  "dead"    do not send it; state DEAD, the job keeps its message and is
            added to the shard's dead-letter set (``{p}:{s}:dlq``), so
            ``delayed dlq`` can show and requeue it
  ========  ===========================================================

Precedence, as Celery's ``Task.from_config``: call option (``apply_later(...,
max_lateness=60, misfire="skip")``) > task attribute (``max_lateness``,
``misfire`` on the task class) > app setting (``delayed_max_lateness_s``,
``delayed_misfire``) > default (no limit, "run").
"""

from __future__ import annotations

import math
import time
from collections.abc import MutableMapping
from datetime import datetime, timezone
from typing import Any

from ..config import SETTINGS_BY_KEY, DelayedConfig
from ..errors import InvalidOption
from ..vocab import Field

#: The misfire policies.
POLICIES: tuple[str, ...] = SETTINGS_BY_KEY["misfire"].choices
#: Options of ``apply_later`` this module consumes (they do not go into the message).
OPTIONS = ("max_lateness", "misfire")


def _policy(value: object, source: str) -> str:
    if value not in POLICIES:
        raise InvalidOption(f"{source} must be one of {POLICIES}, got {value!r}")
    return str(value)


def _lateness_ms(value: object, source: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InvalidOption(f"{source} must be a number of seconds >= 0 (or None for no limit), got {value!r}")
    return round(value * 1000)


def expires_ms(expires: object, now_s: float | None = None) -> int | None:
    """Celery's ``expires`` as epoch ms: seconds from now (as ``apply_async`` reads it) or a datetime.

    A naive datetime is read as UTC, as Celery does when ``enable_utc`` is on.
    """
    if expires is None:
        return None
    if isinstance(expires, datetime):
        if expires.tzinfo is None:
            expires = expires.replace(tzinfo=timezone.utc)
        return round(expires.timestamp() * 1000)
    if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
        raise InvalidOption(f"expires must be seconds from now or a datetime, got {expires!r}")
    return round(((time.time() if now_s is None else now_s) + expires) * 1000)


def expires_spec(expires: object) -> str | None:
    """The record's ``exp`` field: '<ms>' for a datetime, '+<ms>' for seconds from now.

    A relative ``expires`` is counted from the Redis server's clock, the one
    that decides release (``schedule.lua`` adds it to its ``now``), so an app
    server whose clock is off neither expires a job early nor keeps it late.
    """
    if expires is None:
        return None
    if isinstance(expires, datetime):
        return str(expires_ms(expires))
    if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires):
        raise InvalidOption(f"expires must be seconds from now or a datetime, got {expires!r}")
    return f"+{max(0, round(expires * 1000))}"


def check_expiry(expires: object, due: str, now_s: float | None = None) -> None:
    """Refuse an ``expires`` at or before the due time: such a job could never run.

    ``due`` is the due spec ('<ms>' or '+<ms>'). Two relative times (seconds
    from now) are compared as they are; otherwise the relative one is read
    on this host's clock, as Celery reads ``expires``.

    Raises:
        InvalidOption: the job would expire before it is due.
    """
    if expires is None:
        return
    now_s = time.time() if now_s is None else now_s
    relative_due = due.startswith("+")
    due_ms = int(due[1:]) if relative_due else int(due)
    if relative_due and not isinstance(expires, datetime):
        late = float(expires) * 1000 <= due_ms  # type: ignore[arg-type]
    else:
        exp = expires_ms(expires, now_s)
        late = exp is not None and exp <= (now_s * 1000 + due_ms if relative_due else due_ms)
    if late:
        raise InvalidOption(
            f"expires={expires!r} is at or before the due time, so the job could never run; "
            "give a later expires (seconds from now or a datetime after `when`), or none"
        )


def release_fields(options: MutableMapping[str, Any], task: Any, config: DelayedConfig) -> dict[str, str]:
    """Pop ``max_lateness`` / ``misfire`` from ``options``; return the record fields for release.

    Returns ``{"exp": ..., "ml": ..., "mf": ...}`` (only the ones that apply),
    epoch ms / ms / policy as strings. ``expires`` stays in ``options``: it
    also goes into the message, where the worker honours it as usual.

    Raises:
        InvalidOption: a value of the wrong type or an unknown policy; nothing is stored.
    """
    called = {k: options[k] for k in OPTIONS if k in options}
    if "misfire" in options:
        mf = _policy(options.pop("misfire"), "misfire")
    elif getattr(task, "misfire", None) is not None:
        mf = _policy(task.misfire, f"{getattr(task, 'name', 'task')}.misfire")
    else:
        mf = _policy(config.misfire, "delayed_misfire")
    if "max_lateness" in options:
        ml = _lateness_ms(options.pop("max_lateness"), "max_lateness")
    elif getattr(task, "max_lateness", None) is not None:
        ml = _lateness_ms(task.max_lateness, f"{getattr(task, 'name', 'task')}.max_lateness")
    else:
        ml = None if config.max_lateness_s is None else round(config.max_lateness_s * 1000)
    # A call option that would be silently ignored is refused instead.
    if (call_mf := called.get("misfire")) and call_mf != "run" and ml is None:
        raise InvalidOption(
            f"misfire={call_mf!r} needs max_lateness (seconds): pass max_lateness=, set it on "
            "the task or set delayed_max_lateness_s"
        )
    if called.get("max_lateness") is not None and "misfire" not in called and mf == "run":
        raise InvalidOption(
            "max_lateness has no effect with misfire='run' (the default): pass misfire='skip' or "
            "'dead', set it on the task or set delayed_misfire"
        )
    out: dict[str, str] = {}
    exp = expires_spec(options.get("expires"))
    if exp is not None:
        out[Field.EXPIRES] = exp
    if ml is not None and mf != "run":
        out[Field.MAX_LATENESS], out[Field.MISFIRE] = str(ml), mf
    return out
