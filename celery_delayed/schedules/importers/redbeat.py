"""Import from redbeat: its entries in Redis, read, disabled and re-read with redbeat's own code.

redbeat keeps each entry in a hash (its definition and its ``meta``, with
``last_run_at``) under ``redbeat_key_prefix`` and every entry's key in its
schedule sorted set. Its scheduler reads an entry again at each tick, so an
entry saved with ``enabled=False`` is not sent again once a tick in progress
has ended (:attr:`RedbeatSource.settle_s`).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from ...errors import ConfigurationError
from .entry import OldEntry
from .options import split_options


def _redbeat() -> Any:
    try:
        from redbeat import schedulers
    except ImportError as exc:
        raise ConfigurationError("importing from redbeat needs the package celery-redbeat in this environment "
                                 "(pip install celery-redbeat, the version the old scheduler runs)") from exc
    return schedulers


def _ms(when: Any) -> int | None:
    return None if when is None else round(when.timestamp() * 1000)


class RedbeatSource:
    """The entries of the app's redbeat (``redbeat_redis_url``, ``redbeat_key_prefix``)."""

    label = "redbeat"
    #: a tick that read an entry before it was disabled sends it within moments
    settle_s = 1.0

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.rb = _redbeat()
        self.conf = self.rb.ensure_conf(app)

    def describe_disable(self) -> str:
        """What the import does to an enabled old entry."""
        return "disabled in redbeat (enabled=False)"

    def sync(self) -> bool:
        """Nothing to ask: redbeat records each run in Redis as it sends it."""
        return False

    def read(self) -> list[OldEntry]:
        """Every entry of redbeat's schedule, sorted by name."""
        keys = self.rb.get_redis(self.app).zrange(self.conf.schedule_key, 0, -1)
        out = []
        for key in keys:
            try:
                e = self.rb.RedBeatSchedulerEntry.from_key(key, app=self.app)
            except KeyError:  # removed meanwhile
                continue
            except Exception as exc:  # a definition redbeat cannot decode
                name = str(key)[len(self.conf.key_prefix):]
                out.append(OldEntry(name, "?", None, [], {}, {}, None, False, None,
                                    problem=f"redbeat cannot read it: {exc}", ref=key))
                continue
            out.append(self._entry(e))
        return sorted(out, key=lambda x: x.name)

    def _entry(self, e: Any) -> OldEntry:
        from celery.schedules import crontab, schedule, solar

        sched = e.schedule
        problem = ""
        if isinstance(sched, solar):
            problem = "a solar schedule: celery-delayed has none (use a cron at the times it fires)"
        elif not isinstance(sched, crontab | schedule):
            problem = (f"a {type(sched).__name__} schedule: celery-delayed has intervals and crons only "
                       "(add it with delayed schedules add)")
        options, dropped = split_options(e.options or {}, recurring=True)
        return OldEntry(
            name=e.name, task=e.task, schedule=sched, args=list(e.args or ()), kwargs=dict(e.kwargs or {}),
            options=options, timezone=None, enabled=bool(e.enabled), last_run_ms=_ms(e.last_run_at),
            runs=int(getattr(e, "total_run_count", 0) or 0), problem=problem, dropped=tuple(dropped), ref=e.key)

    def disable(self, entry: OldEntry) -> None:
        """Save the entry with ``enabled=False`` (redbeat's ``save``; its last run is kept)."""
        e = self.rb.RedBeatSchedulerEntry.from_key(entry.ref, app=self.app)
        e.enabled = False
        e.save()

    def reread(self, entry: OldEntry, now_ms: int) -> OldEntry:
        """The entry again (after the settle): its last run as redbeat recorded it."""
        e = self.rb.RedBeatSchedulerEntry.from_key(entry.ref, app=self.app)
        return self._entry(e)
