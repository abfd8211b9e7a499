"""``celery -A proj delayed db init`` and ``delayed reconcile``: the database and the reconciler."""

from __future__ import annotations

import json

import click

from ..errors import ConfigurationError
from ..reconciler import Reconciler
from ..store import get_store
from ._common import app_of, delayed, errors


@delayed.group(name="db")
def db() -> None:
    """The relational source of truth (delayed_database_url)."""


@db.command(name="init")
@click.pass_context
def init(ctx: click.Context) -> None:
    """Create the tables and indexes (idempotent) and record the schema version."""
    with errors():
        app = app_of(ctx)
        from ..sql.rows import get_rows  # SQLAlchemy is an optional extra

        rows = get_rows(app)
        if rows is None:
            raise ConfigurationError("set delayed_database_url first: there is no database to initialise")
        version = rows.init_schema()
    click.echo(f"celery-delayed tables ready in {rows.url_shown} (schema version {version})")


@delayed.command()
@click.option("--dry-run", is_flag=True, help="Only say what would be done.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def reconcile(ctx: click.Context, dry_run: bool, as_json: bool) -> None:
    """One full reconciliation pass: lost messages released again, rows Redis lost indexed again."""
    with errors():
        app = app_of(ctx)
        report = Reconciler(app, get_store(app), dry_run=dry_run).run_pass()
    if as_json:
        click.echo(json.dumps(report.as_dict()))
        return
    for line in report.details:
        click.echo(line)
    verb = "would release" if dry_run else "released"
    click.echo(f"{verb} again {report.rereleased} lost message(s) ({report.waiting} still waiting or held, "
               f"{report.exhausted} lost after every copy); indexed again {report.reindexed} row(s) of "
               f"{report.scanned_rows}; adopted {report.adopted}, dropped {report.dropped} of "
               f"{report.scanned_jobs} Redis job(s); {report.drift} row(s) behind Redis; {report.seconds:.2f}s")

