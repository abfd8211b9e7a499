"""``celery -A proj delayed ...``: run the scheduler and inspect the store.

Commands: ``run`` (the scheduler), ``status`` (per shard: pending, next due,
oldest overdue), ``list`` (pending jobs, paged), ``show ID``, ``cancel ID``.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import click
from celery import Celery
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .bootstep import add_worker_option
from .errors import DelayedError
from .store import get_store
from .timeutil import from_ms

add_worker_option()


def _app(ctx: click.Context) -> Celery:
    app: Celery = ctx.obj.app
    return app


@contextmanager
def _errors() -> Iterator[None]:
    """Turn store errors into a one-line message and exit code 1 (no traceback)."""
    try:
        yield
    except DelayedError as exc:
        raise click.ClickException(str(exc)) from exc
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise click.ClickException(f"cannot reach the celery-delayed store: {exc}") from exc


def _fmt_ms(ms: Any) -> str:
    if ms in (None, "", -1):
        return "-"
    return from_ms(int(float(ms))).isoformat(timespec="milliseconds")


@click.group(name="delayed")
@click.pass_context
def delayed(ctx: click.Context) -> None:
    """celery-delayed: run the scheduler, inspect and cancel delayed jobs."""


@delayed.command()
@click.option("--loglevel", "-l", default="INFO", show_default=True, help="Logging level.",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False))
@click.pass_context
def run(ctx: click.Context, loglevel: str) -> None:
    """Run the scheduler until SIGTERM or SIGINT."""
    from .scheduler import Scheduler

    logging.basicConfig(
        level=loglevel.upper(), format="[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"
    )
    app = _app(ctx)
    app.loader.import_default_modules()
    with _errors():  # a wrong delayed_* setting: say which, without a traceback
        sched = Scheduler(app)

    def _stop(signum: int, frame: FrameType | None) -> None:
        sched.stop()

    # The loop runs in a thread and the main thread only waits for it: a
    # signal handler that runs in the thread inside Event.wait() could
    # deadlock on the event's own lock.
    thread = threading.Thread(target=sched.run, name="celery-delayed")
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    thread.start()
    while thread.is_alive():
        thread.join(1.0)


@delayed.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Per shard: pending jobs, next due time, oldest overdue; and totals."""
    with _errors():
        store = get_store(_app(ctx))
        rows = store.shard_status()
        # Live members only: a dead scheduler's entry stays until a heartbeat drops it.
        members = [str(m) for m in store.client.zrangebyscore(store.keys.schedulers, store.now_ms(), "+inf")]
    if as_json:
        click.echo(json.dumps({"shards": rows, "schedulers": members}))
        return
    click.echo(f"{'shard':>5} {'pending':>9} {'overdue':>8} {'inflight':>8}  next due / oldest overdue")
    for r in rows:
        late = f"  (oldest overdue {r['oldest_overdue_ms'] / 1000:.3f}s)" if r["oldest_overdue_ms"] else ""
        click.echo(f"{r['shard']:>5} {r['pending']:>9} {r['overdue']:>8} {r['inflight']:>8}  "
                   f"{_fmt_ms(r['next_due_ms'])}{late}")
    total = sum(r["pending"] for r in rows)
    overdue = sum(r["overdue"] for r in rows)
    firsts = [r["next_due_ms"] for r in rows if r["next_due_ms"] is not None]
    click.echo(f"total: {total} pending, {overdue} overdue, next due {_fmt_ms(min(firsts) if firsts else None)}, "
               f"{len(members)} scheduler(s) {' '.join(members)}")


def paged(f: Any) -> Any:
    """The paging options every listing command takes: --offset, --limit, --json."""
    for option in reversed((
        click.option("--offset", default=0, show_default=True, type=click.IntRange(0)),
        click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000)),
        click.option("--json", "as_json", is_flag=True, help="Print JSON lines."),
    )):
        f = option(f)
    return f


@delayed.command(name="list")
@click.option("--task", default=None, help="Only jobs of this task name.")
@paged
@click.pass_context
def list_(ctx: click.Context, task: str | None, offset: int, limit: int, as_json: bool) -> None:
    """List pending (scheduled) jobs, earliest first within each shard (shard by shard)."""
    with _errors():
        rows = get_store(_app(ctx)).pending(task=task, offset=offset, limit=limit)
    for r in rows:
        if as_json:
            click.echo(json.dumps(r))
        else:
            click.echo(f"{r['id']}  {_fmt_ms(r['due'])}  {r['task']}  queue={r['queue']}  shard={r['shard']}")
    if not as_json:
        more = f"; next page: --offset {offset + len(rows)}" if len(rows) == limit else ""
        click.echo(f"({len(rows)} shown, offset {offset}{more})", err=True)


@delayed.command()
@click.argument("job_id")
@click.pass_context
def show(ctx: click.Context, job_id: str) -> None:
    """Show one job's record."""
    with _errors():
        rec = get_store(_app(ctx)).get(job_id)
    for key in ("due", "created", "released", "cancelled"):
        if key in rec:
            rec[key] = f"{rec[key]} ({_fmt_ms(rec[key])})"
    click.echo(json.dumps(rec, indent=2, sort_keys=True))


@delayed.command()
@click.argument("job_id")
@click.pass_context
def cancel(ctx: click.Context, job_id: str) -> None:
    """Cancel a scheduled or queued job."""
    with _errors():
        prev = get_store(_app(ctx)).cancel(job_id)
    click.echo(f"cancelled {job_id} (was {prev})")


def main() -> None:  # pragma: no cover - convenience for `python -m celery_delayed.cli`
    sys.exit(delayed())
from . import cli_dlq  # noqa: E402,F401  (registers `delayed dlq ...` on the group above)
