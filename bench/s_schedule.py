"""Scenarios 1 and 2: how fast jobs due in an hour can be scheduled.

1. One call at a time: ``apply_later`` vs Celery ``apply_async(countdown=)``,
   RQ ``enqueue_in``, dramatiq ``send_with_options(delay=)``, arq
   ``enqueue_job(_defer_by=)``: jobs/s, and the ratio to Celery's. Beside
   them, the floor of ``apply_later`` on this design: one round trip with its
   keys and arguments to a script that does nothing, and that plus its
   script's own Redis time (``INFO commandstats``).
2. In bulk: ``apply_later_many`` vs a bare multi-member ZADD of the same
   number of members (the ceiling of any sorted-set scheduler).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from celery_delayed import apply_later, apply_later_many, get_store

from .celery_app import make_app
from .common import Ctx, uid

S1 = "1 schedule, one call at a time"
S2 = "2 bulk schedule (apply_later_many)"


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("nan")


def one_at_a_time(ctx: Ctx) -> None:
    n = ctx.size(20_000, 2_000)
    print(f"[{S1}] {n} jobs per system, due in an hour", flush=True)
    u = uid()
    app = make_app(ctx.redis_url, f"b1{u}", f"q1{u}")
    late, late_d = app.tasks["bench.late"], app.tasks["bench.late_d"]
    # Warm up both paths (connections, script load, message templates).
    for _ in range(50):
        late_d.apply_later(args=(0.0,), when=3600)
        late.apply_async(args=(0.0,), countdown=3600)

    rounds = 5  # the systems take turns, so that the machine's noise falls on all of them alike
    per = n // rounds

    def delayed() -> None:
        for _ in range(per):
            apply_later(app, "bench.late_d", (0.0,), None, 3600)

    def celery_eta() -> None:
        for _ in range(per):
            late.apply_async(args=(0.0,), countdown=3600)

    floor = _round_trip_floor(app, per)
    systems = [("celery-delayed apply_later", delayed), ("Celery apply_async(countdown)", celery_eta)]
    systems += _alternatives(ctx, per, u)
    systems.append((FLOOR, floor))
    spent: dict[str, float] = {}
    failed: dict[str, str] = {}
    server = ctx.client()
    script_us = 0.0  # Redis time of apply_later's script (INFO commandstats around its rounds only)
    for _ in range(rounds):
        for name, fn in systems:
            if name in failed:
                continue
            before = _evalsha_usec(server) if name == "celery-delayed apply_later" else 0.0
            t0 = time.perf_counter()
            try:
                fn()  # type: ignore[operator]
            except Exception as exc:  # an alternative that cannot run here is reported, not fatal
                failed[name] = f"failed: {exc!r}"[:200]
                continue
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            if name == "celery-delayed apply_later":
                script_us += _evalsha_usec(server) - before
    for name, _ in systems:
        if name in failed:
            ctx.add(S1, name, "jobs/s", None, "jobs/s", note=failed[name])
        elif name == FLOOR:
            ctx.add(S1, name, "jobs/s", _rate(per * rounds, spent[name]), "jobs/s",
                    note="one EVALSHA of apply_later's keys and arguments to a script that returns at once, "
                         "on apply_later's connection: the round trip no apply_later can beat")
        else:
            ctx.add(S1, name, "jobs/s", _rate(per * rounds, spent[name]), "jobs/s",
                    note=f"{rounds} interleaved rounds of {per}")
    if FLOOR not in failed and spent.get("celery-delayed apply_later"):
        n = per * rounds
        per_call = spent[FLOOR] / n + script_us / n / 1e6
        ctx.add(S1, FLOOR_AND_SCRIPT, "jobs/s", 1 / per_call, "jobs/s",
                note=f"the round trip above plus the schedule script's own Redis time ({script_us / n:.1f} µs a "
                     "call): what apply_later would reach with no Python of its own")
    ctx.relate(S1, "jobs/s", "Celery apply_async(countdown)")
    _cleanup(ctx, u)


FLOOR = "floor: the round trip of apply_later's call"
FLOOR_AND_SCRIPT = "floor: that round trip + apply_later's script"


def _evalsha_usec(client: Any) -> float:
    """Redis time spent in EVALSHA so far, µs (INFO commandstats)."""
    return float(client.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0))


def _round_trip_floor(app: Any, n: int) -> Callable[[], None]:
    """``n`` EVALSHA calls of a script that does nothing, with the keys and arguments of one ``apply_later``
    call (captured from the store), on the connection apply_later uses (the thread's lane)."""
    store = get_store(app)
    seen: list[tuple[Any, Any]] = []
    run_many = store.redis.run_many

    def grab(script: Any, calls: Any, *args: Any, **kwargs: Any) -> list[Any]:
        seen.extend(calls)
        return run_many(script, calls, *args, **kwargs)

    store.redis.run_many = grab  # type: ignore[method-assign]
    try:  # a call of a shard the template was sent to already (not the first: that one carries it)
        for _ in range(1000):
            apply_later(app, "bench.late_d", (0.0,), None, 3600)
            if "~tpl" not in seen[-1][1]:
                break
    finally:
        del store.redis.run_many
    keys, args = seen[-1]
    noop = _Noop(store.redis.client)
    lane = store.redis.lane()

    def floor() -> None:
        for _ in range(n):
            lane.call(noop, keys, args)  # type: ignore[arg-type]

    return floor


class _Noop:
    """A script that returns at once, shaped as the store's :class:`~celery_delayed.store.loader.Script`."""

    source = "return 1"

    def __init__(self, client: Any) -> None:
        self.sha = client.script_load(self.source)

    def ensure_loaded(self, client: Any) -> None:
        client.script_load(self.source)


def _alternatives(ctx: Ctx, n: int, u: str) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    try:
        import redis as redis_py
        from rq import Queue

        from .jobs import rq_late

        conn = redis_py.Redis.from_url(ctx.redis_url)
        q = Queue(f"rq{u}", connection=conn)
        q.enqueue_in(timedelta(hours=1), rq_late, 0.0)

        def rq() -> None:
            for _ in range(n):
                q.enqueue_in(timedelta(hours=1), rq_late, 0.0)

        out.append(("RQ enqueue_in", rq))
    except ImportError as exc:
        ctx.notes.append(f"RQ not measured: {exc}")
    try:
        import dramatiq
        from dramatiq.brokers.redis import RedisBroker

        broker = RedisBroker(url=ctx.redis_url, namespace=f"dq{u}")
        dramatiq.set_broker(broker)

        @dramatiq.actor(queue_name=f"dq{u}", broker=broker)
        def dq_late(due: float = 0.0) -> None:
            """Never run: only scheduling is measured."""

        dq_late.send_with_options(args=(0.0,), delay=3_600_000)

        def dq() -> None:
            for _ in range(n):
                dq_late.send_with_options(args=(0.0,), delay=3_600_000)

        out.append(("dramatiq send_with_options(delay)", dq))
    except ImportError as exc:
        ctx.notes.append(f"dramatiq not measured: {exc}")
    try:
        from arq import create_pool
        from arq.connections import RedisSettings

        settings = RedisSettings.from_dsn(ctx.redis_url)

        async def arq_run() -> None:
            pool = await create_pool(settings, default_queue_name=f"arq{u}")
            try:
                for _ in range(n):
                    await pool.enqueue_job("arq_late", 0.0, _defer_by=3600)
            finally:
                await pool.aclose()

        out.append(("arq enqueue_job(_defer_by)", lambda: asyncio.run(arq_run())))
    except ImportError as exc:
        ctx.notes.append(f"arq not measured: {exc}")
    return out


def _cleanup(ctx: Ctx, u: str) -> None:
    from .common import delete_prefix

    client = ctx.client()
    delete_prefix(client, f"*{u}*")


def bulk(ctx: Ctx) -> None:
    n = ctx.size(200_000, 20_000)
    print(f"[{S2}] {n} jobs", flush=True)
    u = uid()
    app = make_app(ctx.redis_url, f"b2{u}", f"q2{u}")
    apply_later_many(app, "bench.late_d", [{"args": (0.0,), "when": 3600}] * 10)  # warm up
    calls = [{"args": (float(i),), "when": 3600} for i in range(n)]
    t0 = time.perf_counter()
    apply_later_many(app, "bench.late_d", calls)
    ctx.add(S2, "celery-delayed apply_later_many", "jobs/s", _rate(n, time.perf_counter() - t0), "jobs/s")
    calls = [{"args": (float(i),), "when": 3600} for i in range(n)]
    t0 = time.perf_counter()
    for i in range(0, n, 10_000):
        apply_later_many(app, "bench.late_d", calls[i:i + 10_000])
    ctx.add(S2, "celery-delayed apply_later_many (chunks of 10,000)", "jobs/s",
            _rate(n, time.perf_counter() - t0), "jobs/s")
    client = ctx.client()
    members = [(f"{u}-{i:09d}", 1e12 + i) for i in range(n)]
    t0 = time.perf_counter()
    for i in range(0, n, 10_000):
        client.zadd(f"zref{u}", dict(members[i:i + 10_000]))
    ctx.add(S2, "reference: bare multi-member ZADD", "jobs/s", _rate(n, time.perf_counter() - t0), "members/s")
    ctx.relate(S2, "jobs/s", "reference: bare multi-member ZADD")
    _cleanup(ctx, u)
