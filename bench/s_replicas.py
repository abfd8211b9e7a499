"""Scenario 17: what ``delayed_wait_replicas`` costs, and what the Sentinel client costs.

One ``apply_later`` at a time (jobs due in an hour), against a master with
one replica and three Sentinels on this machine: the store reached by its
``redis://`` URL or through the Sentinels (``sentinel://...``), each with
``delayed_wait_replicas`` 0 (the script's reply is the acknowledgement) and 1
(the script is followed by ``WAIT 1`` on the same connection, in the same
round trip: the reply comes once the replica has the job). The four take
turns, so the machine's noise falls on all alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from celery_delayed import apply_later
from celery_delayed.testing.sentinel import SentinelGroup

from .celery_app import make_app
from .common import Ctx, uid

S17 = "17 schedule one at a time, delayed_wait_replicas 0 vs 1 (master + 1 replica)"


def wait_replicas(ctx: Ctx) -> None:
    n = ctx.size(10_000, 1_000)
    print(f"[{S17}] {n} jobs per variant, due in an hour", flush=True)
    with SentinelGroup(replicas=1) as group:
        master = f"redis://127.0.0.1:{group.master.port}/0"
        sentinel = {"delayed_redis_url": group.url, "delayed_redis_options": {"master_name": group.master_name}}
        variants: list[tuple[str, dict[str, object]]] = [
            ("redis:// URL, wait_replicas 0", {"delayed_redis_url": master}),
            ("redis:// URL, wait_replicas 1", {"delayed_redis_url": master, "delayed_wait_replicas": 1}),
            ("sentinel:// URL, wait_replicas 0", dict(sentinel)),
            ("sentinel:// URL, wait_replicas 1", {**sentinel, "delayed_wait_replicas": 1}),
        ]
        rounds = 5
        per = n // rounds
        runs: list[tuple[str, Callable[[], None]]] = []
        for name, conf in variants:
            u = uid()
            app = make_app(ctx.redis_url, f"b17{u}", f"q17{u}", **conf)
            for _ in range(50):  # warm up: connections, scripts, templates
                apply_later(app, "bench.late_d", (0.0,), None, 3600)

            def run(app: object = app) -> None:
                for _ in range(per):
                    apply_later(app, "bench.late_d", (0.0,), None, 3600)  # type: ignore[arg-type]

            runs.append((name, run))
        spent: dict[str, float] = {}
        for _ in range(rounds):
            for name, fn in runs:
                t0 = time.perf_counter()
                fn()
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        for name, _ in runs:
            ctx.add(S17, name, "jobs/s", per * rounds / spent[name], "jobs/s",
                    note=f"{rounds} interleaved rounds of {per}; {spent[name] / (per * rounds) * 1e6:.0f} us/job")
        ctx.relate(S17, "jobs/s", "redis:// URL, wait_replicas 0")
