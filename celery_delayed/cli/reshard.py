"""``celery -A proj delayed reshard --shards N``: change the shard count of a live store."""

from __future__ import annotations

import click

from ..store import get_store
from ..store.reshard import Resharder, describe, report_json
from ._common import app_of, delayed, errors


@delayed.command()
@click.option("--shards", "shards", type=int, required=True, help="The new shard count.")
@click.option("--wait", "wait_s", type=click.FloatRange(0), default=600.0, show_default=True,
              help="Seconds to wait for released or running jobs of the old shards to finish and move.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def reshard(ctx: click.Context, shards: int, wait_s: float, as_json: bool) -> None:
    """Change the store's shard count live: no job lost or run twice, schedulers keep running.

    New jobs go to the new shards at once; every job, done marker, dead letter,
    debounce/throttle entry and recurring schedule out of place moves to its new
    shard. Run it again with the same --shards to finish one that stopped. Then
    set delayed_shards to the new count in your config (a process started with
    the old count is refused).
    """
    with errors():
        app = app_of(ctx)
        store = get_store(app)
        rows = None
        if store.config.database_url:
            from ..sql.binding import ensure_bound  # an optional extra: only with a database
            from ..sql.rows import get_rows

            rows = get_rows(app)
            assert rows is not None
            ensure_bound(store, rows, max_age_s=0)  # the rows of a database bound to another store are not moved
        resharder = Resharder(store, rows, progress=lambda line: click.echo(line, err=True))
        report = resharder.run(shards, wait_s=wait_s)
    click.echo(report_json(report) if as_json else describe(report))
    if not report.finished:
        ctx.exit(3)
    if store.config.shards != shards:
        click.echo(f"now set delayed_shards = {shards} in the app's config (processes started with "
                   f"{store.config.shards} are refused)", err=True)
