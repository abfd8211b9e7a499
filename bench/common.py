"""What every scenario shares: the run context, result rows, subprocesses, statistics."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    """One measured figure of one system in one scenario."""

    scenario: str
    system: str
    metric: str
    value: float | None
    unit: str
    ratio: float | None = None  # value / the scenario's reference (see ``reference``)
    reference: str = ""
    note: str = ""


@dataclass
class Ctx:
    """The run: the private Redis, the size mode, and what has been measured so far."""

    redis_url: str
    quick: bool
    rows: list[Row] = field(default_factory=list)
    lateness: dict[str, list[float]] = field(default_factory=dict)  # label -> seconds
    notes: list[str] = field(default_factory=list)
    done: set[str] = field(default_factory=set)  # measurements one scenario made for another

    def size(self, full: int, quick: int) -> int:
        """The scenario size for this mode."""
        return quick if self.quick else full

    def client(self) -> redis.Redis:
        """A new client of the private Redis (bytes replies)."""
        return redis.Redis.from_url(self.redis_url)

    def add(self, scenario: str, system: str, metric: str, value: float | None, unit: str,
            note: str = "") -> Row:
        """Record a figure; print it at once (a long run shows progress)."""
        row = Row(scenario, system, metric, value, unit, note=note)
        self.rows.append(row)
        shown = "n/a" if value is None else f"{value:,.4g}"
        print(f"  {scenario} | {system} | {metric}: {shown} {unit} {note}", flush=True)
        return row

    def relate(self, scenario: str, metric: str, reference_system: str, higher_is_better: bool = True) -> None:
        """Fill ``ratio`` of the rows of one metric: value / the reference system's value."""
        rows = [r for r in self.rows if r.scenario == scenario and r.metric == metric]
        ref = next((r for r in rows if r.system == reference_system), None)
        if ref is None or not ref.value:
            return
        for r in rows:
            if r.value is not None:
                r.ratio = r.value / ref.value
                r.reference = reference_system


def uid() -> str:
    """A short unique id for keys and queues of one measurement."""
    return uuid.uuid4().hex[:8]


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100 * (len(s) - 1))))
    return s[k]


def summary(values: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / max / mean of a sample."""
    return {"p50": pct(values, 50), "p99": pct(values, 99), "max": max(values) if values else float("nan"),
            "mean": statistics.fmean(values) if values else float("nan"), "n": float(len(values))}


def wait_for(pred: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll ``pred`` until truthy; return its value, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def runs(client: redis.Redis, prefix: str) -> list[tuple[str, float, float]]:
    """(task id, start time, due time) of every recorded run."""
    out = []
    for raw in client.lrange(f"{prefix}:ran", 0, -1):
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        tid, start, due, _pid = text.split("|")
        out.append((tid, float(start), float(due)))
    return out


def _env(url: str, prefix: str, queue: str, conf: dict[str, Any] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(BENCH_REDIS=url, BENCH_PREFIX=prefix, BENCH_QUEUE=queue, BENCH_CONF=json.dumps(conf or {}),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    return env


class Proc:
    """A subprocess in its own process group, with its output in a temp file."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="bench-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(args, env=env, cwd=str(ROOT), stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_output(self, text: str, timeout: float = 60) -> bool:
        """Wait until ``text`` appears in the output (False if it exits or times out)."""
        return bool(wait_for(lambda: text in self.output() or self.proc.poll() is not None, timeout)) \
            and text in self.output()

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM the group, then SIGKILL what is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # prefork children left behind
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        Path(self.log.name).unlink(missing_ok=True)

    def tree(self) -> list[int]:
        """The pids of this process and its children (prefork pool processes)."""
        pids = [self.pid]
        try:
            kids = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
            pids += [int(k) for k in kids]
        except OSError:
            pass
        return pids

    def rss_mb(self) -> float:
        """Resident memory of the process tree, MB."""
        total = 0
        for pid in self.tree():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                pass
        return total / 1024

    def cpu_s(self) -> float:
        """User + system CPU seconds of the process (not its children)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def celery_worker(url: str, prefix: str, queue: str, *, pool: str = "prefork", concurrency: int = 2,
                  conf: dict[str, Any] | None = None) -> Proc:
    """``celery -A bench.celery_app worker`` on one queue; call ``ready()`` before using it."""
    name = f"bench-{uid()}@localhost"
    args = [sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker", "-l", "INFO", "-P", pool,
            "-c", str(concurrency), "-n", name, "-Q", queue, "--without-gossip", "--without-mingle",
            "--without-heartbeat"]
    return Proc(args, _env(url, prefix, queue, conf))


def delayed_scheduler(url: str, prefix: str, queue: str, conf: dict[str, Any] | None = None) -> Proc:
    """``celery -A bench.celery_app delayed run``."""
    args = [sys.executable, "-m", "celery", "-A", "bench.celery_app", "delayed", "run", "-l", "INFO"]
    return Proc(args, _env(url, prefix, queue, conf))


def wait_ready(proc: Proc, what: str, timeout: float = 60) -> None:
    """Wait for a Celery worker's "ready." line; raise with its log if it dies."""
    if not proc.wait_output("ready.", timeout):
        raise RuntimeError(f"{what} did not start: {proc.output()[-3000:]}")


def wait_scheduler(client: redis.Redis, prefix: str, timeout: float = 60) -> bool:
    """Wait until a scheduler has joined (its membership is in ``<prefix>:schedulers``)."""
    return bool(wait_for(lambda: client.zcard(f"{prefix}:schedulers") > 0, timeout))


@contextmanager
def procs() -> Iterator[list[Proc]]:
    """Collect subprocesses; stop them all on the way out, whatever happens."""
    started: list[Proc] = []
    try:
        yield started
    finally:
        for p in reversed(started):
            p.stop()


def delete_prefix(client: redis.Redis, *patterns: str) -> None:
    """Delete the keys of one measurement (SCAN + UNLINK: never a FLUSH)."""
    for pattern in patterns:
        batch = []
        for key in client.scan_iter(match=pattern, count=5000):
            batch.append(key)
            if len(batch) >= 5000:
                client.unlink(*batch)
                batch = []
        if batch:
            client.unlink(*batch)


def used_memory(client: redis.Redis) -> int:
    """``INFO memory`` used_memory, bytes (after letting lazy frees finish)."""
    wait_for(lambda: int(client.info("memory").get("lazyfree_pending_objects", 0)) == 0, 10)
    return int(client.info("memory")["used_memory"])


def settled_memory(client: redis.Redis, timeout: float = 30) -> int:
    """:func:`used_memory` once it stops moving (at most ``timeout`` seconds).

    Redis resizes its key space in the background: after many keys are
    deleted it shrinks the table (~8 bytes a key freed), after many are added
    it rehashes into a larger one (both tables held until it is done). Read
    while that goes on, a fill measured after a deletion is counted short.
    """
    last = used_memory(client)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = used_memory(client)
        if abs(now - last) < 64 * 1024:
            return now
        last = now
    return last
