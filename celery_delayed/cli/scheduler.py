"""``celery -A proj delayed run`` and ``delayed status``."""

from __future__ import annotations

import json
import logging
import signal
from types import FrameType
from typing import Any

import click
from celery import Celery

from .. import describe
from ..config import get_config
from ..errors import ConfigurationError, DatabaseUnavailable, StoreUnavailable
from ..store import ServerHealth, ShardStatus, Store, get_store
from ..store.shaping import busiest
from ._common import app_of, delayed, errors, fmt_ms


@delayed.command()
@click.option("--loglevel", "-l", default="INFO", show_default=True, help="Logging level.",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False))
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=None,
              help="Serve Prometheus metrics on this port (default: delayed_metrics_port; none when unset).")
@click.pass_context
def run(ctx: click.Context, loglevel: str, metrics_port: int | None) -> None:
    """Run the scheduler until SIGTERM or SIGINT."""
    from ..scheduler import Scheduler

    logging.basicConfig(
        level=loglevel.upper(), format="[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"
    )
    app = app_of(ctx)
    app.loader.import_default_modules()
    with errors():  # a wrong delayed_* setting: say which, without a traceback
        sched = Scheduler(app)
        try:
            sched.preflight()  # settings that disagree with the store's: refuse before joining
        except StoreUnavailable as exc:
            logging.getLogger("celery_delayed.scheduler").warning("store unavailable at start (%s); retrying", exc)
    exporter = start_metrics(app, metrics_port)

    def _stop(signum: int, frame: FrameType | None) -> None:
        sched.request_stop()  # not stop(): it would join the thread inside the handler

    # The loop runs in its own thread and the main thread only waits for it: a
    # signal handler that runs in the thread inside Event.wait() could
    # deadlock on the event's own lock.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    sched.start()
    while sched.is_alive():
        sched.join(1.0)
    if exporter is not None:
        exporter.shutdown()
    if sched.fatal is not None:
        raise click.ClickException(str(sched.fatal))


def start_metrics(app: Celery, port: int | None) -> Any:
    """Start the metrics exporter on ``port`` (or ``delayed_metrics_port``); None when neither is set."""
    cfg = get_config(app)
    port = port or cfg.metrics_port
    if port is None:
        return None
    from ..metrics import serve

    try:
        return serve(app, port, cfg.metrics_address)
    except (ImportError, OSError) as exc:
        raise click.ClickException(f"cannot serve metrics on {cfg.metrics_address}:{port}: {exc}") from exc


@delayed.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Per shard: pending jobs, next due time, oldest overdue; and totals."""
    with errors():
        store = get_store(app_of(ctx))
        status = ShardStatus(store)
        rows = status.rows()
        fallbacks = status.eta_fallbacks()
        # Live members only: a dead scheduler's entry stays until a heartbeat drops it.
        members = store.fleet.live_members()
        health = ServerHealth(store)
        warnings = health.warnings()
        try:
            replication = health.replication()
            where = health.replication_line()
        except Exception:  # INFO refused (an ACL user): said by the warnings
            replication, where = None, ""
        mirror = _mirror_lag(store) if store.config.database_url else None
        database = _database(store) if store.config.database_url else None
        paused = store.jobs.pauses()
        recurring = store.schedules.all()
        limits = store.shaping.limits()
        tenants = store.shaping.tenants()
    scheds = {"count": len(recurring), "paused": sum(1 for r in recurring if r.paused)}
    top, _, _ = busiest(tenants, 5)
    shaping = {"limits": [{"key": r.key, "rate": describe.limit(r)[0] if r.per_second is not None else None,
                           "per_second": r.per_second, "source": describe.limit(r)[1], "waiting": r.waiting}
                          for r in limits],
               "tenants": {"count": len(tenants), "scheduled": sum(tenants.values()),
                           "busiest": [{"tenant": t, "scheduled": n} for t, n in top]}}
    path, why = store.layout.release_path
    if as_json:
        click.echo(json.dumps({"shards": rows, "schedulers": members, "warnings": warnings, "mirror": mirror,
                               "database": database, "eta_fallbacks": fallbacks.as_dict(), "paused": paused,
                               "schedules": scheds, **shaping,
                               "replication": replication, "release_path": path, "release_path_reason": why,
                               "cluster": store.redis.cluster, "layout_shards": store.layout.shards,
                               "resharding_from": store.layout.moving_from}))
        return
    click.echo(f"{'shard':>5} {'pending':>9} {'overdue':>8} {'inflight':>8}  next due / oldest overdue")
    for r in rows:
        late = f"  (oldest overdue {r['oldest_overdue_ms'] / 1000:.3f}s)" if r["oldest_overdue_ms"] else ""
        click.echo(f"{r['shard']:>5} {r['pending']:>9} {r['overdue']:>8} {r['inflight']:>8}  "
                   f"{fmt_ms(r['next_due_ms'])}{late}")
    total = sum(r["pending"] for r in rows)
    overdue = sum(r["overdue"] for r in rows)
    firsts = [r["next_due_ms"] for r in rows if r["next_due_ms"] is not None]
    click.echo(f"total: {total} pending, {overdue} overdue, next due {fmt_ms(min(firsts) if firsts else None)}, "
               f"{len(members)} scheduler(s) {' '.join(members)}".rstrip()
               + f"; release path: {path} ({why})")
    if where:
        click.echo(where)
    if store.layout.moving_from is not None:
        click.echo(f"RESHARD in progress: {store.layout.moving_from} -> {store.layout.shards} shards "
                   f"(`delayed reshard --shards {store.layout.shards}` finishes it)")
    if database is not None and database["problem"] is None:
        click.echo(f"database: {database['url']}, " + (f"bound to {database['bound_to']}" if database["bound_to"]
                                                        else "not bound to a store yet"))
    if mirror is not None:
        lag = mirror["lag_s"]
        click.echo(f"database mirror: {mirror['pending_changes']} change(s) not yet applied"
                   + (f", the oldest {lag:.1f}s old" if lag is not None else ""))
    if fallbacks.count:  # interception could not store these: each is a broker ETA message
        click.echo(f"eta fallbacks: {fallbacks.count} delayed send(s) went to the broker as ETA messages, "
                   f"not the store; last at {fmt_ms(fallbacks.last_ms)}: {fallbacks.last_task}: "
                   f"{fallbacks.last_reason}")
    if recurring:
        click.echo(f"recurring: {scheds['count']} schedule(s), {scheds['paused']} paused "
                   "(delayed schedules list)")
    if paused:
        click.echo("paused: " + ", ".join(f"{flag} (since {fmt_ms(since)})" for flag, since in sorted(paused.items())))
    if limits:
        held = sum(lim.waiting for lim in limits)
        click.echo(f"rate limits: {len(limits)}, holding back {held} due job(s) (delayed limits)")
        for lim in limits:
            rate, source = describe.limit(lim)
            click.echo(f"  {lim.key}: {rate} ({source}), {lim.waiting} waiting")
    if tenants:
        click.echo(f"tenants: {len(tenants)} with {sum(tenants.values())} scheduled job(s); busiest: "
                   + ", ".join(f"{t} ({n})" for t, n in top) + " (delayed tenants)")
    for w in warnings:
        click.echo(f"WARNING: {w}")
    if database is not None and database["problem"] is not None:
        click.echo(f"WARNING: database: {database['problem']}")


def _database(store: Store) -> dict[str, Any]:
    """The database for ``delayed status``: the store it is bound to, or what is wrong with it (read only)."""
    from ..sql.binding import binding_problem, describe  # SQLAlchemy is an optional extra
    from ..sql.rows import get_rows

    rows = get_rows(store.app)
    assert rows is not None
    try:
        rows.check_schema()
        held, problem = binding_problem(store, rows)
    except (ConfigurationError, DatabaseUnavailable) as exc:
        return {"url": rows.url_shown, "bound_to": None, "problem": str(exc)}
    return {"url": rows.url_shown, "bound_to": describe(held) if held else None, "problem": problem}


def _mirror_lag(store: Store) -> dict[str, Any]:
    """The state changes waiting for the database mirror, over all shards, and the age of the oldest."""
    pending, oldest = 0, None
    for s in store.layout.shard_range():
        n, first = store.changes.lag(s)
        pending += n
        if first is not None:
            oldest = first if oldest is None else min(oldest, first)
    lag = None if oldest is None else max(0.0, (store.redis.now_ms() - oldest) / 1000)
    return {"pending_changes": pending, "lag_s": lag}
