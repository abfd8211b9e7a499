"""Prometheus metrics of the whole fleet, read from the store at scrape time.

Needs ``prometheus_client`` (``pip install "celery-delayed[metrics]"``). Every
figure comes from the store (:class:`~celery_delayed.store.stats.FleetStats`:
counters and histograms kept per shard by the Lua scripts, counts read from
the shards' sets), so any one exporter tells the truth for the whole fleet,
and two exporters agree. Served by ``celery -A proj delayed run
--metrics-port PORT`` (or ``delayed_metrics_port``, also in ``worker
--delayed``) and by the dashboard at ``/metrics``.

The families (prefix ``celery_delayed_``) are listed in :data:`FAMILIES`;
the README's metrics table is generated from it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from celery import Celery

from .store import get_store
from .store.shaping import Limit, busiest
from .store.stats import COUNTERS, FleetStats, Snapshot

logger = logging.getLogger("celery_delayed.metrics")

PREFIX = "celery_delayed_"

#: How many tenants get a series of their own in ``tenant_scheduled_jobs``; the rest are summed under "other".
TOP_TENANTS = 20

#: (name without the prefix, type, labels, meaning): every family the exporter serves.
FAMILIES: tuple[tuple[str, str, str, str], ...] = (
    ("pending_jobs", "gauge", "queue, task", "jobs scheduled and not yet released (held by a pause included)"),
    ("overdue_jobs", "gauge", "", "jobs due and not yet released (a backlog, or no scheduler)"),
    ("oldest_overdue_seconds", "gauge", "", "age of the oldest overdue job (0: none)"),
    ("held_jobs", "gauge", "", "due jobs a pause holds back"),
    ("claimed_jobs", "gauge", "", "publish path: jobs claimed and not yet confirmed by the broker"),
    ("queued_jobs", "gauge", "", "jobs released and not started by a worker"),
    ("running_jobs", "gauge", "", "jobs running on a worker (a dead worker's, until taken over)"),
    ("dead_letters", "gauge", "", "jobs in the dead-letter queue"),
    ("schedulers", "gauge", "", "live schedulers"),
    ("scheduler_shards", "gauge", "scheduler", "shards each live scheduler holds"),
    ("unowned_shards", "gauge", "", "shards no live scheduler holds (nothing releases their jobs)"),
    ("paused", "gauge", "scope, name", "1 per pause in force (scope all, task or queue)"),
    ("rate_limited_jobs", "gauge", "limit", "due jobs a rate limit holds back, waiting for a token, by limit key "
     "(every tenant's under `tenant:*` summed in its series)"),
    ("rate_limit_per_second", "gauge", "limit", "the rate in force of each limit, jobs per second (the app's "
     "`delayed_rate_limits` or one set at run time; a lifted limit has no series)"),
    ("tenant_scheduled_jobs", "gauge", "tenant", f"scheduled jobs per tenant: the {TOP_TENANTS} tenants with "
     "the most have a series each, every other tenant is summed under tenant=\"other\" (a tenant named "
     "\"other\" too), so the series stay bounded"),
    ("recurring_schedules", "gauge", "state", "recurring schedules (`delayed_schedule` and run-time ones), "
     "by state: active or paused"),
    *((f"{name}_total", "counter", "", meaning) for name, meaning in COUNTERS.items()),
    ("release_lateness_seconds", "histogram", "", "release time - due time of each released job"),
    ("start_lateness_seconds", "histogram", "", "worker start - due time of each started job"),
)


def metrics_table() -> str:
    """The metrics table (Markdown) of the docs' metrics reference, generated from :data:`FAMILIES`."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for name, kind, labels, meaning in FAMILIES:
        rows.append(f"| `{PREFIX}{name}` | {kind} | {labels or '-'} | {meaning} |")
    return "\n".join(rows)


class StoreCollector:
    """A prometheus_client collector that reads one store's :class:`Snapshot` per scrape."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def describe(self) -> list[Any]:
        return []  # no description up front: a registration must not read the store

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        try:
            store = get_store(self.app)
            snap = FleetStats(store).snapshot()
            limits = store.shaping.limits()
            named = set(store.config.rate_limits) | set(store.shaping.runtime_limits())
            tenants = store.shaping.tenants()
        except Exception:  # a scrape while the store is down: say so, with no figures
            logger.warning("metrics: could not read the store", exc_info=True)
            up = GaugeMetricFamily(PREFIX + "store_up", "1 when the last scrape could read the store")
            up.add_metric([], 0)
            yield up
            return
        up = GaugeMetricFamily(PREFIX + "store_up", "1 when the last scrape could read the store")
        up.add_metric([], 1)
        yield up
        helps = {name: meaning for name, _, _, meaning in FAMILIES}
        yield from _families(snap, helps, GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily)
        yield _schedules(self.app, helps, GaugeMetricFamily)
        yield from _shaping(limits, named, tenants, helps, GaugeMetricFamily)


def _shaping(limits: list[Limit], named: set[str], tenants: dict[str, int], helps: dict[str, str],
             gauge: Any) -> Iterator[Any]:
    """What each rate limit holds back and its rate; scheduled jobs of the busiest tenants, the rest as one.

    ``named``: the keys the app or an operator set. A tenant's own bucket under ``tenant:*`` is counted
    in the ``tenant:*`` series, so that the series stay one per limit however many tenants wait.
    """
    waiting = gauge(PREFIX + "rate_limited_jobs", helps["rate_limited_jobs"], labels=["limit"])
    rate = gauge(PREFIX + "rate_limit_per_second", helps["rate_limit_per_second"], labels=["limit"])
    held: dict[str, int] = {}
    for row in limits:
        key = "tenant:*" if row.key.startswith("tenant:") and row.key not in named else row.key
        held[key] = held.get(key, 0) + row.waiting
        if row.per_second is not None and key == row.key:
            rate.add_metric([row.key], row.per_second)
    for key, n in held.items():
        waiting.add_metric([key], n)
    yield waiting
    yield rate
    fam = gauge(PREFIX + "tenant_scheduled_jobs", helps["tenant_scheduled_jobs"], labels=["tenant"])
    top, _, rest = busiest({t: n for t, n in tenants.items() if t != "other"}, TOP_TENANTS)
    for name, n in top:
        fam.add_metric([name], n)
    if rest or "other" in tenants:
        fam.add_metric(["other"], rest + tenants.get("other", 0))
    yield fam


def _schedules(app: Celery, helps: dict[str, str], gauge: Any) -> Any:
    """The recurring schedules, active and paused (read through the schedules' index)."""
    rec = get_store(app).schedules
    by_shard: dict[int, list[str]] = {}
    for name in rec.index():
        by_shard.setdefault(rec.shard_of(name), []).append(name)
    stored = rec.read(by_shard) if by_shard else []
    fam = gauge(PREFIX + "recurring_schedules", helps["recurring_schedules"], labels=["state"])
    paused = sum(1 for s in stored if s.paused)
    fam.add_metric(["active"], len(stored) - paused)
    fam.add_metric(["paused"], paused)
    return fam


def _families(snap: Snapshot, helps: dict[str, str], gauge: Any, counter: Any, histogram: Any) -> Iterator[Any]:
    pending = gauge(PREFIX + "pending_jobs", helps["pending_jobs"], labels=["queue", "task"])
    for (task, queue), n in sorted(snap.pending_by.items()):
        pending.add_metric([queue, task], n)
    yield pending
    simple = {
        "overdue_jobs": snap.overdue, "oldest_overdue_seconds": snap.oldest_overdue_ms / 1000.0,
        "held_jobs": snap.held, "claimed_jobs": snap.claimed, "queued_jobs": snap.queued,
        "running_jobs": snap.running, "dead_letters": snap.dead_letters, "schedulers": len(snap.schedulers),
        "unowned_shards": len(snap.unowned_shards),
    }
    for name, value in simple.items():
        g = gauge(PREFIX + name, helps[name])
        g.add_metric([], value)
        yield g
    per = gauge(PREFIX + "scheduler_shards", helps["scheduler_shards"], labels=["scheduler"])
    for member, shards in sorted(snap.shards_of().items()):
        per.add_metric([member], len(shards))
    yield per
    paused = gauge(PREFIX + "paused", helps["paused"], labels=["scope", "name"])
    for flag in sorted(snap.paused):
        scope, _, name = flag.partition(":")
        paused.add_metric([scope, name], 1)
    yield paused
    for name, value in snap.counters.items():
        c = counter(PREFIX + name, helps[f"{name}_total"])
        c.add_metric([], value)
        yield c
    for name, h in (("release_lateness_seconds", snap.release_lateness),
                    ("start_lateness_seconds", snap.start_lateness)):
        fam = histogram(PREFIX + name, helps[name])
        buckets = [("+Inf" if b == float("inf") else repr(b), c) for b, c in h.cumulative()]
        fam.add_metric([], buckets, sum_value=h.sum_ms / 1000.0)
        yield fam


def registry(app: Celery) -> Any:
    """A prometheus_client registry holding only this store's collector."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(app))
    return reg


def render(app: Celery) -> tuple[bytes, str]:
    """The metrics in Prometheus' text format, and its content type."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry(app)), CONTENT_TYPE_LATEST


def serve(app: Celery, port: int, address: str = "127.0.0.1") -> Any:
    """Serve ``/metrics`` on ``address:port`` in a daemon thread; return the server (``.shutdown()`` stops it).

    Raises:
        ImportError: prometheus_client is not installed (with what to install).
    """
    try:
        from prometheus_client import start_http_server
    except ImportError as exc:  # pragma: no cover - the extra is installed in the tests
        raise ImportError('the metrics need prometheus_client: pip install "celery-delayed[metrics]"') from exc
    server, _thread = start_http_server(port, addr=address, registry=registry(app))
    logger.info("celery-delayed metrics on http://%s:%d/metrics", address, port)
    return server
