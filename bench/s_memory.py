"""Scenarios 6, 7 and 8: what pending delayed tasks cost while they wait.

6. Worker RSS (prefork ``-c 2``, all processes) idle, then with N tasks
   pending far in the future: celery-delayed (they wait in Redis) vs
   Celery's ETA path (the worker holds every ETA message in memory).
7. Redis memory per pending job (``INFO memory`` delta / jobs) vs the broker
   footprint of the same tasks as Celery ETA messages.
8. Idle cost: Redis commands per second and scheduler CPU with N jobs due
   in an hour.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from celery_delayed import apply_later_many, get_store

from .celery_app import make_app
from .common import (
    Ctx,
    celery_worker,
    delayed_scheduler,
    delete_prefix,
    procs,
    settled_memory,
    uid,
    wait_for,
    wait_ready,
    wait_scheduler,
)
from .s_release import _fill

S6 = "6 worker RSS with pending tasks"
S7 = "7 Redis memory per pending job"
S8 = "8 idle cost with pending jobs"


def _settled_rss(proc: Any, secs: float = 3.0) -> float:
    time.sleep(secs)
    return float(proc.rss_mb())


def eta_messages(app: Any, client: Any, queue: str, n: int, countdown: float = 3600) -> None:
    """LPUSH n Celery ETA messages onto ``queue``: clones of one real ``apply_async`` envelope.

    Publishing through Celery runs at a few thousand per second; cloning
    (new task id and delivery tag each) fills the queue in seconds with the
    very bytes kombu would have pushed. The ids are uuid4 strings, as
    Celery's and kombu's own: shorter made-up ids made each clone ~65 bytes
    smaller than the message it copies.
    """
    hold = f"{queue}.hold"
    app.tasks["bench.late"].apply_async(args=(time.time() + countdown,), countdown=countdown, queue=hold)
    raw = client.rpop(hold)
    env = json.loads(raw)
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        tid = str(uuid.uuid4())
        env["headers"]["id"] = env["headers"]["root_id"] = env["properties"]["correlation_id"] = tid
        env["properties"]["delivery_tag"] = str(uuid.uuid4())
        env["properties"]["delivery_info"]["routing_key"] = queue
        pipe.lpush(queue, json.dumps(env))
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()


def worker_memory(ctx: Ctx) -> None:
    sizes = [100_000, 1_000_000] if not ctx.quick else [10_000]
    eta_n = ctx.size(100_000, 5_000)
    print(f"[{S6}] celery-delayed with {sizes} pending; Celery ETA with {eta_n}", flush=True)
    client = ctx.client()
    u = uid()
    prefix, queue = f"b6{u}", f"q6{u}"
    app = make_app(ctx.redis_url, prefix, queue)
    store = get_store(app)
    with procs() as ps:
        ps.append(celery_worker(ctx.redis_url, prefix, queue, concurrency=2))
        ps.append(delayed_scheduler(ctx.redis_url, prefix, queue))
        wait_ready(ps[0], "worker")
        wait_scheduler(client, prefix)
        idle = _settled_rss(ps[0])
        ctx.add(S6, "celery-delayed", "worker RSS idle", idle, "MB")
        done = 0
        for n in sizes:
            _fill(store, app, n - done, f"{u}-{done}", lambda i: "+3600000", pad="")
            done = n
            rss = _settled_rss(ps[0])
            ctx.add(S6, "celery-delayed", f"worker RSS, {n:,} pending", rss, "MB",
                    note=f"{rss - idle:+.1f} MB vs idle")
        ps[0].stop()  # the worker's own polling is not the scheduler's idle cost
        _idle_cost(ctx, client, ps[1], sizes[-1])
    delete_prefix(client, f"{prefix}:*")
    u = uid()
    prefix, queue = f"b6e{u}", f"q6e{u}"
    app = make_app(ctx.redis_url, prefix, queue)
    with procs() as ps:
        ps.append(celery_worker(ctx.redis_url, prefix, queue, concurrency=2))
        wait_ready(ps[0], "worker")
        idle = _settled_rss(ps[0])
        ctx.add(S6, "Celery ETA", "worker RSS idle", idle, "MB")
        eta_messages(app, client, queue, eta_n)
        taken = wait_for(lambda: client.llen(queue) == 0, ctx.size(120, 40), interval=0.5)
        rss = _settled_rss(ps[0])
        note = f"{rss - idle:+.1f} MB vs idle"
        if not taken:
            note += f"; the worker had taken {eta_n - client.llen(queue)} of {eta_n} within the time limit"
        ctx.add(S6, "Celery ETA", f"worker RSS, {eta_n:,} pending", rss, "MB", note=note)
    delete_prefix(client, f"{prefix}:*", f"*{queue}*", "unacked*")
    if not ctx.quick:
        ctx.notes.append("scenario 6: Celery's ETA path measured at 100,000 pending only; at 1,000,000 the worker "
                         "would need ~10 GB and minutes to take them (it grows ~8-9 KB per pending task)")


def redis_memory(ctx: Ctx) -> None:
    n = ctx.size(1_000_000, 20_000)
    n_eta = ctx.size(100_000, 20_000)  # a Celery ETA message costs the same at any count
    print(f"[{S7}] {n} pending jobs ({n_eta} Celery ETA messages)", flush=True)
    client = ctx.client()
    u = uid()
    prefix, queue = f"b7{u}", f"q7{u}"
    app = make_app(ctx.redis_url, prefix, queue)
    # Each figure is read once Redis's key space stopped resizing (settled_memory): the scenarios
    # before this one delete millions of keys, and the table shrinking meanwhile was counted as
    # negative bytes of whatever was measured then (Celery's messages: 937 bytes, not 1,032).
    before = settled_memory(client)
    eta_messages(app, client, queue, n_eta)
    per_eta = (settled_memory(client) - before) / n_eta
    ctx.add(S7, "Celery ETA (message in the broker list)", "bytes per pending job", per_eta, "bytes",
            note="before a worker takes it; held by a worker it sits in the unacked hash instead")
    client.unlink(queue)
    before = settled_memory(client)
    apply_later_many(app, "bench.late_d", [{"args": (time.time() + 3600,), "when": 3600} for _ in range(n)])
    per = (settled_memory(client) - before) / n
    ctx.add(S7, "celery-delayed (record hash + sorted-set entry)", "bytes per pending job", per, "bytes",
            note=f"{n:,} pending; compact records (a template per shard)")
    delete_prefix(client, f"{prefix}:*")
    # A record holds a ~1 KB message, over Redis's default hash-max-listpack-value
    # (64 bytes), so it is a hash table; with a larger limit it stays a compact listpack.
    old = client.config_get("hash-max-listpack-value")["hash-max-listpack-value"]
    client.config_set("hash-max-listpack-value", 4096)
    try:
        before = settled_memory(client)
        apply_later_many(app, "bench.late_d", [{"args": (time.time() + 3600,), "when": 3600} for _ in range(n)])
        per = (settled_memory(client) - before) / n
    finally:
        client.config_set("hash-max-listpack-value", old)
    ctx.add(S7, "celery-delayed, hash-max-listpack-value 4096", "bytes per pending job", per, "bytes",
            note="Redis server setting: records stay listpack-encoded")
    delete_prefix(client, f"{prefix}:*")
    ctx.relate(S7, "bytes per pending job", "Celery ETA (message in the broker list)")


def _idle_cost(ctx: Ctx, client: Any, scheduler: Any, n: int) -> None:
    """Commands/s and scheduler CPU over a window, with n jobs due in an hour and no worker."""
    window = ctx.size(20, 5)
    print(f"[{S8}] {n} jobs due in an hour, {window} s window", flush=True)
    time.sleep(2)  # let it finish its first look at every shard
    client.config_resetstat()
    cpu0, t0 = scheduler.cpu_s(), time.monotonic()
    time.sleep(window)
    stats = client.info("commandstats")
    cpu1, t1 = scheduler.cpu_s(), time.monotonic()
    ours = {"cmdstat_config|resetstat", "cmdstat_info"}
    counted = {k: int(v["calls"]) for k, v in stats.items() if k not in ours}
    # Each command the scheduler sent (a script's own commands included), most frequent first.
    ctx.add(S8, "celery-delayed scheduler", "Redis commands per second", sum(counted.values()) / (t1 - t0),
            "cmd/s", note=f"{n:,} pending; " + ", ".join(
                f"{k.removeprefix('cmdstat_')} {v}" for k, v in sorted(counted.items(), key=lambda kv: -kv[1]))
            + f" in {t1 - t0:.0f} s")
    ctx.add(S8, "celery-delayed scheduler", "scheduler CPU", 100 * (cpu1 - cpu0) / (t1 - t0), "% of a core")
    ctx.done.add("idle")


def idle(ctx: Ctx) -> None:
    if "idle" in ctx.done:
        return  # measured with the pending jobs of scenario 6
    n = ctx.size(1_000_000, 100_000)
    client = ctx.client()
    u = uid()
    prefix, queue = f"b8{u}", f"q8{u}"
    app = make_app(ctx.redis_url, prefix, queue)
    _fill(get_store(app), app, n, u, lambda i: "+3600000", pad="")
    with procs() as ps:
        ps.append(delayed_scheduler(ctx.redis_url, prefix, queue))
        wait_scheduler(client, prefix)
        _idle_cost(ctx, client, ps[0], n)
    delete_prefix(client, f"{prefix}:*")
