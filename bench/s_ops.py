"""Scenarios 12 and 13: what the operators' side (issue 12) costs.

12. The metrics on the release path: release N due jobs in-process with the
    real scripts, and with the same scripts whose stats calls (counters and
    lateness histograms) are no-ops, and with all of issue 12's bookkeeping
    no-ops (stats, the pending index, the pause check); alternating rounds on
    one server, so the ratio is measured in one run. Also the cost of one
    scrape (a FleetStats snapshot) with the N jobs pending.
13. The dashboard with N = 1,000,000 pending jobs (4 tasks on 2 queues, due
    over a day): server time of each page (median of 5) over HTTP, and the
    page load in headless chromium (navigation to load event) when chromium
    is installed.
"""

from __future__ import annotations

import copy
import hashlib
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery_delayed.producer.prepare import prepare
from celery_delayed.store import NewJob, Store, get_store
from celery_delayed.store.loader import Script, Scripts, lua_dir
from celery_delayed.store.stats import FleetStats

from .celery_app import make_app
from .common import Ctx, delete_prefix, uid

S12 = "12 metrics cost on the release path (direct)"
S13 = "13 dashboard with 1,000,000 pending jobs"

# Shadowing definitions inserted after the ops include: the calls stay, their work goes.
_NO_STATS = """
local function stats_add() end
local function late_add() end
local function late_save() end
"""
_NO_OPS = _NO_STATS + """
local function pauses() return nil end
local function ix_push() end
local function ix_flush() end
"""


def _variant(script: Script, stub: str) -> Script:
    """The script with the ops include's functions shadowed by ``stub``."""
    ops = (lua_dir() / "includes" / "ops.lua").read_text(encoding="utf-8")
    assert ops in script.source, "the ops include is not inlined in release_due"
    out = copy.copy(script)
    out.source = script.source.replace(ops, ops + stub)
    out.sha = hashlib.sha1(out.source.encode("utf-8")).hexdigest()
    return out


def _scripts(store: Store, stub: str | None) -> Scripts:
    base = store.redis.scripts
    if stub is None:
        return base
    out = copy.copy(base)
    out.release_due = _variant(base.release_due, stub)
    return out


def _fill(store: Store, app: Any, n: int, u: str, due_of: Any, calls: list[tuple[str, str]],
          chunk: int = 20_000) -> float:
    """Schedule n jobs through ``store.jobs.schedule``, round robin over (task, queue) pairs; return seconds."""
    bases = [prepare(app, store, task, (0.0,), {}, 0, options={"queue": queue}, task_type=None).job
             for task, queue in calls]

    def one(start: int) -> None:
        jobs = []
        for i in range(start, min(n, start + chunk)):
            jid = f"{u}-{i}"
            base = bases[i % len(bases)]
            jobs.append(NewJob(jid, store.layout.shard_of(jid), due_of(i), base.fields, base.common, base.template))
        store.jobs.schedule(jobs)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(one, s) for s in range(0, n, chunk)]:
            f.result()
    return time.perf_counter() - t0


def _release_all(store: Store) -> tuple[int, float]:
    total, t0 = 0, time.perf_counter()
    live = set(range(store.config.shards))
    while live:
        for s in list(live):
            b = store.release.release_due(s)
            total += b.count
            if b.count + b.skipped < store.config.batch_size:
                live.discard(s)
    return total, time.perf_counter() - t0


def _settle(client: Any) -> None:
    """Wait until Redis has freed what UNLINK handed to its background thread (it would slow the next round)."""
    deadline = time.monotonic() + 60
    while int(client.info("memory").get("lazyfree_pending_objects", 0)) and time.monotonic() < deadline:
        time.sleep(0.05)


def metrics_cost(ctx: Ctx) -> None:
    n = ctx.size(200_000, 20_000)
    rounds = ctx.size(7, 3)
    print(f"[{S12}] {n} due jobs per variant and round, {rounds} rounds, order rotated each round", flush=True)
    client = ctx.client()
    variants = {"with metrics (as shipped)": None, "stats calls no-ops": _NO_STATS,
                "stats, index and pause check no-ops": _NO_OPS}
    labels = list(variants)
    rates: dict[str, list[float]] = {k: [] for k in variants}
    snaps: list[float] = []
    for r in range(rounds):
        # Fill every variant's jobs first (same sizes, same due time), then release them in an order
        # rotated each round: no variant always runs first, or right after a fill or a delete.
        stores: dict[str, tuple[Store, str, str]] = {}
        for label in labels:
            u = uid()
            prefix, queue = f"b12{u}", f"q12{u}"
            app = make_app(ctx.redis_url, prefix, queue)
            store = get_store(app)
            now = store.redis.now_ms()
            _fill(store, app, n, u, lambda i, t=now - 1000: str(t), [("bench.late_d", queue)])
            stores[label] = (store, prefix, queue)
        if r == 0:
            t0 = time.perf_counter()
            FleetStats(stores[labels[0]][0]).snapshot()
            snaps.append(time.perf_counter() - t0)
        _settle(client)
        for label in labels[r % 3:] + labels[:r % 3]:
            store = stores[label][0]
            store.redis._scripts = _scripts(store, variants[label])
            released, secs = _release_all(store)
            assert released == n, (released, n)
            rates[label].append(n / secs)
        for _store, prefix, queue in stores.values():
            delete_prefix(client, f"{prefix}:*")
            client.unlink(queue)
        _settle(client)
    for label, values in rates.items():
        ctx.add(S12, label, "release rate", statistics.median(values), "jobs/s",
                note=f"median of {rounds} rounds of {n:,} (min {min(values):,.0f}, max {max(values):,.0f}), "
                     "in-process, 16 shards, batch 500")
    ctx.relate(S12, "release rate", "stats, index and pause check no-ops")
    ctx.add(S12, "FleetStats snapshot (one scrape)", "time", snaps[0] * 1000, "ms",
            note=f"{3 * n:,} jobs pending")


def _get(url: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as resp:
        body = resp.read()
    return (time.perf_counter() - t0) * 1000, len(body)


def dashboard(ctx: Ctx) -> None:
    n = ctx.size(1_000_000, 50_000)
    print(f"[{S13}] {n} pending jobs, 4 tasks on 2 queues, due over a day", flush=True)
    from celery_delayed.web import make_server, serve_in_thread

    u = uid()
    prefix = f"b13{u}"
    app = make_app(ctx.redis_url, prefix, f"q13{u}")
    store = get_store(app)
    now = store.redis.now_ms()
    calls = [("bench.report", "default"), ("bench.remind", "default"), ("bench.bill", "billing"),
             ("bench.sync", "billing")]
    fill_s = _fill(store, app, n, u, lambda i, t=now + 60_000, w=86_400_000: str(t + i * w // n), calls)
    ctx.add(S13, "fill (store.jobs.schedule)", "schedule rate", n / fill_s, "jobs/s", note=f"{n:,} jobs")
    server = make_server(app, "127.0.0.1", 0)
    serve_in_thread(server)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        # a deep page: follow the cursor 20 pages into one task's jobs
        url = base + "/jobs?task=bench.bill"
        for _ in range(20):
            with urllib.request.urlopen(url, timeout=60) as resp:
                page = resp.read().decode()
            at = page.index('id="next-page" href="') + len('id="next-page" href="')
            url = base + page[at:page.index('"', at)].replace("&amp;", "&")
        pages = {"overview (/)": "/", "overview, next day (/?span=day)": "/?span=day",
                 "pending, first page (/jobs)": "/jobs", "pending of one task (/jobs?task=)": "/jobs?task=bench.bill",
                 "pending, 21st page of one task (cursor)": url[len(base):],
                 "one job (/jobs/<id>)": f"/jobs/{u}-{n // 2}", "metrics (/metrics)": "/metrics"}
        for label, path in pages.items():
            _get(base + path)  # warm
            times = [_get(base + path)[0] for _ in range(5)]
            ctx.add(S13, label, "page time (server, HTTP)", statistics.median(times), "ms",
                    note=f"median of 5, {n:,} pending")
        _browser(ctx, base, n)
    finally:
        server.shutdown()
        server.server_close()
        delete_prefix(ctx.client(), f"{prefix}:*")


def _browser(ctx: Ctx, base: str, n: int) -> None:
    import os

    if not (os.path.exists("/usr/bin/chromium") and os.path.exists("/usr/bin/chromedriver")):
        ctx.notes.append("scenario 13: no chromium, page load in a browser not measured")
        return
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support.browser import chromium

    with chromium() as drv:
        for label, path in (("overview (/)", "/"), ("pending, first page (/jobs)", "/jobs")):
            drv.get(base + path)
            loads = []
            for _ in range(5):
                drv.get(base + path)
                loads.append(drv.execute_script(
                    "const t = performance.getEntriesByType('navigation')[0]; return t.loadEventEnd - t.startTime;"))
            ctx.add(S13, label, "page load in chromium", statistics.median(loads), "ms",
                    note=f"navigation start to load event, median of 5, {n:,} pending")
