"""The demo: thousands of delayed tasks through a real worker and scheduler.

``scripts/demo`` (or ``python -m example_project.demo`` from the repository
root) starts a private ``redis-server`` on a free port (unless ``REDIS_URL``
is set), a Celery worker and a ``celery -A proj delayed run`` scheduler as
subprocesses, schedules ``--tasks`` tasks due over the next ``--spread``
seconds, cancels one in a hundred of the later ones, follows them live and
prints how late they started (task start minus due time) and the counts:
scheduled, cancelled, released, executed, duplicates. Then it stops
everything, also on Ctrl-C.

The last line of the summary is the verdict: ``OK`` when every task that was
not cancelled ran exactly once, no cancelled one ran, and the p99 lateness is
within :data:`LATE_P99_MS` (stated in the line); ``LATE`` when every task ran
once but the p99 is over it (the machine could not keep up); ``FAILED``
otherwise.

Exit status: 0 for ``OK`` and for ``LATE`` (lateness depends on the machine's
load, and a loaded CI machine must not fail for it: the words say it); 1 for
``FAILED``; 2 when it could not set up.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import redis

from celery_delayed.testing import RedisServer, ensure_redis_server

HERE = Path(__file__).resolve().parent
#: Due times start this long after scheduling begins, so that scheduling a
#: few thousand tasks does not itself make the first ones late.
LEAD_MS = 1000
CHUNK = 250
#: How long after the last due time the demo waits for stragglers.
GRACE_S = 30.0
#: The p99 lateness under which the demo calls the run "on time". With the
#: defaults (3,000 tasks over 10 s, threads -c 4), an idle 2-core machine
#: measured p99 7.8 ms; the same machine shared with other work (load average
#: 0.7-1.3) 16-147 ms in ten runs, with the tail in the first second (the run
#: looked at closely); with one or two busy loops beside it, 16-152 ms.
#: 250 ms is well above all of those, so that "LATE" means the machine could
#: not keep up, not that it was a little busy.
LATE_P99_MS = 250.0


# -- output ---------------------------------------------------------------------


class Progress:
    """A one-line progress bar on a terminal; a few plain lines elsewhere (logs, CI)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.tty = sys.stdout.isatty()
        self.last_print = 0.0
        self.last_text = ""
        self.printed = ""

    def show(self, done: int, total: int, extra: str = "", force: bool = False) -> None:
        """Draw ``done`` of ``total`` (plus ``extra``)."""
        width = 30
        filled = width if total <= 0 else min(width, width * done // total)
        text = f"{self.label:<10} [{'#' * filled}{'.' * (width - filled)}] {done:>6}/{total:<6} {extra}"
        now = time.monotonic()
        if self.tty:
            print("\r" + text.ljust(len(self.last_text)), end="", flush=True)
        elif (force or now - self.last_print >= 1.0) and text != self.printed:
            print(text, flush=True)
            self.last_print, self.printed = now, text
        self.last_text = text

    def done(self) -> None:
        """End the bar (keep its last state on screen)."""
        if self.tty:
            print(flush=True)
        elif self.last_text != self.printed:
            print(self.last_text, flush=True)
            self.printed = self.last_text


def _redact(url: str) -> str:
    parts = urlsplit(url)
    return url.replace(f":{parts.password}@", ":***@") if parts.password else url


# -- subprocesses -----------------------------------------------------------------


class Proc:
    """A celery subprocess in its own process group, logging to a file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name = name
        self.log = logdir / f"{name}.log"
        with self.log.open("wb") as out:
            # Own session: Ctrl-C reaches only the demo, which stops the
            # scheduler before the worker, the worker before Redis.
            self.proc = subprocess.Popen(
                args, env=env, cwd=str(HERE), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc.poll() is None

    def output(self) -> str:
        """Its log so far."""
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (Celery's warm shutdown), then SIGKILL after ``timeout``."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            except ProcessLookupError:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # children left in the group (pool processes)


def _celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "proj", *args]


def _wait(pred: Any, timeout: float, procs: Sequence[Proc], what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        for p in procs:
            if not p.alive():
                raise SetupError(f"the {p.name} exited while waiting for {what}:\n{p.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise SetupError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


class SetupError(Exception):
    """The demo could not start (Redis, worker or scheduler)."""


# -- the run ------------------------------------------------------------------------


@dataclass
class Outcome:
    """What happened to the scheduled tasks."""

    scheduled: int
    cancelled: int
    released: int
    executed: int
    duplicates: int
    cancelled_ran: int
    lateness_ms: list[float]

    @property
    def expected(self) -> int:
        """Tasks that should run: scheduled minus cancelled."""
        return self.scheduled - self.cancelled

    @property
    def ok(self) -> bool:
        """Every expected task ran once, nothing else ran."""
        return (self.executed == self.expected == self.released and self.duplicates == 0
                and self.cancelled_ran == 0)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of an ascending sequence."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


class Demo:
    """One run: schedule, follow, count."""

    def __init__(
        self, url: str, tasks: int, spread_s: float, concurrency: int, logdir: Path, pool: str = "threads"
    ) -> None:
        self.url = url
        self.n = tasks
        self.spread_ms = int(spread_s * 1000)
        self.concurrency = concurrency
        self.pool = pool
        self.logdir = logdir
        run = uuid.uuid4().hex[:8]
        self.prefix = f"demo-{run}"
        self.queue = f"demo-{run}"
        self.record_key = f"{self.prefix}:ran"
        # proj reads its settings from the environment when it is imported.
        os.environ.update(REDIS_URL=url, DELAYED_KEY_PREFIX=self.prefix, CELERY_QUEUE=self.queue)
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        self.tasks: Any = importlib.import_module("proj.tasks")
        from celery_delayed.store import ShardStatus, get_store

        self.app = self.tasks.app
        self.store = get_store(self.app)
        self.shard_status = ShardStatus(self.store)
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.procs: list[Proc] = []

    def start(self) -> None:
        """Start the worker and the scheduler; wait until both are up."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
        worker = Proc("worker", _celery(
            "worker", "-l", "INFO", "-P", self.pool, "-c", str(self.concurrency), "-Q", self.queue,
            "-n", f"{self.prefix}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat",
        ), env, self.logdir)
        self.procs.append(worker)
        scheduler = Proc("scheduler", _celery("delayed", "run", "-l", "INFO"), env, self.logdir)
        self.procs.append(scheduler)
        print(f"worker     celery -A proj worker -P {self.pool} -c {self.concurrency} -Q {self.queue} "
              f"(pid {worker.proc.pid})")
        print(f"scheduler  celery -A proj delayed run (pid {scheduler.proc.pid})", flush=True)
        _wait(lambda: "ready." in worker.output(), 60, self.procs, "the worker to be ready")
        _wait(lambda: self.client.zcard(self.store.keys.schedulers) > 0, 60, self.procs,
              "the scheduler to join")

    def schedule(self) -> tuple[list[Any], float]:
        """Schedule the tasks in chunks with ``apply_later_many``; return handles and seconds taken."""
        base_ms = self.store.redis.now_ms() + LEAD_MS
        bar = Progress("scheduled")
        handles: list[Any] = []
        t0 = time.monotonic()
        for start in range(0, self.n, CHUNK):
            calls = []
            for i in range(start, min(start + CHUNK, self.n)):
                due_ms = base_ms + (self.spread_ms * i // max(1, self.n - 1) if self.n > 1 else 0)
                when = datetime.fromtimestamp(due_ms / 1000, tz=timezone.utc)
                calls.append({"args": (self.record_key, due_ms), "when": when})
            handles += self.tasks.tick.apply_later_many(calls)
            bar.show(len(handles), self.n)
        bar.done()
        return handles, time.monotonic() - t0

    def cancel_some(self, handles: Sequence[Any]) -> set[str]:
        """Cancel one in a hundred of the tasks still at least 1.5 s from due."""
        horizon = self.store.redis.now_ms() + 1500
        later = [h for h in handles if h.due_ms > horizon]
        return {h.id for h in later[::100] if h.cancel()}

    def follow(self, expected: int, last_due_ms: int) -> int:
        """Show released / executed until all expected ran (or a deadline); return released."""
        bar = Progress("executed")
        deadline = time.monotonic() + max(0.0, (last_due_ms - self.store.redis.now_ms()) / 1000) + GRACE_S
        released = 0
        while True:
            executed = int(self.client.llen(self.record_key))
            waiting = int(sum(r["pending"] + r["inflight"] for r in self.shard_status.rows()))
            released = expected - waiting
            bar.show(executed, expected, f"released {released}/{expected}")
            if executed >= expected and waiting == 0:
                break
            dead = [p.name for p in self.procs if not p.alive()]
            if dead or time.monotonic() > deadline:
                bar.done()
                print(f"stopped following: {', '.join(dead) + ' exited' if dead else 'deadline passed'}")
                return released
            time.sleep(0.2)
        bar.done()
        time.sleep(0.5)  # let a duplicate, if there were one, show up
        return released

    def outcome(self, handles: Sequence[Any], cancelled: set[str], released: int) -> Outcome:
        """Count runs and duplicates, and compute lateness, from the task records."""
        records = [str(r).split("|") for r in self.client.lrange(self.record_key, 0, -1)]
        runs = Counter(r[0] for r in records)
        ids = {h.id for h in handles}
        first: dict[str, float] = {}
        for task_id, due_ms, start_ms in records:
            if task_id in ids and task_id not in cancelled and task_id not in first:
                first[task_id] = float(start_ms) - float(due_ms)
        return Outcome(
            scheduled=len(handles), cancelled=len(cancelled), released=released,
            executed=len(first), duplicates=sum(c - 1 for c in runs.values()),
            cancelled_ran=sum(1 for t in runs if t in cancelled), lateness_ms=sorted(first.values()),
        )

    def stop(self) -> None:
        """Stop the scheduler, then the worker."""
        for p in reversed(self.procs):  # the scheduler was started last
            print(f"stopping {p.name} ...", flush=True)
            p.stop()

    def forget(self) -> None:
        """Delete this run's keys (only when running on a shared Redis)."""
        keys = list(self.client.scan_iter(match=f"{self.prefix}:*", count=1000))
        keys += [self.queue, f"_kombu.binding.{self.queue}", f"_kombu.binding_permanent.{self.queue}"]
        keys += [f"{self.queue}\x06\x16{p}" for p in range(10)]
        for i in range(0, len(keys), 500):
            self.client.delete(*keys[i:i + 500])


def report(o: Outcome, schedule_s: float, spread_s: float) -> None:
    """Print the counts and the lateness figures."""
    rate = o.scheduled / schedule_s if schedule_s > 0 else math.inf
    late = o.lateness_ms
    print()
    print(f"scheduled   {o.scheduled:>7}  due over {spread_s:g} s (scheduled in {schedule_s:.2f} s, {rate:,.0f}/s)")
    print(f"cancelled   {o.cancelled:>7}  (executed anyway: {o.cancelled_ran})")
    print(f"released    {o.released:>7}")
    print(f"executed    {o.executed:>7}  {'(all)' if o.executed == o.expected else f'(expected {o.expected})'}")
    print(f"duplicates  {o.duplicates:>7}")
    print(f"machine     {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} (lateness grows with load)")
    if late:
        print(f"lateness    p50 {percentile(late, 50):.1f} ms   p99 {percentile(late, 99):.1f} ms   "
              f"max {late[-1]:.1f} ms   (task start - due time, {len(late)} tasks)")
    print(verdict(o, LATE_P99_MS), flush=True)


def _duration(ms: float) -> str:
    """``12.3 ms`` below a second, ``4.9 s`` from one."""
    return f"{ms:.1f} ms" if ms < 1000 else f"{ms / 1000:.1f} s"


def verdict(o: Outcome, threshold_ms: float) -> str:
    """The summary's last line: ``OK``, ``LATE`` or ``FAILED``, with the p99 and the threshold it was held to."""
    if not o.ok:
        return "FAILED: not every task ran exactly once"
    threshold = f"{threshold_ms:g} ms"
    if not o.lateness_ms:  # every task was cancelled: nothing ran, nothing could be late
        return "OK: every task was cancelled, and none ran"
    p99 = percentile(o.lateness_ms, 99)
    if p99 <= threshold_ms:
        return f"OK: every task ran once, on time (p99 {_duration(p99)}, threshold {threshold})"
    return (f"LATE: every task ran once, but p99 lateness {_duration(p99)} is over the {threshold} threshold "
            "(the machine could not keep up)")


# -- entry point ----------------------------------------------------------------------


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if not 1 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError(f"must be between 1 and 1000000, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 <= value <= 3600 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"must be between 0 and 3600 seconds, got {text}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="scripts/demo",
        description="Schedule delayed tasks with celery-delayed and watch a real worker run them.",
    )
    p.add_argument("--tasks", type=_count, default=3000, help="how many tasks to schedule (default 3000)")
    p.add_argument("--spread", type=_seconds, default=10.0,
                   help="seconds over which their due times are spread (default 10)")
    p.add_argument("--concurrency", type=_count, default=4, help="worker threads or processes (default 4)")
    p.add_argument("--pool", choices=("threads", "prefork"), default="threads",
                   help="the worker's pool (default threads)")
    return p.parse_args(argv)


def _check_reachable(url: str) -> None:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=3).ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        raise SetupError(
            f"cannot reach Redis at {_redact(url)}: {str(exc).rstrip('.')}. Start it, fix REDIS_URL, "
            "or unset REDIS_URL to let the demo start a private redis-server"
        ) from exc


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return the exit status."""
    args = parse_args(argv)
    # Also when started in the background, where SIGINT may be ignored by default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _on_sigterm)
    logdir = Path(tempfile.mkdtemp(prefix="celery-delayed-demo-"))
    server: RedisServer | None = None
    demo: Demo | None = None
    status = 2
    t0 = time.monotonic()
    try:
        url = os.environ.get("REDIS_URL")
        if url:
            print(f"redis      {_redact(url)} (REDIS_URL)")
        else:
            server = RedisServer(exe=ensure_redis_server(install=True), own_session=True).start()
            url = server.url
            print(f"redis      private redis-server on {url} (set REDIS_URL to use another)")
        _check_reachable(url)
        demo = Demo(url, args.tasks, args.spread, args.concurrency, logdir, args.pool)
        demo.start()
        handles, schedule_s = demo.schedule()
        cancelled = demo.cancel_some(handles)
        if cancelled:
            print(f"cancelled  {len(cancelled)} of the later tasks with .cancel()")
        released = demo.follow(len(handles) - len(cancelled), max(h.due_ms for h in handles))
        outcome = demo.outcome(handles, cancelled, released)
        report(outcome, schedule_s, args.spread)
        # LATE is 0 too: lateness is the machine's, correctness is ours (see the module's docstring).
        status = 0 if outcome.ok else 1
    except KeyboardInterrupt:
        print("\ninterrupted: shutting down", flush=True)
        status = 130
    except SetupError as exc:
        print(f"\ndemo could not start: {exc}", file=sys.stderr)
    except Exception as exc:  # any other failure: still stop what we started
        print(f"\ndemo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        # A second Ctrl-C must not leave a worker or a redis-server behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if demo is not None:
            demo.stop()
            if server is None:
                demo.forget()
        if server is not None:
            print("stopping redis-server ...", flush=True)
            server.close()
        if status in (0, 130) or not any(logdir.iterdir()):
            shutil.rmtree(logdir, ignore_errors=True)
        else:
            print(f"logs kept in {logdir}", file=sys.stderr)
        print(f"done in {time.monotonic() - t0:.1f} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
