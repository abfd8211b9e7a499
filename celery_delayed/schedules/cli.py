"""``celery -A proj delayed schedules ...``: recurring schedules at run time.

Commands: ``list``, ``show NAME``, ``add NAME TASK (--every SECONDS | --cron
"m h dom mon dow") [--no-strict]``, ``remove NAME``, ``pause NAME``, ``resume NAME``,
``run-now NAME``. A run-time change wins over ``delayed_schedule`` until that
config entry itself changes (:mod:`celery_delayed.schedules`).
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
