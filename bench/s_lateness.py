"""Scenarios 4, 5 and 9: when tasks start, and how often.

4. Burst: N tasks due at one instant, one worker ``-c 2`` (prefork, then
   solo): lateness (task start - due time) p50/p99/max, and how long the
   scheduler took to push the whole burst into the queue.
5. Light load: one job every ~10 ms, each due 0.5 s after it is scheduled;
   and head of line: one job due in 3 s scheduled after 10,000 due in an hour.
9. Duplicates: tasks due in 15 s with ``visibility_timeout=5`` and
   ``unacked_restore_throttle=1``: how many ran more than once.
"""

from __future__ import annotations

import collections
import os
import random
import time
from datetime import datetime, timezone
from typing import Any

from celery_delayed import apply_later, apply_later_many, get_store

from .celery_app import make_app
from .common import (
    Ctx,
    celery_worker,
    delayed_scheduler,
    delete_prefix,
    procs,
    runs,
    summary,
    uid,
    wait_for,
    wait_ready,
    wait_scheduler,
)

S4 = "4 lateness, burst"
S5 = "5 lateness, light load"
S5H = "5 head of line"
S9 = "9 duplicates"


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


def _lateness(ctx: Ctx, scenario: str, system: str, label: str, client: Any, prefix: str, n: int,
              deadline_s: float, due: float | None = None) -> list[float]:
    """Wait for n runs (or the deadline); record p50/p99/max; unfinished count at the deadline."""
    got = wait_for(lambda: client.llen(f"{prefix}:ran") >= n, deadline_s, interval=0.05)
    done = runs(client, prefix)
    late = [start - d for _, start, d in done]
    note = ""
    if not got:
        missing = n - len(done)
        cutoff = time.time()
        ref = due if due is not None else (max(d for _, _, d in done) if done else cutoff)
        late += [cutoff - ref] * missing  # lower bounds: still not run at the deadline
        note = f"{missing} of {n} had not run after {deadline_s:.0f} s (counted as late as the deadline)"
    s = summary(late)
    ctx.add(scenario, system, "lateness p50", s["p50"] * 1000, "ms", note=note)
    ctx.add(scenario, system, "lateness p99", s["p99"] * 1000, "ms")
    ctx.add(scenario, system, "lateness max", s["max"] * 1000, "ms")
    ctx.lateness[label] = late
    return late


def burst(ctx: Ctx) -> None:
    n = ctx.size(2_000, 300)
    deadline = ctx.size(45, 12)
    print(f"[{S4}] {n} tasks due at one instant", flush=True)
    client = ctx.client()
    _delayed_burst(ctx, client, n, deadline, "prefork", "bench.late_d", "celery-delayed")
    _delayed_burst(ctx, client, n, deadline, "prefork", "bench.late", "celery-delayed, plain task")
    _eta_burst(ctx, client, n, deadline, "prefork")
    _delayed_burst(ctx, client, n, deadline, "solo", "bench.late_d", "celery-delayed")
    _eta_burst(ctx, client, n, deadline, "solo")
    for metric in ("lateness p50", "lateness p99", "lateness max"):
        ctx.relate(S4, metric, "Celery ETA, prefork -c 2")
    ctx.notes.append("scenario 4: 'celery-delayed' runs the task on the DelayedTask base class (it re-reads the "
                     "job's state and records it: extra round trips per task); 'plain task' is the same release "
                     "path with a plain Celery task, to separate release lateness from worker-side cost")


def _delayed_burst(ctx: Ctx, client: Any, n: int, deadline: float, pool: str, task: str, label: str) -> None:
    u = uid()
    prefix, queue = f"b4{u}", f"q4{u}"
    app = make_app(ctx.redis_url, prefix, queue)
    system = f"{label}, {pool}" + (" -c 2" if pool == "prefork" else "")
    with procs() as ps:
        ps.append(celery_worker(ctx.redis_url, prefix, queue, pool=pool, concurrency=2))
        ps.append(delayed_scheduler(ctx.redis_url, prefix, queue))
        wait_ready(ps[0], "worker")
        wait_scheduler(client, prefix)
        due = time.time() + 2.0
        handles = apply_later_many(app, task, [{"args": (due,), "when": _at(due)} for _ in range(n)])
        _lateness(ctx, S4, system, f"burst: {system}", client, prefix, n, deadline, due)
        store = get_store(app)
        pipe = client.pipeline(transaction=False)
        for h in handles:
            pipe.hget(store.keys.shard(h.shard).job(h.id), "released")
        released = [int(x) for x in pipe.execute() if x]
        if released:
            due_ms = handles[0].due_ms
            ctx.add(S4, system, "burst released into the queue within", max(released) - due_ms, "ms",
                    note=f"first {min(released) - due_ms} ms after due (store records, Redis clock)")
    delete_prefix(client, f"{prefix}:*")
    client.unlink(queue)


def _eta_burst(ctx: Ctx, client: Any, n: int, deadline: float, pool: str) -> None:
    u = uid()
    prefix, queue = f"b4e{u}", f"q4e{u}"
    app = make_app(ctx.redis_url, prefix, queue)
    system = f"Celery ETA, {pool}" + (" -c 2" if pool == "prefork" else "")
    with procs() as ps:
        ps.append(celery_worker(ctx.redis_url, prefix, queue, pool=pool, concurrency=2))
        wait_ready(ps[0], "worker")
        late = app.tasks["bench.late"]
        due = time.time() + max(2.0, n / 800)
        for _ in range(n):
            late.apply_async(args=(due,), eta=_at(due))
        _lateness(ctx, S4, system, f"burst: {system}", client, prefix, n, deadline, due)
    delete_prefix(client, f"{prefix}:*", f"*{queue}*")


def light(ctx: Ctx) -> None:
    secs = ctx.size(20, 3)
    systems = ("celery-delayed", "celery-delayed, plain task", "Celery ETA")
    print(f"[{S5}] one job every ~10 ms for {secs} s, each due 0.5 s later, the systems taking turns", flush=True)
    client = ctx.client()
    setups = []
    with procs() as ps:
        # All systems run side by side and take turns job by job, so that the
        # machine's noise falls on all of them alike.
        for system in systems:
            u = uid()
            prefix, queue = f"b5{u}", f"q5{u}"
            app = make_app(ctx.redis_url, prefix, queue)
            worker = celery_worker(ctx.redis_url, prefix, queue, concurrency=2)
            ps.append(worker)
            if system.startswith("celery-delayed"):
                ps.append(delayed_scheduler(ctx.redis_url, prefix, queue))
                wait_scheduler(client, prefix)
            setups.append((system, app, prefix, queue, worker))
        for *_, worker in setups:
            wait_ready(worker, "worker")
        counts = dict.fromkeys(systems, 0)
        end, turn = time.monotonic() + secs, 0
        while time.monotonic() < end:
            system, app, *_ = setups[turn % len(setups)]
            turn += 1
            due = time.time() + 0.5
            if system.startswith("celery-delayed"):
                apply_later(app, "bench.late" if "plain" in system else "bench.late_d", (due,), None, _at(due))
            else:
                app.tasks["bench.late"].apply_async(args=(due,), eta=_at(due))
            counts[system] += 1
            time.sleep(0.01)
        for system, _, prefix, _, _ in setups:
            _lateness(ctx, S5, system, f"light: {system}", client, prefix, counts[system], 15)
        for system, app, prefix, _, _ in setups:
            _head_of_line(ctx, app, system, client, prefix, counts[system])
    for _, _, prefix, queue, _ in setups:
        delete_prefix(client, f"{prefix}:*", f"*{queue}*")
    for metric in ("lateness p50", "lateness p99", "lateness max"):
        ctx.relate(S5, metric, "Celery ETA")
    ctx.notes.append(f"scenario 5: the three systems ran side by side, taking turns: one job every ~10 ms in all, "
                     f"so every ~{10 * len(systems)} ms per system")


def _head_of_line(ctx: Ctx, app: Any, system: str, client: Any, prefix: str, before: int) -> None:
    far = time.time() + 3600
    n_far = ctx.size(10_000, 2_000)
    if system.startswith("celery-delayed"):
        apply_later_many(app, "bench.late_d", [{"args": (far,), "when": 3600} for _ in range(n_far)])
        due = time.time() + 3
        apply_later(app, "bench.late_d", (due,), None, _at(due))
    else:
        late = app.tasks["bench.late"]
        for _ in range(n_far):
            late.apply_async(args=(far,), countdown=3600)
        due = time.time() + 3
        late.apply_async(args=(due,), eta=_at(due))
    ok = wait_for(lambda: client.llen(f"{prefix}:ran") > before, 15, interval=0.02)
    if not ok:
        ctx.add(S5H, system, "lateness of the one due job", None, "ms", note=f"did not run within 12 s of its due "
                f"time, behind {n_far} jobs due in an hour")
        return
    _, start, d = runs(client, prefix)[-1]
    ctx.add(S5H, system, "lateness of the one due job", (start - d) * 1000, "ms",
            note=f"scheduled after {n_far} jobs due in an hour")


def duplicates(ctx: Ctx) -> None:
    n = ctx.size(200, 50)
    countdown = ctx.size(15, 6)
    vis = ctx.size(5, 2)
    conf = {"broker_transport_options": {"visibility_timeout": vis, "unacked_restore_throttle": 1}}
    print(f"[{S9}] {n} tasks, countdown {countdown} s, visibility_timeout={vis}, unacked_restore_throttle=1",
          flush=True)
    client = ctx.client()
    setups = []
    with procs() as ps:
        for system in ("celery-delayed", "Celery ETA", "Celery ETA, acks_late"):
            u = uid()
            prefix, queue = f"b9{u}", f"q9{u}"
            c = dict(conf)
            if system.endswith("acks_late"):
                c["task_acks_late"] = True
            app = make_app(ctx.redis_url, prefix, queue, **c)
            ps.append(celery_worker(ctx.redis_url, prefix, queue, concurrency=2, conf=c))
            if system == "celery-delayed":
                ps.append(delayed_scheduler(ctx.redis_url, prefix, queue, conf=c))
            setups.append((system, app, prefix, queue, ps[-1] if system != "celery-delayed" else ps[-2]))
        for *_, w in setups:
            wait_ready(w, "worker")
        for system, app, _prefix, _, _ in setups:
            if system == "celery-delayed":
                apply_later_many(app, "bench.late_d", [{"args": (0.0,), "when": countdown} for _ in range(n)])
            else:
                late = app.tasks["bench.late"]
                for _ in range(n):
                    late.apply_async(args=(0.0,), countdown=countdown)
        # Long enough for the restore sweep to redeliver after the ETA passes.
        time.sleep(countdown + 2 * vis + ctx.size(6, 3))
        for system, _, prefix, _, _ in setups:
            counts = collections.Counter(t for t, _, _ in runs(client, prefix))
            extra = sum(v - 1 for v in counts.values())
            ctx.add(S9, system, "extra runs", extra, "runs",
                    note=f"{len(counts)} of {n} tasks ran, {sum(counts.values())} runs in all")
    for _, _, prefix, queue, _ in setups:
        delete_prefix(client, f"{prefix}:*", f"*{queue}*")


S16 = "16 lateness, sustained burst"


def sustained(ctx: Ctx) -> None:
    """3,000 jobs due at random over 5 s (600/s, near one worker's saturation), acks_late as the README
    recommends: lateness of Celery's ETA path, of a producer publishing each task at its due time, and
    of apply_later (plain task and DelayedTask) with and without look-ahead release."""
    n = ctx.size(3_000, 600)
    spread = ctx.size(5.0, 2.0)
    conf = {"task_acks_late": True}
    print(f"[{S16}] {n} jobs due at random over {spread:.0f} s, worker prefork -c 2, acks_late", flush=True)
    client = ctx.client()
    variants: list[tuple[str, str, dict[str, Any]]] = [
        ("Celery ETA, apply_async(eta=)", "eta", {}),
        ("producer publishing at the due time", "publish", {}),
        ("apply_later, plain task, look-ahead 0", "bench.late", {"delayed_lookahead_ms": 0}),
        ("apply_later, DelayedTask, look-ahead 0", "bench.late_d", {"delayed_lookahead_ms": 0}),
        ("apply_later, plain task (defaults)", "bench.late", {}),
        ("apply_later, DelayedTask (defaults)", "bench.late_d", {}),
    ]
    for la in filter(None, os.environ.get("BENCH_LOOKAHEADS", "").split(",")):  # to choose the default
        variants += [(f"apply_later, plain task, look-ahead {la}", "bench.late", {"delayed_lookahead_ms": int(la)}),
                     (f"apply_later, DelayedTask, look-ahead {la}", "bench.late_d", {"delayed_lookahead_ms": int(la)})]
    only = os.environ.get("BENCH_ONLY")
    if only:
        variants = [v for v in variants if v is variants[0] or only in v[0]]
    rng = random.Random(16)
    for system, how, extra in variants:
        c = {**conf, **extra}
        u = uid()
        prefix, queue = f"b16{u}", f"q16{u}"
        app = make_app(ctx.redis_url, prefix, queue, **c)
        with procs() as ps:
            ps.append(celery_worker(ctx.redis_url, prefix, queue, concurrency=2, conf=c))
            if how.startswith("bench."):
                ps.append(delayed_scheduler(ctx.redis_url, prefix, queue, conf=c))
                wait_scheduler(client, prefix)
            wait_ready(ps[0], "worker")
            start = time.time() + 3.0
            dues = sorted(start + rng.random() * spread for _ in range(n))
            if how == "eta":
                late = app.tasks["bench.late"]
                for d in dues:
                    late.apply_async(args=(d,), eta=_at(d))
            elif how == "publish":
                late = app.tasks["bench.late"]
                for d in dues:
                    pause = d - time.time()
                    if pause > 0:
                        time.sleep(pause)
                    late.apply_async(args=(d,))
            else:
                apply_later_many(app, how, [{"args": (d,), "when": _at(d)} for d in dues])
            _lateness(ctx, S16, system, f"sustained: {system}", client, prefix, n,
                      max(0.0, start + spread - time.time()) + ctx.size(40, 15))
        delete_prefix(client, f"{prefix}:*", f"*{queue}*")
    for metric in ("lateness p50", "lateness p99", "lateness max"):
        ctx.relate(S16, metric, variants[0][0])
    ctx.notes.append(f"scenario 16: {n} jobs due at random over {spread:.0f} s, one worker -P prefork -c 2 "
                     "with task_acks_late; 'defaults' is delayed_lookahead_ms at its default")
