"""A schedule's definition: an entry of ``delayed_schedule`` (or a run-time ``add``), checked and stored as JSON."""

from __future__ import annotations

import builtins
import hashlib
import json
import time
from collections.abc import Mapping
from datetime import datetime, timezone, tzinfo
from typing import Any

from celery import Celery

from ..errors import DelayedError, InvalidOption, UnknownTask
from ..producer.message import task_defaults
from ..producer.prepare import check_str, lookup_task, prepare
from ..store import get_store
from ..store.schedules import StoredSchedule
from ..timeutil import MAX_DUE_MS
from .rules import (
    Spec,
    next_after,
    parse_spec,
    spec_digest,
    zone,
)

#: What the occurrences an outage missed do: run the latest once, run none, run each (capped).
MISFIRE_POLICIES = ("latest", "skip", "each")
#: Keys an entry may have (``relative`` is beat's; it has no meaning here and is ignored).
_ENTRY_KEYS = frozenset({"task", "schedule", "args", "kwargs", "options", "timezone", "misfire",
                         "skip_if_running", "relative"})
_MAX_NAME_BYTES = 200
#: The fields of a stored definition and their types (``skip_if_running`` may be missing).
_STORED_FIELDS: dict[str, type] = {
    "task": str, "spec": dict, "args": builtins.list, "kwargs": dict, "options": dict, "timezone": str,
    "misfire": str}


def definition(app: Celery, name: str, entry: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """Validate a schedule entry and return its stored form (JSON-safe).

    Raises:
        InvalidOption: a bad name, key, task, schedule, zone, misfire policy
            or arguments that are not JSON-serializable; nothing is stored.
        UnknownTask: with ``strict``, a task this app does not define.
    """
    check_str("schedule name", name, _MAX_NAME_BYTES)
    if not isinstance(entry, Mapping):
        raise InvalidOption(f"schedule {name!r}: an entry is a dict (task, schedule, ...), got {entry!r}")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise InvalidOption(f"schedule {name!r}: unknown key(s) {sorted(unknown)}; "
                            f"an entry has {sorted(_ENTRY_KEYS - {'relative'})}")
    task = entry.get("task")
    if not isinstance(task, str) or not task:
        raise InvalidOption(f"schedule {name!r}: 'task' must be a task name, got {task!r}")
    try:
        lookup_task(app, task, strict)
    except UnknownTask as exc:
        raise UnknownTask(f"schedule {name!r}: {exc}") from exc
    if "schedule" not in entry:
        raise InvalidOption(f"schedule {name!r}: 'schedule' is missing (a crontab, an interval or seconds)")
    try:
        spec = parse_spec(entry["schedule"])
        tz_name = _zone_name(app, entry.get("timezone"))
        first_fire(spec, _now_ms(), zone(tz_name))
    except InvalidOption as exc:
        raise InvalidOption(f"schedule {name!r}: {exc}") from exc
    misfire = entry.get("misfire", "latest")
    if misfire not in MISFIRE_POLICIES:
        raise InvalidOption(f"schedule {name!r}: misfire must be one of {MISFIRE_POLICIES}, got {misfire!r}")
    args, kwargs, options = entry.get("args") or (), entry.get("kwargs") or {}, entry.get("options") or {}
    if not (isinstance(args, builtins.list | tuple) and isinstance(kwargs, Mapping) and isinstance(options, Mapping)):
        raise InvalidOption(f"schedule {name!r}: args must be a list, kwargs and options dicts")
    out = {"task": task, "spec": spec.to_json(), "args": builtins.list(args), "kwargs": dict(kwargs),
           "options": dict(options), "timezone": tz_name, "misfire": misfire,
           "skip_if_running": bool(entry.get("skip_if_running", False))}
    try:
        json.dumps(out)
    except (TypeError, ValueError) as exc:
        raise InvalidOption(f"schedule {name!r}: args, kwargs and options must be JSON-serializable: {exc}") from exc
    task_type = app.tasks.get(task)
    try:  # the occurrence's call, validated once now rather than at every fire time (writes nothing)
        prepare(app, get_store(app), task, out["args"], out["kwargs"], 0, shard_key=name, task_type=task_type,
                options=(task_defaults(task_type) if task_type is not None else {}) | out["options"])
    except DelayedError as exc:
        raise InvalidOption(f"schedule {name!r}: {exc}") from exc
    return out


def _zone_name(app: Celery, tz: object) -> str:
    """An entry's time zone: its own (a non-empty name), else the app's ``timezone``, else UTC."""
    if tz is None:
        app_tz = app.conf.timezone
        return str(app_tz) if app_tz else "UTC"
    if not isinstance(tz, str) or not tz.strip():
        raise InvalidOption(f"timezone must be an IANA name such as 'Europe/Berlin', got {tz!r}; "
                            "leave it out for the app's timezone")
    return tz


def _now_ms() -> int:
    return int(time.time() * 1000)


def first_fire(spec: Spec, now_ms: int, tz: tzinfo) -> int:
    """The first fire time after ``now_ms`` of a schedule that starts now, checked to be a valid due time.

    Raises:
        InvalidOption: it does not fire, or not before the latest due time the store takes.
    """
    try:
        fire = next_after(spec, now_ms, now_ms, tz)
        datetime.fromtimestamp(fire / 1000, timezone.utc)
    except (ValueError, OverflowError, ArithmeticError) as exc:
        raise InvalidOption(f"{spec.describe()} has no fire time a date can hold ({exc})") from exc
    if fire > MAX_DUE_MS:
        raise InvalidOption(f"{spec.describe()} first fires after the latest due time the store takes "
                            "(the year 5138)")
    return fire


def config_hash(defn: Mapping[str, Any]) -> str:
    """The hash of a config entry's stored form: a changed entry has another."""
    return hashlib.sha1(spec_digest(defn).encode("utf-8")).hexdigest()


def config_entries(app: Celery) -> dict[str, dict[str, Any]]:
    """The app's declared schedules, validated: ``delayed_schedule``, and ``beat_schedule``
    when ``delayed_import_beat_schedule`` is set (``delayed_schedule`` wins on a shared name).

    Raises:
        InvalidOption: an entry is wrong (the message names it).
    """
    entries: dict[str, Any] = {}
    if app.conf.get("delayed_import_beat_schedule"):
        entries.update(app.conf.beat_schedule or {})
    declared = app.conf.get("delayed_schedule") or {}
    if not isinstance(declared, Mapping):
        raise InvalidOption(f"delayed_schedule must be a dict of name -> entry, got {declared!r}")
    entries.update(declared)
    return {name: definition(app, name, entry) for name, entry in entries.items()}


def spec_of(defn: Mapping[str, Any]) -> Spec:
    """The parsed schedule of a stored definition."""
    return parse_spec(defn["spec"])


def stored_problem(sched: StoredSchedule, now_ms: int) -> str | None:
    """What makes a stored schedule unusable, in words (None: nothing).

    A record written by hand, or by a version that let through what
    :func:`definition` refuses now (an interval too long for a date, say),
    cannot be computed: it is listed as broken and skipped by the
    schedulers, so that it breaks neither a listing nor the other schedules.
    """
    if sched.error:
        return sched.error
    d = sched.definition
    for key, kind in _STORED_FIELDS.items():
        if not isinstance(d.get(key), kind):
            return f"its definition has no valid {key!r} (got {d.get(key)!r})"
    if d["misfire"] not in MISFIRE_POLICIES:
        return f"its misfire policy {d['misfire']!r} is not one of {MISFIRE_POLICIES}"
    try:
        spec, tz = spec_of(d), zone(d["timezone"])
        fire = next_after(spec, max(now_ms, sched.last_ms), sched.origin_ms, tz)
        if not 0 <= fire <= MAX_DUE_MS:
            return f"its next fire time ({fire} ms) is not a due time the store takes"
        datetime.fromtimestamp(fire / 1000, timezone.utc)
    except (InvalidOption, ValueError, OverflowError, ArithmeticError) as exc:
        return str(exc)
    return None
