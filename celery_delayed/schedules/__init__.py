"""Recurring schedules: ``delayed_schedule`` and the run-time API (list, get, add, remove, pause, resume, run_now).

A recurring schedule is a chain of ordinary delayed jobs. Each occurrence's
id derives from the schedule's name, its version (bumped by every change)
and its fire time (uuid5), and lives in the shard of the schedule's name, so
two schedulers can never create one occurrence twice. The scheduler holding
that shard keeps the next occurrences stored ahead of time
(:mod:`.keeper`), so the next one exists before
the current one is released.

Entries are declared like Celery's ``beat_schedule``::

    app.conf.delayed_schedule = {
        "nightly-report": {"task": "reports.nightly", "schedule": crontab(hour=2, minute=30),
                           "timezone": "Europe/Berlin"},
        "poll": {"task": "feeds.poll", "schedule": 30.0, "args": ("main",)},
    }

with, beside beat's keys, ``timezone`` (an IANA name; default the app's
``timezone``, else UTC), ``misfire`` (what an outage's missed occurrences
do: ``"latest"`` runs the latest once, the default; ``"skip"`` runs none;
``"each"`` runs each, at most ``delayed_schedule_catch_up_max``).
Fire times follow :mod:`.rules` (DST rules).

The feature, one module each: :mod:`.definition` (an entry checked and
stored), :mod:`.rules` (fire times: intervals, cron lines, DST),
:mod:`.occurrences` (fire times made delayed jobs, stored ahead),
:mod:`.keeper` (the scheduler's thread that stores them ahead),
:mod:`.api` (the run-time functions this package exports) and :mod:`.cli`
(``celery -A proj delayed schedules ...``). The store keeps the schedules
through its facet :class:`~celery_delayed.store.schedules.ScheduleRecords`.
"""

from __future__ import annotations

from .api import Schedule, add, get, list, pause, remove, resume, run_now
from .definition import MISFIRE_POLICIES

__all__ = ["MISFIRE_POLICIES", "Schedule", "add", "get", "list", "pause", "remove", "resume", "run_now"]
