"""``celery -A proj delayed absorb``: move the broker's ETA backlog into the store."""

from __future__ import annotations

import sys
from typing import Any

import click

from ..cli._common import app_of, delayed, errors
from .absorber import absorb as _absorb


@delayed.command()
@click.option("--queue", "-Q", "queues", multiple=True, metavar="NAME",
              help="A queue to absorb (repeatable; default: every queue the app declares).")
@click.option("--dry-run", is_flag=True,
              help="Count what would move (by task and queue, and when it is due); change nothing.")
@click.option("--min-delay", "min_delay_s", type=click.FloatRange(0), default=None, metavar="S",
              help="Leave messages due in less than S seconds [default: delayed_intercept_min_delay_s].")
@click.option("--limit", type=click.IntRange(1), default=None, metavar="N", help="Stop after N jobs stored.")
@click.option("--allow-consumers", is_flag=True,
              help="RabbitMQ: read a queue even though consumers are attached (the ETA messages they hold "
                   "stay with them).")
@click.pass_context
def absorb(ctx: click.Context, queues: tuple[str, ...], dry_run: bool, min_delay_s: float | None,
           limit: int | None, allow_consumers: bool) -> None:
    """Move every task message waiting in the broker for a future eta into the store, exactly once.

    Each becomes a job under its own task id, due at its eta, with its
    headers, retries and stamps; it is taken from the broker only once its
    job is stored, so a run stopped at any point loses nothing and, run
    again, stores nothing twice. Messages that are due, or have no eta, stay
    where they are. Stop the workers first (see Migrate from ETA tasks).
    """
    with errors():
        app = app_of(ctx)
        bar = _Bar()
        try:
            report = _absorb(app, queues, dry_run=dry_run, min_delay_s=min_delay_s, limit=limit,
                             progress=bar.update, allow_consumers=allow_consumers)
        finally:
            bar.close()
    for line in report.lines():
        click.echo(line)


class _Bar:
    """A progress bar on stderr, made when the first message is read (the queues' size is known then)."""

    def __init__(self) -> None:
        self.bar: Any = None

    def update(self, n: int, total: int) -> None:
        if self.bar is None:
            self.bar = click.progressbar(length=max(total, 1), label="messages read",
                                         file=sys.stderr, show_pos=True)
            self.bar.__enter__()  # (left by close())
        self.bar.length = max(self.bar.length, total, self.bar.pos + n)
        self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
