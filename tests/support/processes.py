"""Real worker and scheduler subprocesses for end-to-end tests, and polling helpers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

#: The folder of the Celery apps that worker and scheduler subprocesses load.
WORKER_APPS = Path(__file__).parent / "worker_apps"


def wait_for(pred: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll ``pred`` until it returns a truthy value or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def app_env(broker: str, prefix: str, queue: str, store: str | None = None,
            conf: dict[str, Any] | None = None) -> dict[str, str]:
    """The environment that configures the worker apps (see ``worker_apps/e2e_app.py``)."""
    env = dict(os.environ)
    env.update(
        E2E_BROKER=broker, E2E_PREFIX=prefix, E2E_QUEUE=queue, E2E_CONF=json.dumps(conf or {}),
        PYTHONPATH=os.pathsep.join([str(WORKER_APPS), env.get("PYTHONPATH", "")]),
    )
    if store:
        env["E2E_REDIS"] = store
    return env


class Proc:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        # Kept open for the process's lifetime (and the file after it, for output()).
        self.log = tempfile.NamedTemporaryFile(prefix="celery-delayed-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            args, env=env, cwd=str(WORKER_APPS), stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 15) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        # Reap any child left in the process group (prefork children).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class WorkerProcess(Proc):
    """``celery -A e2e_app worker`` in its own process group."""

    def __init__(
        self, broker: str, prefix: str, queue: str, *, store: str | None = None,
        conf: dict[str, Any] | None = None, concurrency: int = 2, pool: str = "prefork",
        queues: list[str] | None = None, extra: list[str] | None = None,
    ) -> None:
        self.name = f"w{os.getpid()}-{time.monotonic_ns()}@localhost"
        args = [
            sys.executable, "-m", "celery", "-A", "e2e_app", "worker", "-l", "INFO",
            "-c", str(concurrency), "-P", pool, "-n", self.name, "--without-gossip",
            "--without-mingle", "--without-heartbeat", "-Q", ",".join(queues or [queue]),
            *(extra or []),
        ]
        super().__init__(args, app_env(broker, prefix, queue, store, conf))

    def wait_ready(self, timeout: float = 30) -> None:
        wait_for(lambda: "ready." in self.output() or self.proc.poll() is not None, timeout,
                 what=f"worker {self.name} to start")
        if self.proc.poll() is not None:
            raise AssertionError(f"worker exited: {self.output()[-3000:]}")


class SchedulerProcess(Proc):
    """``celery -A e2e_app delayed run``."""

    def __init__(self, broker: str, prefix: str, queue: str, *, store: str | None = None,
                 conf: dict[str, Any] | None = None) -> None:
        args = [sys.executable, "-m", "celery", "-A", "e2e_app", "delayed", "run", "-l", "INFO"]
        super().__init__(args, app_env(broker, prefix, queue, store, conf))


def ran(client: redis.Redis, prefix: str) -> list[str]:
    """Task ids recorded by the e2e tasks, one entry per run."""
    return [str(x).split("|")[0] for x in client.lrange(f"{prefix}:ran", 0, -1)]


def run_celery(broker: str, prefix: str, queue: str, *args: str, store: str | None = None,
               conf: dict[str, Any] | None = None, timeout: float = 30,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A e2e_app <args>`` to its end (the CLI as a user runs it); return its result."""
    full = app_env(broker, prefix, queue, store, conf) | (env or {})
    return subprocess.run([sys.executable, "-m", "celery", "-A", "e2e_app", *args], env=full,
                          cwd=str(WORKER_APPS), capture_output=True, text=True, timeout=timeout)
