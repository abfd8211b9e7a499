"""``celery -A proj delayed list | show | cancel``: pending jobs and one job."""

from __future__ import annotations

import click

from ..cancellation import cancel_job
from ..store import Pending, get_store
from ._common import app_of, delayed, errors, fmt_ms, json_line, paged, show_record


@delayed.command(name="list")
@click.option("--task", default=None, help="Only jobs of this task name.")
@paged
@click.pass_context
def list_(ctx: click.Context, task: str | None, offset: int, limit: int, as_json: bool) -> None:
    """List pending (scheduled) jobs, earliest due first over all shards."""
    with errors():
        rows = Pending(get_store(app_of(ctx))).page(task=task, offset=offset, limit=limit)
    for r in rows:
        if as_json:
            click.echo(json_line(r))
        else:
            click.echo(f"{r['id']}  {fmt_ms(r['due'])}  {r['task']}  queue={r['queue']}  shard={r['shard']}")
    if not as_json:
        more = f"; next page: --offset {offset + len(rows)}" if len(rows) == limit else ""
        click.echo(f"({len(rows)} shown, offset {offset}{more})", err=True)


@delayed.command()
@click.argument("job_id")
@click.pass_context
def show(ctx: click.Context, job_id: str) -> None:
    """Show one job's record."""
    with errors():
        rec = get_store(app_of(ctx)).get(job_id)
    click.echo(show_record(rec))


@delayed.command()
@click.argument("job_id")
@click.pass_context
def cancel(ctx: click.Context, job_id: str) -> None:
    """Cancel a scheduled or queued job."""
    with errors():
        prev = cancel_job(get_store(app_of(ctx)), job_id)
    click.echo(f"cancelled {job_id} (was {prev})")
