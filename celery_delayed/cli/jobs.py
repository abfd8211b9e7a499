"""``celery -A proj delayed list | show | cancel``: pending jobs, one job, cancelling one or in bulk."""

from __future__ import annotations

import click

from ..cancellation import cancel_job
from ..controls import cancel_matching
from ..store import Pending, get_store
from ._common import app_of, delayed, errors, fmt_ms, job_text, json_line, paged, show_record


@delayed.command(name="list")
@click.option("--task", default=None, help="Only jobs of this task name.")
@click.option("--tenant", default=None, help="Only this tenant's jobs (apply_later(..., tenant=...)).")
@paged
@click.pass_context
def list_(ctx: click.Context, task: str | None, tenant: str | None, offset: int, limit: int,
          as_json: bool) -> None:
    """List pending (scheduled) jobs, earliest due first over all shards."""
    if task and tenant:
        raise click.UsageError("give --task or --tenant, not both")
    with errors():
        store = get_store(app_of(ctx))
        if tenant:
            rows = store.shaping.tenant_jobs(tenant, offset=offset, limit=limit)
        else:
            rows = Pending(store).page(task=task, offset=offset, limit=limit)
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
@click.option("--json", "as_json", is_flag=True,
              help="Print the record as Redis keeps it (short field names), as JSON.")
@click.pass_context
def show(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Show one job: task, arguments, queue, due, state, attempts, then the rest of its record."""
    with errors():
        store = get_store(app_of(ctx))
        rec = store.lookup.get(job_id)
        if as_json:
            click.echo(show_record(rec))
            return
        text = job_text(store, rec)
    click.echo(text)


@delayed.command()
@click.argument("job_id", required=False)
@click.option("--task", default=None, help="Cancel every scheduled job of this task name (bulk).")
@click.option("--queue", default=None, help="Cancel every scheduled job of this queue (bulk).")
@click.option("--due-after", "due_after", default=None, type=float,
              help="Bulk: only jobs due at least this many seconds from now (negative: in the past).")
@click.option("--due-before", "due_before", default=None, type=float,
              help="Bulk: only jobs due at most this many seconds from now.")
@click.pass_context
def cancel(ctx: click.Context, job_id: str | None, task: str | None, queue: str | None,
           due_after: float | None, due_before: float | None) -> None:
    """Cancel a scheduled or queued job, or in bulk the scheduled jobs of --task / --queue in a due window."""
    bulk = bool(task or queue)
    if bool(job_id) == bulk:
        raise click.UsageError("give either a JOB_ID or --task / --queue")
    if not bulk and (due_after is not None or due_before is not None):
        raise click.UsageError("--due-after / --due-before go with --task / --queue")
    with errors():
        store = get_store(app_of(ctx))
        if job_id:
            prev = cancel_job(store, job_id)
            click.echo(f"cancelled {job_id} (was {prev})")
            return
        now = store.redis.now_ms()
        lo = None if due_after is None else now + int(due_after * 1000)
        hi = None if due_before is None else now + int(due_before * 1000)
        ids = cancel_matching(app_of(ctx), task=task, queue=queue, due_from=lo, due_to=hi)
    click.echo(f"cancelled {len(ids)} job(s)")
