"""A private ``redis-server`` on a free port, for the demo.

A copy of the test suite's helper (the example project does not import from
``tests/``), plus :func:`ensure_redis_server`, which installs Debian's
``redis-server`` when it is missing and we are allowed to.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_redis_server() -> str:
    """Return the path of ``redis-server``, installing it with apt-get if missing and root.

    Raises:
        RuntimeError: it is missing and cannot be installed here.
    """
    exe = shutil.which("redis-server")
    if exe is not None:
        return exe
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(
            "redis-server is not installed: install it (Debian/Ubuntu: apt-get install redis-server) "
            "or set REDIS_URL to a Redis server the demo may use"
        )
    print("redis-server is missing: apt-get install -y redis-server", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "redis-server"], check=True, env=env, stdout=subprocess.DEVNULL)
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("apt-get installed redis-server but it is not on PATH")
    return exe


class RedisServer:
    """A private redis-server process (no persistence); ``url`` points at it."""

    def __init__(self, exe: str | None = None, port: int | None = None) -> None:
        self.exe = exe or ensure_redis_server()
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="celery-delayed-demo-redis-")
        self.args = [
            self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self.dir, "--daemonize", "no",
            "--logfile", os.path.join(self.dir, "redis.log"),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's URL (database 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        # Its own session: a Ctrl-C in the terminal reaches the demo, which
        # then stops the server itself, after the worker and the scheduler.
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        log = Path(self.dir, "redis.log")
        raise RuntimeError(f"redis-server did not start on port {self.port}: "
                           f"{log.read_text(errors='replace')[-2000:] if log.exists() else ''}")

    def stop(self) -> None:
        """Stop the server and remove its folder."""
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
