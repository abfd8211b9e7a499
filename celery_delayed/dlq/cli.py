"""``celery -A proj delayed dlq ...``: inspect and act on the dead-letter queue.

Commands: ``list`` (most recent first), ``show ID``, ``requeue ID`` or
``requeue --all`` (``--when SECONDS`` from now), ``purge`` (``--older-than
SECONDS``; everything without it).
"""

from __future__ import annotations

import click

from .. import dlq as _dlq
from ..cli._common import app_of, delayed, errors, fmt_ms, job_text, json_line, paged, show_record
from ..store import get_store


@delayed.group(name="dlq")
def dlq() -> None:
    """The dead-letter queue: jobs that ran out of attempts."""


@dlq.command(name="list")
@click.option("--task", default=None, help="Only letters of this task name.")
@paged
@click.pass_context
def list_(ctx: click.Context, task: str | None, offset: int, limit: int, as_json: bool) -> None:
    """List dead letters, most recent death first."""
    with errors():
        store = get_store(app_of(ctx))
        rows = _dlq.list_dead(store, offset=offset, limit=limit, task=task)
        total = _dlq.count(store)
    for r in rows:
        if as_json:
            click.echo(json_line(r.as_dict()))
        else:
            click.echo(f"{r.id}  {fmt_ms(r.died_ms)}  {r.task}  attempts={r.attempts}  {r.error[:120]}")
    if not as_json:
        click.echo(f"({len(rows)} shown, offset {offset}, {total} in all)", err=True)


@dlq.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True,
              help="Print the record as Redis keeps it (short field names), as JSON, then the traceback.")
@click.pass_context
def show(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Show one dead letter: arguments, exception, traceback, attempts, times."""
    with errors():
        store = get_store(app_of(ctx))
        rec = _dlq.show(store, job_id)
        text = None if as_json else job_text(store, rec)
    if text is not None:
        click.echo(text)
        return
    tb = rec.pop("tb", "")
    click.echo(show_record(rec))
    if tb:
        click.echo(tb.rstrip())


@dlq.command()
@click.argument("job_id", required=False)
@click.option("--all", "all_", is_flag=True, help="Requeue every dead letter.")
@click.option("--task", default=None, help="With --all: only letters of this task name.")
@click.option("--when", "when_s", default=0.0, show_default=True, type=click.FloatRange(0),
              help="Seconds from now until the requeued job is due.")
@click.pass_context
def requeue(ctx: click.Context, job_id: str | None, all_: bool, task: str | None, when_s: float) -> None:
    """Schedule a dead letter (or --all) again, with its attempt counter reset."""
    if bool(job_id) == all_:
        raise click.UsageError("give either a JOB_ID or --all")
    if task and not all_:
        raise click.UsageError("--task goes with --all")
    with errors():
        store = get_store(app_of(ctx))
        if all_:
            n = _dlq.requeue_all(store, when=when_s, task=task)
            click.echo(f"requeued {n} dead letter(s)")
        else:
            due = _dlq.requeue(store, str(job_id), when=when_s)
            click.echo(f"requeued {job_id}, due {fmt_ms(due)}")


@dlq.command()
@click.option("--older-than", "older_than", default=None, type=click.FloatRange(0),
              help="Only letters that died more than this many seconds ago (default: all).")
@click.option("--yes", is_flag=True, help="Do not ask before purging everything.")
@click.pass_context
def purge(ctx: click.Context, older_than: float | None, yes: bool) -> None:
    """Delete dead letters for good."""
    if older_than is None and not yes:
        click.confirm("purge every dead letter?", abort=True)
    with errors():
        n = _dlq.purge(get_store(app_of(ctx)), older_than=older_than)
    click.echo(f"purged {n} dead letter(s)")
