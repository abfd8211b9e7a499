"""Scenarios 20 and 21: sustained lateness when each job is scheduled by its own call.

Scenario 16 schedules its 3,000 jobs with one ``apply_later_many`` before
they fall due. A web application does not: it makes one call per request,
while the workers run. Here each job is scheduled by its own call, made at a
random moment 0.5-2.5 s before the job is due (some calls inside the 2 s
look-ahead, some before it), by one producer that sleeps until each call's
moment; the due times are random over the window, as in scenario 16.

- celery-delayed as the README configures it: ``task.apply_later(args=...,
  when=...)`` of a ``DelayedTask`` with ``acks_late=True``, one
  ``prefork -c 2`` worker, one ``celery delayed run`` beside it;
- Celery's ETA path: ``apply_async(eta=...)`` of a plain task, the same
  worker settings.

Both systems' processes run for the whole scenario; the two take turns, round
by round (the order swapped each round), on the same jobs (the same call and
due times, from one seed per round), so that the noise of the machine falls on
both alike. They do not run at the same instant: two workers taking 600 jobs/s
each would saturate two cores, and measure that instead. Scenario 21 is the
same with a busy loop on one core for the whole run. A short warm-up round
per system (a twentieth of the jobs over 1 s) is run first and not counted.

Reported per system: p50 and p99 of task start - due time (median over the
rounds, each round's figure in the note), and the p99 ratio to Celery's in
each round.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

from .celery_app import make_app
from .common import (
    Ctx,
    Proc,
    celery_worker,
    delayed_scheduler,
    delete_prefix,
    pct,
    procs,
    runs,
    uid,
    wait_for,
    wait_ready,
    wait_scheduler,
)

S20 = "20 lateness, sustained, one call per job"
S21 = "21 lateness, sustained, one call per job, a busy loop beside"
DELAYED = "celery-delayed, apply_later per call (DelayedTask)"
ETA = "Celery ETA, apply_async(eta=) per call"
LEAD_S = (0.5, 2.5)  # each call is made this long before its job is due (uniform)
CONF = {"task_acks_late": True}


def sustained_calls(ctx: Ctx) -> None:
    """Scenario 20: one call per job while the worker runs, celery-delayed vs Celery's ETA path."""
    _run(ctx, S20, hog=False)


def sustained_calls_loaded(ctx: Ctx) -> None:
    """Scenario 21: the same with a busy loop on one core beside it for the whole run."""
    _run(ctx, S21, hog=True)


def _plan(seed: int, n: int, spread_s: float) -> list[tuple[float, float]]:
    """(call offset, due offset) of n jobs, seconds from the round's start, in call order."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(n):
        due = LEAD_S[1] + rng.random() * spread_s
        jobs.append((due - rng.uniform(*LEAD_S), due))
    return sorted(jobs)


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


def _round(client: Any, system: str, app: Any, prefix: str, plan: list[tuple[float, float]],
           wait_s: float) -> tuple[list[float], float, int]:
    """Make the calls of one round; return (lateness s, the calls' largest lag s, how many never ran)."""
    n = len(plan)
    client.delete(f"{prefix}:ran")
    base = time.time() + 0.5
    lag = 0.0
    if system == DELAYED:
        delayed_task = app.tasks["bench.late_d"]

        def send(due: float) -> None:
            delayed_task.apply_later(args=(due,), when=_at(due))
    else:
        eta_task = app.tasks["bench.late"]

        def send(due: float) -> None:
            eta_task.apply_async(args=(due,), eta=_at(due))
    for call, due in plan:
        pause = base + call - time.time()
        if pause > 0:
            time.sleep(pause)
        else:
            lag = max(lag, -pause)
        send(base + due)
    last_due = base + plan[-1][1] if plan else time.time()
    wait_for(lambda: client.llen(f"{prefix}:ran") >= n, max(0.0, last_due - time.time()) + wait_s, interval=0.05)
    done = runs(client, prefix)
    late = [start - d for _, start, d in done]
    missing = max(0, n - len({tid for tid, _, _ in done}))
    late += [time.time() - last_due] * missing  # lower bounds: still not run at the deadline
    return late, lag, missing


def _run(ctx: Ctx, scenario: str, hog: bool) -> None:
    n = ctx.size(3_000, 600)
    spread = float(ctx.size(5, 2))
    rounds = ctx.size(3, 1)
    wait_s = ctx.size(30, 15)
    print(f"[{scenario}] {n} jobs, one call each, due at random over {spread:.0f} s, worker prefork -c 2, "
          f"acks_late, {rounds} rounds{', a busy loop on one core' if hog else ''}", flush=True)
    client = ctx.client()
    systems = (DELAYED, ETA)
    late: dict[str, list[list[float]]] = {s: [] for s in systems}
    lags: dict[str, list[float]] = {s: [] for s in systems}
    missing: dict[str, int] = dict.fromkeys(systems, 0)
    setups: dict[str, tuple[Any, str, str]] = {}
    with procs() as ps:
        if hog:
            ps.append(Proc([sys.executable, "-c", "while True: pass"]))
        for system in systems:
            u = uid()
            prefix, queue = f"b20{u}", f"q20{u}"
            setups[system] = (make_app(ctx.redis_url, prefix, queue, **CONF), prefix, queue)
            ps.append(celery_worker(ctx.redis_url, prefix, queue, concurrency=2, conf=CONF))
            wait_ready(ps[-1], f"worker ({system})")
            if system == DELAYED:
                ps.append(delayed_scheduler(ctx.redis_url, prefix, queue, conf=CONF))
                if not wait_scheduler(client, prefix):
                    raise RuntimeError(f"the scheduler did not join: {ps[-1].output()[-3000:]}")
        # A short warm-up round per system, not counted: the first calls after the
        # processes start meet their start-up (imports, pool processes, connections).
        for system in systems:
            app, prefix, _ = setups[system]
            _round(client, system, app, prefix, _plan(0, max(10, n // 20), 1.0), wait_s)
        for r in range(rounds):
            plan = _plan(20 + r, n, spread)
            for system in (systems if r % 2 == 0 else systems[::-1]):
                app, prefix, _ = setups[system]
                got, lag, miss = _round(client, system, app, prefix, plan, wait_s)
                late[system].append(got)
                lags[system].append(lag)
                missing[system] += miss
                print(f"    round {r + 1}: {system}: p50 {pct(got, 50) * 1000:.1f} ms, p99 {pct(got, 99) * 1000:.1f} "
                      f"ms{f', {miss} never ran' if miss else ''}", flush=True)
    for _, prefix, queue in setups.values():
        delete_prefix(client, f"{prefix}:*", f"*{queue}*")
    for system in systems:
        p50s = [pct(x, 50) * 1000 for x in late[system]]
        p99s = [pct(x, 99) * 1000 for x in late[system]]
        note = f"median of {len(p99s)} rounds; the calls lagged their moment by at most " \
               f"{max(lags[system]) * 1000:.0f} ms"
        if missing[system]:
            note += f"; {missing[system]} jobs had not run {wait_s} s after the last due time (counted as that late)"
        ctx.add(scenario, system, "lateness p50", statistics.median(p50s), "ms",
                note="rounds: " + ", ".join(f"{x:.1f}" for x in p50s))
        ctx.add(scenario, system, "lateness p99", statistics.median(p99s), "ms",
                note=f"rounds: {', '.join(f'{x:.1f}' for x in p99s)}; {note}")
        ctx.lateness[f"{scenario.split(' ', 1)[0]} per call{', loaded' if hog else ''}: {system}"] = \
            [v for x in late[system] for v in x]
    for metric in ("lateness p50", "lateness p99"):
        ctx.relate(scenario, metric, ETA)
    ratios = [pct(d, 99) / pct(e, 99) for d, e in zip(late[DELAYED], late[ETA], strict=True) if pct(e, 99) > 0]
    if ratios:
        ctx.add(scenario, DELAYED, "p99 / Celery ETA's p99, same round", statistics.median(ratios), "x",
                note=f"median of {len(ratios)} rounds ({', '.join(f'{x:.2f}' for x in ratios)})")
    ctx.notes.append(f"scenario {scenario.split(' ', 1)[0]}: {n} jobs a round, each scheduled by its own call "
                     f"{LEAD_S[0]}-{LEAD_S[1]} s before it is due, due at random over {spread:.0f} s; one worker "
                     "-P prefork -c 2 per system with task_acks_late, both systems' processes up for the whole "
                     "run, taking turns round by round on the same jobs"
                     + ("; a busy loop (python `while True: pass`) on one core for the whole run" if hog else ""))
