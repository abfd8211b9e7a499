"""``celery -A proj delayed schedules ...``: recurring schedules at run time.

Commands: ``list``, ``show NAME``, ``add NAME TASK (--every SECONDS | --cron
"m h dom mon dow") [--no-strict]``, ``remove NAME``, ``pause NAME``, ``resume NAME``,
``run-now NAME``, ``import --from {redbeat,django-celery-beat} [--dry-run]``. A run-time
change wins over ``delayed_schedule`` until that config entry itself changes (:mod:`celery_delayed.schedules`).
"""

from __future__ import annotations

import json

import click

from ..cli._common import app_of, delayed, errors, fmt_ms, json_line
from ..errors import InvalidOption, UnknownTask
from . import api as _schedules
from .definition import MISFIRE_POLICIES


@delayed.group(name="schedules")
def schedules() -> None:
    """Recurring schedules: occurrences are ordinary delayed jobs, created ahead by the schedulers."""


@schedules.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """List every recurring schedule with its next fire time."""
    with errors():
        rows = _schedules.list(app_of(ctx))
    for s in rows:
        if as_json:
            click.echo(json_line(s.as_dict()))
            continue
        if s.error:
            click.echo(f"{s.name}  {s.task}  {s.error}  from={s.source}")
            continue
        state = "paused" if s.paused else f"next {fmt_ms(s.next_fire_ms)}"
        tz = "" if s.timezone == "-" else f" ({s.timezone})"
        click.echo(f"{s.name}  {s.task}  {s.schedule}{tz}  {state}  misfire={s.misfire}  from={s.source}")
    if not as_json:
        click.echo(f"({len(rows)} schedule(s))", err=True)


@schedules.command()
@click.argument("name")
@click.pass_context
def show(ctx: click.Context, name: str) -> None:
    """Show one schedule: definition, next fire time and recent occurrences (job ids)."""
    with errors():
        s = _schedules.get(app_of(ctx), name)
    shown = s.as_dict()
    shown["next_fire"] = fmt_ms(s.next_fire_ms)
    shown["occurrences"] = [f"{job_id} {fmt_ms(fire)}" for job_id, fire in s.occurrences]
    click.echo(json.dumps(shown, indent=2, sort_keys=True, ensure_ascii=False))
    if s.error:
        click.echo(f"schedule {name}: {s.error}", err=True)


@schedules.command()
@click.argument("name")
@click.argument("task")
@click.option("--every", "every_s", type=float, default=None, help="Interval in seconds (elapsed time).")
@click.option("--cron", default=None, help='A five-field cron line: "minute hour day-of-month month day-of-week".')
@click.option("--args", "args_json", default="[]", show_default=True, help="The task's args, a JSON list.")
@click.option("--kwargs", "kwargs_json", default="{}", show_default=True, help="The task's kwargs, a JSON object.")
@click.option("--timezone", "tz", default=None, help="IANA zone of a cron (default: the app's timezone).")
@click.option("--misfire", type=click.Choice(MISFIRE_POLICIES), default="latest", show_default=True,
              help="Occurrences an outage missed: run the latest once, none, or each.")
@click.option("--queue", default=None, help="Send occurrences to this queue.")
@click.option("--skip-if-running", is_flag=True, help="Skip an occurrence while the previous one still runs.")
@click.option("--strict/--no-strict", default=True, show_default=True,
              help="Refuse a TASK this app does not register, as apply_later does; --no-strict for a task "
                   "that only the workers define.")
@click.pass_context
def add(ctx: click.Context, name: str, task: str, every_s: float | None, cron: str | None, args_json: str,
        kwargs_json: str, tz: str | None, misfire: str, queue: str | None, skip_if_running: bool,
        strict: bool) -> None:
    """Add a schedule (or replace the one named NAME); nothing is stored when any of it is wrong."""
    if (every_s is None) == (cron is None):
        raise click.UsageError("give one of --every SECONDS or --cron LINE")
    try:
        args, kwargs = json.loads(args_json), json.loads(kwargs_json)
    except ValueError as exc:
        raise click.UsageError(f"--args / --kwargs must be JSON: {exc}") from exc
    with errors():
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise InvalidOption("--args must be a JSON list and --kwargs a JSON object")
        try:
            s = _schedules.add(app_of(ctx), name, task, every_s if every_s is not None else cron, args, kwargs,
                               {"queue": queue} if queue else {}, timezone=tz, misfire=misfire,
                               skip_if_running=skip_if_running, strict=strict)
        except UnknownTask as exc:
            raise UnknownTask(str(exc).replace("pass strict=False", "pass --no-strict")) from exc
    click.echo(f"schedule {s.name}: {s.task} {s.schedule}, next {fmt_ms(s.next_fire_ms)}")


@schedules.command()
@click.argument("name")
@click.pass_context
def remove(ctx: click.Context, name: str) -> None:
    """Remove a schedule and cancel its pending occurrences."""
    with errors():
        n = _schedules.remove(app_of(ctx), name)
    click.echo(f"removed schedule {name} ({n} pending occurrence(s) cancelled)")


@schedules.command()
@click.argument("name")
@click.pass_context
def pause(ctx: click.Context, name: str) -> None:
    """Pause a schedule (its pending occurrences are cancelled)."""
    with errors():
        changed = _schedules.pause(app_of(ctx), name)
    click.echo(f"paused schedule {name}" if changed else f"schedule {name} was paused already")


@schedules.command()
@click.argument("name")
@click.pass_context
def resume(ctx: click.Context, name: str) -> None:
    """Resume a paused schedule from now on."""
    with errors():
        changed = _schedules.resume(app_of(ctx), name)
    click.echo(f"resumed schedule {name}" if changed else f"schedule {name} was not paused")


@schedules.command(name="run-now")
@click.argument("name")
@click.pass_context
def run_now(ctx: click.Context, name: str) -> None:
    """Run one extra occurrence of a schedule now."""
    with errors():
        h = _schedules.run_now(app_of(ctx), name)
    click.echo(f"scheduled {h.id} now")


@schedules.command(name="import")
@click.option("--from", "source", required=True, type=click.Choice(["redbeat", "django-celery-beat"]),
              help="The scheduler to import from: redbeat's entries in Redis, or django-celery-beat's "
                   "PeriodicTask rows (in a Django project: DJANGO_SETTINGS_MODULE set).")
@click.option("--dry-run", is_flag=True, help="Print the plan; change nothing anywhere.")
@click.option("--settle", "settle_s", type=click.FloatRange(min=0), default=None,
              help="Seconds the old scheduler may still send an entry once disabled (default: 1 for redbeat; "
                   "beat_max_loop_interval + 2 for django-celery-beat).")
@click.pass_context
def import_(ctx: click.Context, source: str, dry_run: bool, settle_s: float | None) -> None:
    """Import the entries of redbeat or django-celery-beat as recurring schedules.

    Each imported entry is disabled in the old scheduler and resumes here after
    its last run there, so the old scheduler can be stopped afterwards with no
    occurrence run twice or skipped. What cannot be imported is listed with the
    reason and left as it is.
    """
    from .importers import import_schedules

    with errors():
        report = import_schedules(app_of(ctx), source, dry_run=dry_run, settle_s=settle_s)
    verb = "would import" if dry_run else "imported"
    for item in report.imported:
        when = "paused" if item.next_ms is None else f"next {fmt_ms(item.next_ms)}"
        job = f"  job {item.job_id}" if item.job_id else ""
        click.echo(f"{verb} {item.name}  {item.task}  {item.what}  {when}  old entry: {item.old}{job}")
        for note in item.dropped:
            click.echo(f"  left out of {item.name}: {note}")
    if report.not_imported:
        click.echo(f"not imported ({len(report.not_imported)}):")
        for n in report.not_imported:
            click.echo(f"  {n.name}: {n.reason}")
    tail = " (dry run: nothing changed)" if dry_run else ""
    click.echo(f"{len(report.imported)} entr{'y' if len(report.imported) == 1 else 'ies'} {verb} from "
               f"{report.source}, {len(report.not_imported)} not imported{tail}", err=True)
    if report.failed:
        raise SystemExit(1)
