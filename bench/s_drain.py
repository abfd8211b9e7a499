"""Scenario 15: drain rate, the worker side alone.

N messages wait in the queue before the worker starts; the worker drains
them and the rate is taken between the 10th percent and the last run (so the
worker's start-up is not counted). Three variants of one task body, the same
worker settings (``task_acks_late``, as the README recommends), in rotating
order over a few rounds:

- ``plain task, apply_async``: Celery's own message, no store (the reference);
- ``plain task via the store``: ``apply_later`` of the plain task, released
  into the queue (the worker records its start and finish: CONTRACTS rule 5);
- ``DelayedTask via the store``: the same with the ``DelayedTask`` base class.

Run for ``prefork -c 2`` and ``threads -c 4``.
"""

from __future__ import annotations

import time
from typing import Any

from celery_delayed import apply_later_many, get_store

from .celery_app import make_app
from .common import Ctx, celery_worker, delete_prefix, procs, runs, uid, wait_for, wait_ready

S15 = "15 drain rate (worker side)"
VARIANTS = ("plain task, apply_async", "plain task via the store", "DelayedTask via the store")
CONF = {"task_acks_late": True, "worker_prefetch_multiplier": 4}


def drain(ctx: Ctx) -> None:
    n = ctx.size(4_000, 600)
    rounds = ctx.size(3, 1)
    client = ctx.client()
    for pool, conc in (("prefork", 2), ("threads", 4)):
        print(f"[{S15}] {n} queued messages, worker -P {pool} -c {conc}, {rounds} rounds", flush=True)
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
            for variant in order:
                rate = _one(ctx, client, variant, n, pool, conc)
                if rate:
                    rates[variant].append(rate)
        system_of = {v: f"{v}, {pool} -c {conc}" for v in VARIANTS}
        for v in VARIANTS:
            best = max(rates[v]) if rates[v] else None
            ctx.add(S15, system_of[v], f"drain rate ({pool})", best, "tasks/s",
                    note="best of " + ", ".join(f"{x:,.0f}" for x in rates[v]))
        ctx.relate(S15, f"drain rate ({pool})", system_of[VARIANTS[0]])
    ctx.notes.append("scenario 15: the queue is filled before the worker starts; rate from the 10th percent of "
                     "runs to the last; task_acks_late on; rounds rotate the order of the variants")


def fill_released(app: Any, task: str, n: int) -> None:
    """Schedule n jobs due now and release them all into the queue (in-process, direct path)."""
    apply_later_many(app, task, [{"args": (0.0,), "when": 0} for _ in range(n)])
    store = get_store(app)
    left = n
    deadline = time.monotonic() + 60
    while left > 0 and time.monotonic() < deadline:
        for shard in range(store.config.shards):
            left -= store.release.release_due(shard, limit=1000).count


def _one(ctx: Ctx, client: Any, variant: str, n: int, pool: str, conc: int) -> float | None:
    u = uid()
    prefix, queue = f"b14{u}", f"q14{u}"
    app = make_app(ctx.redis_url, prefix, queue, **CONF)
    if variant == VARIANTS[0]:
        late = app.tasks["bench.late"]
        for _ in range(n):
            late.apply_async(args=(0.0,))
    else:
        fill_released(app, "bench.late" if "plain" in variant else "bench.late_d", n)
    try:
        with procs() as ps:
            ps.append(celery_worker(ctx.redis_url, prefix, queue, pool=pool, concurrency=conc, conf=CONF))
            wait_ready(ps[0], "worker")
            wait_for(lambda: client.llen(f"{prefix}:ran") >= n, 120, interval=0.05)
            done = sorted(start for _, start, _ in runs(client, prefix))
    finally:
        delete_prefix(client, f"{prefix}:*", f"*{queue}*")
    if len(done) < n:
        ctx.notes.append(f"scenario 15: {variant} ({pool}) ran {len(done)} of {n} within 120 s")
    k = len(done) // 10
    if len(done) - k < 2 or done[-1] <= done[k]:
        return None
    return (len(done) - 1 - k) / (done[-1] - done[k])
