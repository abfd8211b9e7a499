"""``celery -A proj delayed limits [set | lift | reset]`` and ``delayed tenants``: release shaping at run time."""

from __future__ import annotations

import json

import click

from .. import controls, describe
from ..store.shaping import busiest
from ._common import app_of, delayed, errors

#: How many tenants ``delayed tenants`` and ``delayed status`` show by default.
TOP_TENANTS = 20


@delayed.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@click.pass_context
def limits(ctx: click.Context, as_json: bool) -> None:
    """List the rate limits (the app's and those set at run time) and the due jobs each holds back.

    \b
    A KEY is a task name, queue:<name>, tenant:<name> or tenant:* (each tenant at that rate).
    A RATE is Celery's rate string: 100/s, 10/m, 1000/h.
    """
    if ctx.invoked_subcommand is not None:
        return
    with errors():
        rows = controls.limits(app_of(ctx))
    if as_json:
        for row in rows:
            rate, source = describe.limit(row)
            click.echo(json.dumps({"key": row.key, "rate": rate if row.per_second is not None else None,
                                   "per_second": row.per_second, "source": source, "waiting": row.waiting}))
        return
    if not rows:
        click.echo("no rate limit (set delayed_rate_limits, or `delayed limits set KEY RATE`)")
        return
    width = max(len("limit"), *(len(r.key) for r in rows))
    click.echo(f"{'limit':<{width}}  {'rate':>8}  {'source':<8}  {'waiting':>8}")
    for row in rows:
        rate, source = describe.limit(row)
        click.echo(f"{row.key:<{width}}  {rate:>8}  {source:<8}  {row.waiting:>8}")


@limits.command(name="set")
@click.argument("key")
@click.argument("rate")
@click.pass_context
def set_(ctx: click.Context, key: str, rate: str) -> None:
    """Limit KEY to RATE on every shard from the next release on (it wins over the app's setting)."""
    with errors():
        controls.set_limit(app_of(ctx), key, rate)
    click.echo(f"{key}: limited to {rate.strip()} (set at run time; `delayed limits reset {key}` undoes it)")


@limits.command()
@click.argument("key")
@click.pass_context
def lift(ctx: click.Context, key: str) -> None:
    """Lift the limit of KEY (the app's included) until `reset`: its waiting jobs go at once."""
    with errors():
        controls.set_limit(app_of(ctx), key, 0)
    click.echo(f"{key}: lifted (no limit until `delayed limits reset {key}`)")


@limits.command()
@click.argument("key")
@click.pass_context
def reset(ctx: click.Context, key: str) -> None:
    """Forget what was set or lifted at run time for KEY: the app's delayed_rate_limits applies again."""
    with errors():
        app = app_of(ctx)
        controls.set_limit(app, key, None)
        rows = {r.key: r for r in controls.limits(app)}
    row = rows.get(key)
    if row is not None and row.source == "app" and row.per_second is not None:
        click.echo(f"{key}: back to the app's {describe.limit(row)[0]}")
    else:
        click.echo(f"{key}: no limit (delayed_rate_limits sets none)")


@delayed.command()
@click.option("--top", default=TOP_TENANTS, show_default=True, type=click.IntRange(1, 100_000), metavar="N",
              help="Show the N tenants with the most scheduled jobs; the others are summed on one line.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@click.pass_context
def tenants(ctx: click.Context, top: int, as_json: bool) -> None:
    """Tenants with scheduled jobs (apply_later(..., tenant=...)), the busiest first."""
    with errors():
        counts = controls.tenants(app_of(ctx))
    rows, others, other_jobs = busiest(counts, top)
    if as_json:
        for name, n in rows:
            click.echo(json.dumps({"tenant": name, "scheduled": n}, ensure_ascii=False))
        return
    if not rows:
        click.echo("no tenant has scheduled jobs")
        return
    width = max(len("tenant"), *(len(name) for name, _ in rows))
    click.echo(f"{'tenant':<{width}}  {'scheduled':>9}")
    for name, n in rows:
        click.echo(f"{name:<{width}}  {n:>9}")
    if others:
        click.echo(f"(and {others} more tenant(s) with {other_jobs} job(s); --top shows more)")
    click.echo(f"({len(counts)} tenant(s), {sum(counts.values())} scheduled job(s))", err=True)
