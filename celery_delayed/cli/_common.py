"""What every ``delayed`` sub-command shares: the group, the app, errors, times, paging."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from celery import Celery

from .. import describe
from ..errors import DelayedError
from ..store import Store
from ..timeutil import from_ms
from ..vocab import TIME_FIELDS, Field

F = TypeVar("F", bound=Callable[..., Any])


@click.group(name="delayed")
@click.pass_context
def delayed(ctx: click.Context) -> None:
    """celery-delayed: run the scheduler, inspect and cancel delayed jobs."""


def app_of(ctx: click.Context) -> Celery:
    """The app ``celery -A`` loaded."""
    app: Celery = ctx.obj.app
    return app


@contextmanager
def errors() -> Iterator[None]:
    """Turn celery-delayed errors (bad settings, store down or full, no such job) into one line and exit 1."""
    try:
        yield
    except DelayedError as exc:
        raise click.ClickException(str(exc)) from exc


def fmt_ms(ms: Any) -> str:
    """An epoch-ms time as an ISO date (UTC), or '-'."""
    if ms in (None, "", -1):
        return "-"
    return from_ms(int(float(ms))).isoformat(timespec="milliseconds")


def paged(f: F) -> F:
    """The paging options every listing command takes: --offset, --limit, --json."""
    for option in reversed((
        click.option("--offset", default=0, show_default=True, type=click.IntRange(0), metavar="N",
                     help="Skip the first N rows (the next page: the previous --offset plus --limit)."),
        click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000), metavar="N",
                     help="Show at most N rows."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON lines."),
    )):
        f = option(f)
    return f


def show_record(rec: dict[str, str]) -> str:
    """A job record as indented JSON, its times also as ISO dates ("<ms> (<date>)"), text as it is."""
    shown = dict(rec)
    for key in TIME_FIELDS:
        if shown.get(key):
            shown[key] = f"{shown[key]} ({fmt_ms(shown[key])})"
    return json.dumps(shown, indent=2, sort_keys=True, ensure_ascii=False)


def labelled(rows: Sequence[tuple[str, str]]) -> str:
    """(label, text) rows as aligned lines ("label    text"); a text's later lines indented under the first."""
    width = max((len(label) for label, _ in rows), default=0) + 2
    return "\n".join(f"{label:<{width}}" + str(text).replace("\n", "\n" + " " * width) for label, text in rows)


def job_text(store: Store, rec: dict[str, str]) -> str:
    """A job as ``delayed show`` prints it: the summary in words (the dashboard's labels), the rest of the
    record labelled, then the traceback."""
    message = store.lookup.message(rec["id"], int(rec["shard"]))
    out = [labelled(describe.summary(rec, message, store.redis.now_ms()))]
    rest = describe.details(rec)
    if rest:
        out += ["", labelled([(label, text) for _, label, text in rest])]
    if rec.get(Field.TRACEBACK):
        out += ["", f"{describe.label(Field.TRACEBACK)}:", rec[Field.TRACEBACK].rstrip()]
    return "\n".join(out)


def json_line(row: Any) -> str:
    """One JSON line of a listing (non-ASCII text as it is)."""
    return json.dumps(row, ensure_ascii=False)
