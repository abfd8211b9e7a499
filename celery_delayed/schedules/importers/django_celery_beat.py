"""Import from django-celery-beat: its ``PeriodicTask`` rows, read, disabled and re-read with its own models.

Its ``DatabaseScheduler`` keeps each entry's last run in memory and writes it
to the row when it syncs, and it sees a changed row at its next tick (at
most ``beat_max_loop_interval``, 5 s by default, later). So the import first
marks the schedule changed and waits (:attr:`DjangoBeatSource.settle_s`):
the rows then hold the last runs. Disabling a row clears its
``last_run_at`` (``PeriodicTask.save``), so it is read before; a run the old
scheduler made meanwhile shows as a higher ``total_run_count`` once it has
synced again.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime, timezone
from typing import Any

from celery import Celery

from ...errors import ConfigurationError
from .entry import OldEntry
from .options import split_options

_SETUP_HINT = ("set DJANGO_SETTINGS_MODULE to the Django project's settings (the project that runs "
               "django-celery-beat), or configure Django before the command runs")


def _models() -> Any:
    """django_celery_beat's models, Django set up first if it is not yet.

    Raises:
        ConfigurationError: Django or django-celery-beat is not installed, not configured, or
            ``django_celery_beat`` is not in ``INSTALLED_APPS``.
    """
    try:
        import django
        from django.apps import apps
        from django.conf import settings
    except ImportError as exc:
        raise ConfigurationError("importing from django-celery-beat needs Django and django-celery-beat in this "
                                 "environment (pip install django-celery-beat)") from exc
    if not settings.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        raise ConfigurationError(f"importing from django-celery-beat: Django is not configured; {_SETUP_HINT}")
    if not apps.ready:
        django.setup()
    if not apps.is_installed("django_celery_beat"):
        raise ConfigurationError("importing from django-celery-beat: 'django_celery_beat' is not in the Django "
                                 "project's INSTALLED_APPS (pip install django-celery-beat, and add it)")
    from django_celery_beat import models

    return models


def _ms(when: datetime | None, naive_utc: bool) -> int | None:
    """Epoch ms of a row's datetime; a naive one is UTC with ``DJANGO_CELERY_BEAT_TZ_AWARE = False``,
    else in Django's current time zone (as Django reads it)."""
    if when is None:
        return None
    if when.tzinfo is None:
        if naive_utc:
            when = when.replace(tzinfo=timezone.utc)
        else:
            from django.utils import timezone as dj_tz

            when = dj_tz.make_aware(when)
    return round(when.timestamp() * 1000)


class DjangoBeatSource:
    """The ``PeriodicTask`` rows of the Django project's default database."""

    label = "django-celery-beat"

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.models = _models()
        from django.conf import settings

        self.naive_utc = not getattr(settings, "DJANGO_CELERY_BEAT_TZ_AWARE", True)
        #: the old scheduler sees the change at its next tick, and writes what it ran then
        self.settle_s = float(app.conf.beat_max_loop_interval or 5) + 2.0

    def describe_disable(self) -> str:
        """What the import does to an enabled old entry."""
        return "disabled in django-celery-beat (enabled=False)"

    def sync(self) -> bool:
        """Mark the schedule changed (``PeriodicTasks.update_changed``): at its next tick the old scheduler
        writes the runs it made since its last sync to the rows (``last_run_at``, ``total_run_count``)."""
        self.models.PeriodicTasks.update_changed()
        return True

    def read(self) -> list[OldEntry]:
        """Every ``PeriodicTask``, sorted by name."""
        rows = self.models.PeriodicTask.objects.select_related(
            "interval", "crontab", "solar", "clocked").order_by("name")
        return [self._entry(row) for row in rows]

    def _entry(self, row: Any) -> OldEntry:
        problem, dropped = "", []
        schedule: Any = None
        tz: str | None = None
        at_ms = None
        one_off = bool(row.one_off)
        try:
            args, kwargs = json.loads(row.args or "[]"), json.loads(row.kwargs or "{}")
        except ValueError as exc:
            args, kwargs, problem = [], {}, f"its args or kwargs are not JSON: {exc}"
        if row.solar_id is not None:
            problem = problem or (f"a solar schedule ({row.solar}): celery-delayed has none (use a cron at the "
                                  "times it fires)")
        elif row.clocked_id is not None:
            at_ms, one_off = _ms(row.clocked.clocked_time, self.naive_utc), True
        elif row.crontab_id is not None:
            schedule = row.crontab.schedule
            tz = str(row.crontab.timezone)
        elif row.interval_id is not None:
            schedule = row.interval.schedule
        else:
            problem = problem or "it has no schedule"
        raw = {"queue": row.queue, "exchange": row.exchange, "routing_key": row.routing_key,
               "priority": row.priority}
        try:
            headers = json.loads(row.headers or "{}")
        except ValueError as exc:
            headers, problem = {}, problem or f"its headers are not JSON: {exc}"
        raw["headers"] = {**(headers if isinstance(headers, dict) else {}), "periodic_task_name": row.name}
        options, notes = split_options(raw, recurring=not one_off)
        dropped += notes
        if row.expire_seconds is not None:
            if one_off:
                options["expire_seconds"] = row.expire_seconds  # made absolute by the import, from its run time
            else:
                dropped.append(f"expire_seconds={row.expire_seconds} (an expiry after each send; a late occurrence "
                               "is skipped by the misfire policy instead)")
        last = _ms(row.last_run_at, self.naive_utc)
        if last is None and row.start_time is None:  # as its scheduler: a row that never ran counts from its change
            last = _ms(row.date_changed, self.naive_utc)
        return OldEntry(
            name=row.name, task=row.task, schedule=schedule, args=args if isinstance(args, list) else [args],
            kwargs=kwargs if isinstance(kwargs, dict) else {}, options=options, timezone=tz,
            enabled=bool(row.enabled), last_run_ms=last, runs=int(row.total_run_count or 0), one_off=one_off,
            at_ms=at_ms, start_ms=_ms(row.start_time, self.naive_utc), expires_ms=_ms(row.expires, self.naive_utc),
            problem=problem, dropped=tuple(dropped), ref=row.pk)

    def disable(self, entry: OldEntry) -> None:
        """Save the row with ``enabled=False``, marked changed so that its scheduler reloads it."""
        row = self.models.PeriodicTask.objects.get(pk=entry.ref)
        row.enabled = False
        row.no_changes = False  # else PeriodicTask.save does not tell the scheduler (PeriodicTasks.changed)
        row.save(update_fields=["enabled", "last_run_at", "date_changed"])

    def reread(self, entry: OldEntry, now_ms: int) -> OldEntry:
        """The entry with the runs its scheduler made since :meth:`read` (its last run, moved by them)."""
        row = self.models.PeriodicTask.objects.get(pk=entry.ref)
        runs = int(row.total_run_count or 0)
        return dataclasses.replace(entry, runs=runs, unseen_runs=max(runs - entry.runs, 0))
