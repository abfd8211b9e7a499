"""Fault-injection harness: real schedulers and workers against a private redis-server.

A :class:`FaultRun` owns one redis-server (optionally with ``appendonly yes``
and ``appendfsync everysec``, restartable on the same port), starts
``celery delayed run`` schedulers and ``celery worker`` processes of
``fault_app`` as subprocesses, schedules ``fault.run`` jobs through the real
``apply_later_many``, lets a scenario inject faults, and then measures:

- executions per job, from the run log file that every task body appends to
  (the ground truth even when Redis loses data);
- the store's consistency (:meth:`FaultRun.store_problems`): no job both in
  a due index and in flight, every SCHEDULED record indexed, every CLAIMED
  record in flight, every indexed or in-flight id backed by a record in the
  matching state.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from support import Proc, RedisServer, app_env, make_app, wait_for
from support.delivery import queue_keys

from celery_delayed import apply_later_many
from celery_delayed.store import ShardStatus, Store

HERE = Path(__file__).parent
TASK = "fault.run"
_RECEIVED = re.compile(r"Task fault\.run\[([^\]]+)\] received")


def _fault_env(broker: str, prefix: str, queue: str, conf: dict[str, Any], runlog: Path,
               store: str | None = None, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    env = app_env(broker, prefix, queue, store, conf)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])
    env["FAULT_RUNLOG"] = str(runlog)
    env.update(extra_env or {})
    return env


class FaultProc(Proc):
    """A ``celery -A fault_app ...`` subprocess in its own process group."""

    def __init__(self, kind: str, args: list[str], env: dict[str, str], launcher: list[str] | None = None) -> None:
        self.kind = kind
        self.spec = (args, env, launcher)
        self.killed = False  # by the harness (a fault), as opposed to a crash
        base = launcher or [sys.executable, "-m", "celery"]
        self.started_at = time.time()
        super().__init__([*base, "-A", "fault_app", *args], env)

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Outcome:
    """What one scenario measured."""

    scenario: str
    jobs: int
    faults: int = 0
    executed: int = 0  # jobs whose body ended at least once
    lost: int = 0  # jobs that never ran and are not in the store either
    duplicated: int = 0  # jobs whose body ended more than once
    delivered_twice: int = 0  # jobs whose message reached a worker more than once
    lost_in_store: int = 0  # of lost: no record, or never released
    lost_in_broker: int = 0  # of lost: released (QUEUED) but the message is gone from the broker
    deliverable: int = 0  # of lost: released, its message still on the queue or in kombu's unacked hash
    seconds: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    def report(self) -> None:
        """Print the line, and append it to $FAULTS_REPORT when set (the docs quote these)."""
        print(self.line())
        path = os.environ.get("FAULTS_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(self.line() + "\n")

    def line(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.notes.items())
        if self.lost:
            extra = (f" (in store {self.lost_in_store}, in broker {self.lost_in_broker}, "
                     f"still deliverable {self.deliverable}){extra}")
        return (f"[faults] {self.scenario}: jobs={self.jobs} faults={self.faults} executed={self.executed} "
                f"lost={self.lost} duplicated={self.duplicated} delivered_twice={self.delivered_twice} "
                f"in {self.seconds:.1f}s{extra}")


class FaultRun:
    """One scenario's world: a redis-server, processes, an app to schedule with, a run log."""

    def __init__(self, *, seed: int, appendonly: bool = False, conf: dict[str, Any] | None = None,
                 redis_args: Iterable[str] = (), broker: str | None = None) -> None:
        self.rng = random.Random(seed)
        self.dir = Path(tempfile.mkdtemp(prefix="celery-delayed-faults-"))
        self.runlog = self.dir / "runs.log"
        extra = list(redis_args)
        if appendonly:
            extra += ["--appendfsync", "everysec"]
        self.redis = RedisServer(*extra, appendonly=appendonly)
        self.uid = uuid.uuid4().hex[:10]
        self.conf: dict[str, Any] = dict(conf or {})
        self.broker = broker  # None: the private Redis is the broker too (direct path)
        self.procs: list[FaultProc] = []
        self.app: Celery | None = None
        self.t0 = time.monotonic()
        self.crashes = 0  # processes that exited on their own (restarted by supervise())

    # -- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> FaultRun:
        self.redis.start()
        if self.broker:
            self.app = make_app(self.broker, self.uid, delayed_redis_url=self.redis.url, **self.conf)
        else:
            self.app = make_app(self.redis.url, self.uid, **self.conf)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        keep = exc_type is not None or bool(os.environ.get("FAULTS_KEEP_LOGS"))
        for p in self.procs:
            p.stop(timeout=10)
            if keep:
                print(f"[faults] {p.kind} pid {p.pid} log: {p.log.name}")
            else:
                Path(p.log.name).unlink(missing_ok=True)
        self.redis.stop("kill")
        shutil.rmtree(self.redis.dir, ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def url(self) -> str:
        return self.redis.url

    @property
    def prefix(self) -> str:
        return f"t{self.uid}"

    @property
    def queue(self) -> str:
        return f"q{self.uid}"

    def client(self, **kw: Any) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True, **kw)

    def store(self) -> Store:
        assert self.app is not None
        return Store(self.app, client=self.client(socket_timeout=5))

    # -- processes -------------------------------------------------------------------

    def env(self, conf: dict[str, Any] | None = None, extra_env: dict[str, str] | None = None) -> dict[str, str]:
        return _fault_env(self.broker or self.url, self.prefix, self.queue, self.conf | (conf or {}), self.runlog,
                          store=self.url, extra_env=extra_env)

    def scheduler(self, conf: dict[str, Any] | None = None, launcher: list[str] | None = None,
                  extra_env: dict[str, str] | None = None) -> FaultProc:
        p = FaultProc("scheduler", ["delayed", "run", "-l", "INFO"], self.env(conf, extra_env), launcher)
        self.procs.append(p)
        return p

    def worker(self, *, concurrency: int = 8, pool: str = "threads", conf: dict[str, Any] | None = None,
               extra: list[str] | None = None) -> FaultProc:
        name = f"fw{len(self.procs)}-{self.uid}@localhost"
        args = ["worker", "-l", "INFO", "-c", str(concurrency), "-P", pool, "-n", name, "--without-gossip",
                "--without-mingle", "--without-heartbeat", "-Q", self.queue, *(extra or [])]
        p = FaultProc("worker", args, self.env(conf))
        p.name = name  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def wait_ready(self, worker: FaultProc, timeout: float = 30) -> None:
        wait_for(lambda: "ready." in worker.output() or not worker.alive(), timeout, what="worker start")
        if not worker.alive():
            raise AssertionError(f"worker exited: {worker.output()[-3000:]}")

    # -- scheduling ------------------------------------------------------------------

    def schedule(self, n: int, start_s: float, spread_s: float, *, chunk: int = 2000,
                 **call: Any) -> list[str]:
        """Schedule ``n`` jobs due evenly from ``start_s`` to ``start_s + spread_s`` after now."""
        assert self.app is not None
        began = time.monotonic()
        ids: list[str] = []
        for lo in range(0, n, chunk):
            elapsed = time.monotonic() - began
            calls = [{"args": (i,), "when": max(0.0, start_s + spread_s * i / n - elapsed), **call}
                     for i in range(lo, min(n, lo + chunk))]
            ids += [h.id for h in apply_later_many(self.app, TASK, calls, strict=False)]
        return ids

    # -- measuring -------------------------------------------------------------------

    def runs(self, kind: str = "done") -> list[tuple[str, int, int, float]]:
        """(job id, pid, retries, time) per line of the run log of this kind."""
        if not self.runlog.exists():
            return []
        out = []
        for line in self.runlog.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5 and parts[0] == kind:
                out.append((parts[1], int(parts[2]), int(parts[3]), float(parts[4])))
        return out

    def counts(self) -> collections.Counter[str]:
        return collections.Counter(r[0] for r in self.runs())

    def deliveries(self) -> collections.Counter[str]:
        """Messages of ``fault.run`` that reached a worker, per job id (from the workers' logs).

        Counted before the worker-side execution record can drop a duplicate, so this is
        the measure of "enqueued twice".
        """
        out: collections.Counter[str] = collections.Counter()
        for p in self.procs:
            if p.kind == "worker":
                out.update(_RECEIVED.findall(p.output()))
        return out

    def wait_executed(self, ids: Iterable[str], timeout: float, also: Callable[[], bool] | None = None) -> bool:
        """Wait until every id ran at least once (and ``also()`` is true); False (not an error) on timeout."""
        want = set(ids)
        try:
            # ``also`` first: it may have to run on every poll (supervise()).
            wait_for(lambda: (also is None or also()) and want <= set(self.counts()), timeout, interval=0.25,
                     what=f"{len(want)} jobs to run")
        except AssertionError:
            return False
        return True

    def outcome(self, scenario: str, ids: list[str], faults: int, *, exclude: Iterable[str] = ()) -> Outcome:
        """Count executed / lost / duplicated jobs of ``ids`` (``exclude``: expected not to run).

        Call it after waiting for everything due to run: a job that has not
        run by then is lost, and :meth:`classify` says where each one is
        (``notes["not_run"]``).
        """
        counts = self.counts()
        delivered = self.deliveries()
        skip = set(exclude)
        jobs = [i for i in ids if i not in skip]
        not_run = [i for i in jobs if counts[i] == 0]
        out = Outcome(scenario, len(jobs), faults=faults, executed=len(jobs) - len(not_run), lost=len(not_run),
                      duplicated=sum(1 for i in jobs if counts[i] > 1),
                      delivered_twice=sum(1 for i in jobs if delivered[i] > 1),
                      seconds=time.monotonic() - self.t0)
        if not_run:
            out.notes["not_run"] = self.classify(not_run, delivered, out)
        return out

    def classify(self, not_run: list[str], delivered: collections.Counter[str], out: Outcome) -> dict[str, int]:
        """Where each job that did not run is (every one of them), counted into ``out``.

        No record, or never released (SCHEDULED / CLAIMED): lost by the store.
        Released but its message is neither on the queue nor in kombu's unacked
        hash: lost by the broker. On the queue or in unacked: still deliverable
        (``out.deliverable``), not lost, only late.
        """
        store = self.store()
        c = store.redis.client
        pipe = c.pipeline(transaction=True)
        for key in queue_keys(self.queue):
            pipe.lrange(key, 0, -1)
        pipe.hvals("unacked")
        *lists, held = pipe.execute()
        listed = {json.loads(raw)["headers"]["id"] for raws in lists for raw in raws}
        unacked = {json.loads(raw)[0]["headers"]["id"] for raw in held}
        pipe = c.pipeline(transaction=False)
        for i in not_run:
            pipe.hget(store.keys.shard(store.layout.shard_of(i)).job(i), "st")
        states: collections.Counter[str] = collections.Counter()
        for i, st in zip(not_run, pipe.execute(), strict=True):
            if st is None:
                out.lost_in_store += 1  # acknowledged to the caller, then gone
                states["no record"] += 1
                continue
            where = "on the queue" if i in listed else "in unacked" if i in unacked else "message gone"
            if st in ("SCHEDULED", "CLAIMED"):
                out.lost_in_store += 1  # never released
            elif where == "message gone":
                out.lost_in_broker += 1  # released, then the broker lost the message
            else:
                out.deliverable += 1
            states[f"{st}, delivered {delivered[i]}x, {where}"] += 1
        assert sum(states.values()) == len(not_run)
        return dict(states)

    def store_problems(self) -> list[str]:
        """Inconsistencies of the store (an empty list when it is consistent)."""
        store = self.store()
        c = store.redis.client
        problems: list[str] = []
        for s in range(store.config.shards):
            sk = store.keys.shard(s)
            due_keys = [sk.due]
            if store.config.bucket_ms > 0:
                due_keys = [str(k) for k in c.zrange(sk.buckets, 0, -1)]
            due: set[str] = set()
            for k in due_keys:
                due |= set(c.zrange(k, 0, -1))
            inflight = set(c.zrange(sk.inflight, 0, -1))
            both = due & inflight
            if both:
                problems.append(f"shard {s}: {len(both)} jobs both due and in flight")
            states: dict[str, str | None] = {}
            prefix = sk.job_prefix
            keys = list(c.scan_iter(match=f"{prefix}*", count=2000))
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.hget(k, "st")
            for k, st in zip(keys, pipe.execute(), strict=True):
                states[k[len(prefix):]] = st
            for i in due:
                if states.get(i) != "SCHEDULED":
                    problems.append(f"shard {s}: {i} indexed as due but its record is {states.get(i)}")
            for i in inflight:
                if states.get(i) not in ("CLAIMED", "CANCELLED"):
                    problems.append(f"shard {s}: {i} in flight but its record is {states.get(i)}")
            for i, st in states.items():
                if st == "SCHEDULED" and i not in due:
                    problems.append(f"shard {s}: orphan SCHEDULED record {i} (not in the due index)")
                if st == "CLAIMED" and i not in inflight:
                    problems.append(f"shard {s}: orphan CLAIMED record {i} (not in flight)")
        return problems[:50]

    def pending(self) -> int:
        """Jobs still scheduled or in flight."""
        rows = ShardStatus(self.store()).rows()
        return sum(r["pending"] + r["inflight"] for r in rows)

    # -- faults ----------------------------------------------------------------------

    def supervise(self) -> int:
        """Start again every process that exited on its own (as systemd or Kubernetes would),
        and every worker whose consumer died with an "Unrecoverable error" (a liveness probe).

        Returns how many were restarted; their logs stay readable.
        """
        restarted = 0
        for p in list(self.procs):
            if p.alive() and p.kind == "worker" and "Unrecoverable error" in p.output():
                # Celery's consumer gave up (celery/celery#10205, kombu's reconnect after a
                # lost ack) but the process lingers without consuming: a liveness probe's job.
                p.stop(timeout=5)
            if not p.alive() and not p.killed and not getattr(p, "replaced", False):
                p.replaced = True  # type: ignore[attr-defined]
                args, env, launcher = p.spec
                self.procs.append(FaultProc(p.kind, args, env, launcher))
                restarted += 1
        self.crashes += restarted
        return restarted

    def kill(self, proc: FaultProc) -> None:
        """SIGKILL the whole process group (a crash: no clean-up, no goodbye)."""
        proc.killed = True
        if proc.alive():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.proc.wait(10)

    def restart_redis(self, sig: str, down_s: float = 0.5) -> None:
        """Stop the redis-server with SIGTERM ('term') or SIGKILL ('kill') and start it again."""
        self.redis.stop(sig)
        time.sleep(down_s)
        self.redis.start()
