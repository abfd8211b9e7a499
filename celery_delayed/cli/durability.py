"""``celery -A proj delayed db init|bind`` and ``delayed reconcile``: the database and the reconciler."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click
from celery import Celery

from ..errors import ConfigurationError, StoreUnavailable
from ..reconciler import Reconciler
from ..store import get_store
from ._common import app_of, delayed, errors

if TYPE_CHECKING:  # SQLAlchemy is an optional extra
    from ..sql.rows import JobRows


@delayed.group(name="db")
def db() -> None:
    """The relational source of truth (delayed_database_url)."""


@db.command(name="init")
@click.pass_context
def init(ctx: click.Context) -> None:
    """Create the tables and indexes (idempotent), record the schema version, and bind the database to this
    app's store (when its Redis answers)."""
    with errors():
        app = app_of(ctx)
        rows = _rows(app, "initialise")
        version = rows.init_schema()
    click.echo(f"celery-delayed tables ready in {rows.url_shown} (schema version {version})")
    from ..sql.binding import bind, describe

    with errors():
        try:
            held, _ = bind(get_store(app), rows)
        except StoreUnavailable as exc:
            click.echo(f"not bound to a store yet (Redis: {exc}): the first producer or scheduler binds it")
            return
    click.echo(f"bound to {describe(held)}")


@db.command(name="bind")
@click.option("--force", is_flag=True,
              help="Bind the database to this app's store even if it is bound to another one (that store's jobs "
                   "become this store's: the reconciler indexes them into this Redis).")
@click.pass_context
def bind_command(ctx: click.Context, force: bool) -> None:
    """Show the store the database's jobs belong to, binding it to this app's store if it is bound to none.

    A database holds the jobs of one store (one Redis) per delayed_key_prefix;
    another store is refused. With --force, the database is bound to this
    app's store: for a Redis that replaces the bound store without its data.
    """
    from ..sql.binding import bind, describe

    with errors():
        app = app_of(ctx)
        rows = _rows(app, "bind")
        rows.check_schema()
        held, replaced = bind(get_store(app), rows, force=force)
    if replaced is not None:
        click.echo(f"was bound to {describe(replaced)}", err=True)
    click.echo(f"the database {rows.url_shown} (prefix {rows.prefix!r}) is bound to {describe(held)}")


def _rows(app: Celery, verb: str) -> JobRows:
    from ..sql.rows import get_rows  # SQLAlchemy is an optional extra

    rows = get_rows(app)
    if rows is None:
        raise ConfigurationError(f"set delayed_database_url first: there is no database to {verb}")
    return rows


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

