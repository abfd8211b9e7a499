"""``python -m bench all [--quick]`` or ``python -m bench <scenario> ...``.

Starts a private redis-server, runs the scenarios (each bounded in time)
against celery-delayed and the alternatives on that one server, and writes
``bench/results/latest.md``, ``latest.json`` and ``lateness.png``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import traceback
import warnings
from collections.abc import Callable

from celery_delayed.testing import RedisServer

from . import (
    report,
    s_calls,
    s_cluster,
    s_drain,
    s_durability,
    s_lateness,
    s_memory,
    s_ops,
    s_publish,
    s_release,
    s_replicas,
    s_reshard,
    s_schedule,
    s_shaping,
)
from .common import Ctx

SCENARIOS: dict[str, Callable[[Ctx], None]] = {
    "schedule": s_schedule.one_at_a_time,  # 1
    "bulk": s_schedule.bulk,  # 2
    "release": s_release.release,  # 3
    "burst": s_lateness.burst,  # 4
    "light": s_lateness.light,  # 5 (and head of line)
    "worker-memory": s_memory.worker_memory,  # 6
    "redis-memory": s_memory.redis_memory,  # 7
    "idle": s_memory.idle,  # 8
    "duplicates": s_lateness.duplicates,  # 9
    "buckets": s_release.buckets,  # 10
    "postgres": s_release.postgres,  # 11
    "metrics-cost": s_ops.metrics_cost,  # 12
    "dashboard": s_ops.dashboard,  # 13
    "durability": s_durability.durability,  # 14
    "drain": s_drain.drain,  # 15
    "sustained": s_lateness.sustained,  # 16
    "wait-replicas": s_replicas.wait_replicas,  # 17
    "cluster": s_cluster.cluster,  # 18
    "reshard": s_reshard.reshard,  # 19
    "sustained-calls": s_calls.sustained_calls,  # 20
    "sustained-calls-loaded": s_calls.sustained_calls_loaded,  # 21
    "publish": s_publish.publish,  # 22
    "tenant-fairness": s_shaping.tenant_fairness,  # 23
    "rate-limit": s_shaping.rate_limit,  # 24
    "shaping-cost": s_shaping.shaping_cost,  # 25
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("scenario", nargs="+", choices=["all", *SCENARIOS], help="what to run")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a minute or two")
    parser.add_argument("--out", default="latest", help="results name: bench/results/<out>.md and .json")
    args = parser.parse_args(argv)
    names = list(SCENARIOS) if "all" in args.scenario else args.scenario
    # Each measurement builds its own app with the same two task names.
    warnings.filterwarnings("ignore", message="Task name .* is already registered")
    if shutil.which("redis-server") is None:
        print("redis-server is not installed (apt-get install redis-server)", file=sys.stderr)
        return 2
    started = time.monotonic()
    # No maxmemory, no persistence: a private throw-away server, as the tests use.
    with RedisServer("--maxmemory", "0") as server:
        ctx = Ctx(server.url, args.quick)
        for name in names:
            t0 = time.monotonic()
            try:
                SCENARIOS[name](ctx)
            except Exception as exc:
                traceback.print_exc()
                ctx.notes.append(f"scenario {name} failed: {exc!r}"[:300])
            print(f"  ({name}: {time.monotonic() - t0:.0f} s)", flush=True)
        report.write(ctx, names if "all" not in args.scenario else ["all"], time.monotonic() - started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
