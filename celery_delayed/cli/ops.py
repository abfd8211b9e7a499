"""``celery -A proj delayed pause | resume | promote | doctor``: the controls operators reach for."""

from __future__ import annotations

import json

import click

from .. import controls
from ..doctor import PROBLEM, failed, findings
from ..store import get_store
from ._common import app_of, delayed, errors, fmt_ms

_LABEL = {"ok": "ok", "warning": "WARNING", "problem": "PROBLEM", "unchecked": "not checked"}


@delayed.command()
@click.option("--queue", default=None, help="Pause only the jobs of this queue.")
@click.option("--task", default=None, help="Pause only the jobs of this task name.")
@click.pass_context
def pause(ctx: click.Context, queue: str | None, task: str | None) -> None:
    """Stop releasing jobs (all, or of a queue or task); they stay scheduled until `resume`."""
    with errors():
        flags = controls.pause(app_of(ctx), queue=queue, task=task)
    click.echo(f"paused: {', '.join(flags)}")


@delayed.command()
@click.option("--queue", default=None, help="Resume only this queue's jobs.")
@click.option("--task", default=None, help="Resume only this task's jobs.")
@click.pass_context
def resume(ctx: click.Context, queue: str | None, task: str | None) -> None:
    """Lift a pause (every pause without options); held jobs are released, the misfire policy applying."""
    with errors():
        moved = controls.resume(app_of(ctx), queue=queue, task=task)
        left = controls.paused(app_of(ctx))
    click.echo(f"resumed: {moved} held job(s) back in the due set"
               + (f"; still paused: {', '.join(sorted(left))}" if left else ""))


@delayed.command()
@click.argument("job_id", required=False)
@click.option("--task", default=None, help="Every scheduled job of this task name.")
@click.option("--queue", default=None, help="Every scheduled job of this queue.")
@click.pass_context
def promote(ctx: click.Context, job_id: str | None, task: str | None, queue: str | None) -> None:
    """Run a scheduled job now (or every job of --task / --queue): its due time becomes now."""
    if bool(job_id) == bool(task or queue):
        raise click.UsageError("give either a JOB_ID or --task / --queue")
    with errors():
        app = app_of(ctx)
        if job_id:
            due = controls.promote(app, job_id)
            click.echo(f"promoted {job_id}: due {fmt_ms(due)}")
        else:
            n = controls.promote_matching(app, task=task, queue=queue)
            click.echo(f"promoted {n} job(s)")


@delayed.command()
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.pass_context
def doctor(ctx: click.Context, as_json: bool) -> None:
    """Check what silently breaks a deployment; exit 1 when a problem is found (a probe)."""
    with errors():
        found = findings(app_of(ctx), get_store(app_of(ctx)))
    if as_json:
        click.echo(json.dumps([f.as_dict() for f in found], indent=2))
    else:
        for f in found:
            click.echo(f"[{_LABEL.get(f.level, f.level)}] {f.check}: {f.message}")
            if f.fix and f.level != "ok":
                click.echo(f"    what to do: {f.fix}")
        problems = sum(1 for f in found if f.level == PROBLEM)
        click.echo(f"{problems} problem(s), {sum(1 for f in found if f.level == 'warning')} warning(s)")
    if failed(found):
        ctx.exit(1)
