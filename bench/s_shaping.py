"""Scenarios 23, 24 and 25: release shaping (``delayed_rate_limits``, ``tenant=``).

23. Tenant fairness: N jobs of tenant A (200,000) and 10 of tenant B, all due
    within one second (A's spread evenly over it, B's at 50, 150, ... 950 ms),
    released by one ``celery delayed run`` with ``delayed_lookahead_ms=0``
    (each job goes when it is due, not a look-ahead early: the strict case).
    Side by side, taking turns round by round (order swapped each round;
    an uncounted warm-up of each at a tenth of the size first): the
    same jobs with ``tenant=`` given, and with no tenant (today's order, one
    due index, earliest first). From the records: B's release lateness
    (``released`` - ``due``, Redis clock) p99, and A's drain time (the second's
    start to A's last release).
24. Rate limit accuracy: ``delayed_rate_limits = {"bench.late_d": "100/s"}``,
    8 shards, a backlog due at one instant that lasts past the window, 60 s
    (``--quick``: 20 s) of releases by 4 ``celery delayed run`` processes,
    and by 1 beside them (rounds alternate): jobs released in every 10 s
    window (``released`` field), against 1,000 per window.
25. The cost with no limit: the release rate of N due jobs (100,000), a
    process per variant (``bench/release_ab.py``), this code
    against the code before shaping (``BENCH_BASELINE_REV``, default
    6ff0d7e, exported with ``git archive``; or ``BENCH_BASELINE_TREE``, a
    checkout of it); also this code with a limit in force on another task,
    and with every job of one tenant. Each round fills every variant, then
    releases the A/B pair back to back (its order swapped each round), then
    the other two; the ratio to the baseline in each round, median and spread.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from celery_delayed import apply_later_many
from celery_delayed.producer.prepare import prepare
from celery_delayed.store import NewJob, Store, get_store

from .celery_app import make_app
from .common import ROOT, Ctx, Proc, delayed_scheduler, delete_prefix, pct, procs, uid, wait_for, wait_scheduler

S23 = "23 tenant fairness (one tenant's flood)"
S24 = "24 rate limit accuracy (100/s, several schedulers)"
S25 = "25 shaping cost with no limit (release rate)"

FAIR = "tenants given (A and B)"
FIFO = "no tenant (today's order: earliest first)"
TASK = "bench.late_d"


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc)


def _fill(store: Store, app: Any, ids: Sequence[str], due_of: Any, tenant: str | None) -> float:
    """Schedule jobs ``ids`` through ``store.jobs.schedule`` (one prepared job copied); return seconds."""
    base = prepare(app, store, TASK, (0.0,), {}, 0, task_type=app.tasks[TASK], tenant=tenant).job
    chunk = 20_000

    def one(start: int) -> None:
        store.jobs.schedule([NewJob(jid, store.layout.shard_of(jid), due_of(i), base.fields, base.common,
                                    base.template)
                             for i, jid in enumerate(ids[start:start + chunk], start)])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(one, s) for s in range(0, len(ids), chunk)]:
            f.result()
    return time.perf_counter() - t0


def _released(store: Store, ids: Sequence[str]) -> dict[str, tuple[int, int | None]]:
    """id -> (due, released or None), read from the records (HMGET per job, pipelined)."""
    client = store.redis.client
    out: dict[str, tuple[int, int | None]] = {}
    for start in range(0, len(ids), 5000):
        part = ids[start:start + 5000]
        pipe = client.pipeline(transaction=False)
        for jid in part:
            pipe.hmget(store.keys.shard(store.layout.shard_of(jid)).job(jid), "due", "released")
        for jid, (due, rel) in zip(part, pipe.execute(), strict=True):
            if due is not None:
                out[jid] = (int(due), int(rel) if rel is not None else None)
    return out


def _spread(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


# -- 23 ---------------------------------------------------------------------------------------------------------


def _fair_round(ctx: Ctx, n_a: int, tenants: bool, lead_ms: int, lookahead_ms: int) -> dict[str, Any]:
    """One measurement: A's flood and B's ten jobs due in one second (``overran``: the fill ended too late)."""
    u = uid()
    prefix, queue = f"b23{u}", f"q23{u}"
    conf = {"delayed_lookahead_ms": lookahead_ms}
    app = make_app(ctx.redis_url, prefix, queue, **conf)
    store = get_store(app)
    client = ctx.client()
    try:
        with procs() as ps:
            ps.append(delayed_scheduler(ctx.redis_url, prefix, queue, conf=conf))
            if not wait_scheduler(client, prefix, 60):
                raise RuntimeError(f"scheduler did not join: {ps[0].output()[-2000:]}")
            t_ms = store.redis.now_ms() + lead_ms  # the second's start
            a_ids = [f"{u}-a{i}" for i in range(n_a)]
            fill_s = _fill(store, app, a_ids, lambda i: str(t_ms + i * 1000 // n_a), "A" if tenants else None)
            b_due = [t_ms + 50 + 100 * k for k in range(10)]
            res = apply_later_many(app, TASK, [{"args": (0.0,), "when": _at(d)} for d in b_due],
                                   tenant="B" if tenants else None)
            b_ids = [r.id for r in res]
            slack = t_ms - store.redis.now_ms()
            if slack < 200:
                return {"overran": True, "fill_s": fill_s}
            total = n_a + len(b_ids)
            done = wait_for(lambda: client.llen(queue) >= total, 120 + n_a / 1000, interval=0.05)
        recs = _released(store, a_ids + b_ids)
    finally:
        delete_prefix(client, f"{prefix}:*")
        client.unlink(queue)
    a_rel = [r for _, r in (recs.get(i, (0, None)) for i in a_ids) if r is not None]
    a_late = [r - d for d, r in (recs.get(i, (0, None)) for i in a_ids) if r is not None]
    b_late = [r - d for d, r in (recs.get(i, (0, None)) for i in b_ids) if r is not None]
    return {"overran": False, "fill_s": fill_s, "done": bool(done), "slack_ms": slack,
            "a_released": len(a_rel), "b_released": len(b_late),
            "b_p99": pct(b_late, 99) if b_late else None, "b_max": max(b_late) if b_late else None,
            "a_drain_s": (max(a_rel) - t_ms) / 1000 if a_rel else None,
            "a_p50": pct(a_late, 50) if a_late else None, "a_p99": pct(a_late, 99) if a_late else None}


def tenant_fairness(ctx: Ctx) -> None:
    n_a = ctx.size(200_000, 20_000)
    rounds = ctx.size(3, 2)
    lookahead_ms = int(os.environ.get("BENCH_FAIR_LOOKAHEAD_MS", "0"))
    print(f"[{S23}] {n_a:,} jobs of tenant A and 10 of B due in one second, {rounds} rounds, tenants given vs not",
          flush=True)
    # How long ahead the second starts: the fill of A's jobs must end before it. A first
    # guess from a small fill, then each fill's own time (the machine's speed drifts).
    probe = make_app(ctx.redis_url, f"b23p{uid()}", "q23p")
    pstore = get_store(probe)
    far = pstore.redis.now_ms() + 3_600_000
    probe_n = min(n_a, 10_000)
    probe_s = _fill(pstore, probe, [f"p{i}" for i in range(probe_n)], lambda i: str(far), "A")
    delete_prefix(ctx.client(), f"{probe.conf.delayed_key_prefix}:*")
    fill_guess_s = probe_s * n_a / probe_n
    got: dict[str, list[dict[str, Any]]] = {FAIR: [], FIFO: []}
    # An uncounted warm-up of each at a tenth of the size (Redis grows its memory, the scripts load).
    for name in (FAIR, FIFO):
        _fair_round(ctx, max(1000, n_a // 10), name == FAIR, int(2000 + 200 * fill_guess_s), lookahead_ms)
    for r in range(rounds):
        order = [FAIR, FIFO] if r % 2 == 0 else [FIFO, FAIR]
        for name in order:
            out = None
            for _attempt in range(3):
                lead_ms = int(2000 + 2000 * fill_guess_s)
                out = _fair_round(ctx, n_a, name == FAIR, lead_ms, lookahead_ms)
                fill_guess_s = max(fill_guess_s, out["fill_s"])
                if not out["overran"]:
                    break
                print(f"    round {r + 1}: {name}: the fill overran the second ({lead_ms} ms ahead); again",
                      flush=True)
            if out is None or out["overran"]:
                ctx.notes.append(f"scenario 23 round {r + 1} {name}: the fill never ended before the jobs were due")
                continue
            print(f"    round {r + 1}: {name}: B p99 {out['b_p99']} ms (max {out['b_max']}), A drained in "
                  f"{out['a_drain_s']} s (A p50 {out['a_p50']} ms, p99 {out['a_p99']} ms), released "
                  f"{out['a_released']:,} + {out['b_released']}, all queued: {out['done']}", flush=True)
            got[name].append(out)
    for name in (FAIR, FIFO):
        outs = [o for o in got[name] if o["b_p99"] is not None and o["a_drain_s"] is not None]
        if not outs:
            ctx.add(S23, name, "B release lateness p99", None, "ms", note="no complete round")
            continue
        b = [o["b_p99"] for o in outs]
        a = [o["a_drain_s"] for o in outs]
        ctx.add(S23, name, "B release lateness p99", statistics.median(b), "ms",
                note=f"median of {len(b)} rounds ({_spread(b, '{:,.0f}')}); 10 jobs of B: p99 = the latest")
        ctx.add(S23, name, "A drain time", statistics.median(a), "s",
                note=f"median of {len(a)} rounds ({_spread(a)}); from the second's start to A's last release, "
                     f"{n_a:,} jobs")
        p99s = [o["a_p99"] for o in outs]
        ctx.add(S23, name, "A release lateness p99", statistics.median(p99s), "ms",
                note=f"median of {len(p99s)} rounds ({_spread(p99s, '{:,.0f}')})")
    for metric in ("B release lateness p99", "A drain time", "A release lateness p99"):
        ctx.relate(S23, metric, FIFO)
    pairs = list(zip(got[FAIR], got[FIFO], strict=False))
    drain = [f["a_drain_s"] / o["a_drain_s"] for f, o in pairs if f["a_drain_s"] and o["a_drain_s"]]
    if drain:
        ctx.add(S23, FAIR, "A drain time / no tenant's, same round", statistics.median(drain), "x",
                note=f"median of {len(drain)} rounds ({_spread(drain)}; min {min(drain):.2f}, max {max(drain):.2f})")
    b_ratio = [f["b_p99"] / o["b_p99"] for f, o in pairs if f["b_p99"] is not None and o["b_p99"]]
    if b_ratio:
        ctx.add(S23, FAIR, "B lateness p99 / no tenant's, same round", statistics.median(b_ratio), "x",
                note=f"median of {len(b_ratio)} rounds ({_spread(b_ratio, '{:.3f}')})")
    rates = [n_a / o["a_drain_s"] for name in (FAIR, FIFO) for o in got[name] if o["a_drain_s"]]
    if rates:
        # A batch is shared fairly within a shard; between shards the scheduler goes round robin, a full
        # batch each: a tenant's job due in a shard just visited waits about one round (16 batches).
        one_round_ms = 16 * 500 / statistics.median(rates) * 1000
        ctx.notes.append(f"scenario 23: one scheduler round over the 16 shards with full batches (8,000 jobs) took "
                         f"~{one_round_ms:,.0f} ms at this run's median drain rate ({statistics.median(rates):,.0f} "
                         f"jobs/s, from the second's start: it counts the second the jobs fell due over, so this "
                         f"rounds up): about the most a tenant's due job waits with tenants given")
    ctx.notes.append(f"scenario 23: one `celery delayed run`, 16 shards, batch 500, delayed_lookahead_ms="
                     f"{lookahead_ms} (BENCH_FAIR_LOOKAHEAD_MS), no worker (the queue only fills); A's {n_a:,} "
                     f"jobs filled through store.jobs.schedule with tenant 'A' (or none), B's 10 with "
                     f"apply_later_many(tenant='B') (or none); lateness = released - due from the records (Redis "
                     f"clock); the goal is B's p99 under 100 ms with tenants given")


# -- 24 ---------------------------------------------------------------------------------------------------------


@contextmanager
def _schedulers(ctx: Ctx, prefix: str, queue: str, conf: dict[str, Any], count: int) -> Iterator[list[Proc]]:
    """``count`` schedulers of one store, each holding its share of the shards."""
    client = ctx.client()
    with procs() as ps:
        for _ in range(count):
            ps.append(delayed_scheduler(ctx.redis_url, prefix, queue, conf=conf))
        ok = wait_for(lambda: client.zcard(f"{prefix}:schedulers") >= count, 90, interval=0.1)
        text = f"with {count} member(s)"
        settled = ok and wait_for(lambda: all(text in p.output() for p in ps), 60, interval=0.1)
        if not settled:
            raise RuntimeError(f"{count} schedulers did not settle: {ps[0].output()[-2000:]}")
        yield ps


class _Overran(Exception):
    """The backlog was not all scheduled before it fell due (the machine was slower than guessed)."""


def _limit_round(ctx: Ctx, count: int, rate: float, window_s: int, windows: int, backlog: int,
                 shards: int, lead_ms: int) -> dict[str, Any]:
    u = uid()
    prefix, queue = f"b24{u}", f"q24{u}"
    conf = {"delayed_shards": shards, "delayed_rate_limits": {TASK: f"{rate:g}/s"}}
    app = make_app(ctx.redis_url, prefix, queue, **conf)
    store = get_store(app)
    client = ctx.client()
    try:
        with _schedulers(ctx, prefix, queue, conf, count):
            start_ms = store.redis.now_ms() + lead_ms
            ids: list[str] = []
            for s in range(0, backlog, 10_000):
                part = [{"args": (0.0,), "when": _at(start_ms)} for _ in range(min(10_000, backlog - s))]
                ids += [r.id for r in apply_later_many(app, TASK, part)]
            if store.redis.now_ms() >= start_ms:
                raise _Overran
            end_ms = start_ms + window_s * windows * 1000
            time.sleep(max(0.0, (end_ms - store.redis.now_ms()) / 1000 + 1.0))
        recs = _released(store, ids)
    finally:
        delete_prefix(client, f"{prefix}:*")
        client.unlink(queue)
    rel = [r for _, r in recs.values() if r is not None]
    counts = [sum(1 for t in rel if start_ms + k * window_s * 1000 <= t < start_ms + (k + 1) * window_s * 1000)
              for k in range(windows)]
    first_s = sum(1 for t in rel if start_ms <= t < start_ms + 1000)
    return {"counts": counts, "released": len(rel), "in_window": sum(counts), "first_s": first_s,
            "early": sum(1 for t in rel if t < start_ms), "left": backlog - len(rel)}


def rate_limit(ctx: Ctx) -> None:
    rate = 100.0
    window_s = 10
    windows = ctx.size(6, 2)
    shards = 8
    rounds = ctx.size(2, 1)
    counts_of = [int(c) for c in os.environ.get("BENCH_LIMIT_SCHEDULERS", "4,1").split(",")]
    backlog = int(rate * window_s * windows * 1.25) + 500
    target = rate * window_s
    print(f"[{S24}] {rate:g}/s over {window_s * windows} s, {shards} shards, {backlog:,} jobs due at once, "
          f"schedulers {counts_of}, {rounds} round(s)", flush=True)
    got: dict[int, list[dict[str, Any]]] = {c: [] for c in counts_of}
    lead_ms = 2000 + backlog // 2  # the backlog is scheduled before it falls due (2,000 jobs/s at the least)
    for r in range(rounds):
        order = counts_of if r % 2 == 0 else counts_of[::-1]
        for count in order:
            for _attempt in range(3):
                try:
                    out = _limit_round(ctx, count, rate, window_s, windows, backlog, shards, lead_ms)
                    break
                except _Overran:
                    lead_ms *= 2
                    print(f"    round {r + 1}: the backlog was not scheduled before it fell due; again, "
                          f"{lead_ms} ms ahead", flush=True)
            else:
                raise RuntimeError(f"scheduling {backlog:,} jobs never ended before they fell due")
            print(f"    round {r + 1}: {count} scheduler(s): per {window_s} s window {out['counts']}; first second "
                  f"{out['first_s']}, released {out['released']:,} ({out['left']:,} left, {out['early']} early)",
                  flush=True)
            got[count].append(out)
    for count in counts_of:
        outs = got[count]
        name = f"{count} `delayed run` process{'es' if count > 1 else ''}"
        all_counts = [c for o in outs for c in o["counts"]]
        worst = max(all_counts, key=lambda c: abs(c - target))
        dev = (worst - target) / target * 100
        per_round = "; ".join(f"round {i + 1}: {', '.join(f'{c:,}' for c in o['counts'])}"
                              for i, o in enumerate(outs))
        ctx.add(S24, name, f"jobs per {window_s} s window, worst", worst, "jobs",
                note=f"target {target:,.0f} ({rate:g}/s); {per_round}")
        ctx.add(S24, name, "worst deviation from the rate", dev, "%",
                note=f"goal within ±5 %; {len(all_counts)} windows of {window_s} s over {len(outs)} round(s)")
        later = [c for o in outs for c in o["counts"][1:]]
        if later:
            # The first window holds the start (the burst allowance, the schedulers' first visits).
            worst_later = max(later, key=lambda c: abs(c - target))
            firsts = ", ".join(format((o["counts"][0] - target) / target * 100, "+.1f") + " %" for o in outs)
            ctx.add(S24, name, "worst deviation, windows after the first", (worst_later - target) / target * 100,
                    "%", note=f"{len(later)} windows; the first window's: {firsts}")
        mean_rate = statistics.fmean(o["in_window"] for o in outs) / (window_s * windows)
        first = ", ".join(str(o["first_s"]) for o in outs)
        left = ", ".join(format(o["left"], ",") for o in outs)
        early = ", ".join(str(o["early"]) for o in outs)
        ctx.add(S24, name, "mean release rate", mean_rate, "jobs/s",
                note=f"over the {window_s * windows} s; first second {first} (burst cap: 500 ms of each shard's "
                     f"share); backlog left {left}; released before due {early}")
    ctx.notes.append(f"scenario 24: delayed_rate_limits={{'{TASK}': '{rate:g}/s'}}, delayed_shards={shards}, "
                     f"{backlog:,} jobs all due at one instant, the windows counted from it (Redis clock, the "
                     f"records' released field); the schedulers started and settled (each holding its share of "
                     f"the shards) before the jobs were scheduled; BENCH_LIMIT_SCHEDULERS to change the counts")


# -- 25 ---------------------------------------------------------------------------------------------------------


OLD = "before shaping"
NEW = "this code (shaping, no limit)"
NEW_LIMIT = "this code, a limit on another task"
NEW_TENANT = "this code, every job of one tenant"


@contextmanager
def _baseline() -> Iterator[tuple[str, str]]:
    """(a checkout of the code before shaping, its label): BENCH_BASELINE_TREE, or git archive of the rev."""
    tree = os.environ.get("BENCH_BASELINE_TREE")
    rev = os.environ.get("BENCH_BASELINE_REV", "6ff0d7e")
    if tree:
        yield tree, f"{OLD} ({Path(tree).name})"
        return
    tmp = tempfile.mkdtemp(prefix="bench-baseline-")
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "celery_delayed", "lua"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield tmp, f"{OLD} ({rev})"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Child:
    """A ``bench/release_ab.py`` process importing one checkout (PYTHONPATH), taking commands on stdin."""

    def __init__(self, ctx: Ctx, tree: str, *flags: str) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("release_ab.py")), ctx.redis_url, *flags],
            env=dict(os.environ, PYTHONPATH=tree), cwd=tempfile.gettempdir(), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, text=True)
        ran = self._answer()["tree"]
        if Path(ran).resolve() != Path(tree).resolve():
            raise RuntimeError(f"release_ab.py imported {ran}, not {tree}")

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"release_ab.py ended: {self.log.read().decode(errors='replace')[-2000:]}")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def shaping_cost(ctx: Ctx) -> None:
    n = ctx.size(100_000, 20_000)
    rounds = ctx.size(7, 3)
    print(f"[{S25}] {n:,} due jobs per measurement, {rounds} rounds, a process per variant", flush=True)
    with _baseline() as (old_tree, old_label):
        flags = {old_label: (old_tree,), NEW: (str(ROOT),), NEW_LIMIT: (str(ROOT), "--limit-other"),
                 NEW_TENANT: (str(ROOT), "--tenant", "A")}
        names = list(flags)
        got: dict[str, list[dict[str, Any] | None]] = {k: [] for k in names}
        children: dict[str, _Child] = {}
        try:
            for name, (tree, *rest) in flags.items():
                children[name] = _Child(ctx, tree, *rest)
            for r in range(rounds):
                # Every variant filled first; then released, the A/B pair back to back (its order swapped
                # each round), then the other two: a pair's releases run seconds apart.
                pair = [old_label, NEW] if r % 2 == 0 else [NEW, old_label]
                order = pair + ([NEW_LIMIT, NEW_TENANT] if r % 2 == 0 else [NEW_TENANT, NEW_LIMIT])
                fills = {name: children[name].ask(f"fill {n}")["schedule_rate"] for name in order[::-1]}
                for name in order:
                    out = children[name].ask("release") | {"schedule_rate": fills[name]}
                    got[name].append(out)
                    print(f"    round {r + 1}: {name}: release {out['release_rate']:,.0f} jobs/s, schedule "
                          f"{out['schedule_rate']:,.0f} jobs/s ({out['released']:,} released)", flush=True)
        finally:
            for child in children.values():
                child.close()
    for metric, field in (("release rate", "release_rate"), ("schedule rate", "schedule_rate")):
        for name in names:
            vals = [o[field] for o in got[name] if o is not None]
            ctx.add(S25, name, metric, statistics.median(vals) if vals else None, "jobs/s",
                    note=f"median of {len(vals)} rounds (min {min(vals, default=0):,.0f}, max "
                         f"{max(vals, default=0):,.0f})")
        ctx.relate(S25, metric, old_label)
        for name in names[1:]:
            pairs = [a[field] / b[field] for a, b in zip(got[name], got[old_label], strict=True)
                     if a is not None and b is not None]
            if pairs:
                ctx.add(S25, name, f"{metric} / before shaping's, same round", statistics.median(pairs), "x",
                        note=f"median of {len(pairs)} rounds; min {min(pairs):.3f}, max {max(pairs):.3f} "
                             f"({_spread(pairs, '{:.3f}')})")
            best = [o[field] for o in got[name] if o is not None]
            best_old = [o[field] for o in got[old_label] if o is not None]
            if best and best_old:
                # Other work on the machine only slows a run down: the best of the rounds is the least disturbed.
                ctx.add(S25, name, f"best {metric} / before shaping's best", max(best) / max(best_old), "x",
                        note=f"best of {len(best)} rounds, {max(best):,.0f} vs {max(best_old):,.0f} jobs/s")
    ctx.notes.append(f"scenario 25: {n:,} due jobs per measurement (small messages, so the script's own work "
                     f"weighs most), filled with store.jobs.schedule (2 threads) and released in-process with "
                     f"release_due, 16 shards, batch 500, a process per variant (bench/release_ab.py) importing "
                     f"celery_delayed and lua/ of its checkout (PYTHONPATH); each round every variant filled, "
                     f"then released: the A/B pair back to back (its order swapped each round), then the two "
                     f"others; the goal is "
                     f"this code's release rate within 3 % of before shaping's (a ratio ≥ 0.97); "
                     f"'a limit on another task': delayed_rate_limits={{'bench.other': '100/s'}}")
