"""Private ``redis-server`` processes on free ports, for tests, demos and benchmarks.

Nothing starts at import. :class:`RedisServer` runs one server in a
temporary folder; use it as a context manager (it stops the server and
removes the folder on exit, also on failure)::

    with RedisServer() as server:
        app.conf.broker_url = server.url
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = ["RedisServer", "ensure_redis_server", "free_port"]


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ensure_redis_server(install: bool = False) -> str:
    """Return the path of ``redis-server``.

    Args:
        install: when it is missing and this process is root on a Debian-like
            system, install Debian's ``redis-server`` package with apt-get.

    Raises:
        FileNotFoundError: it is missing (and could not be installed).
    """
    exe = shutil.which("redis-server")
    if exe is not None:
        return exe
    if not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise FileNotFoundError(
            "redis-server is not installed: install it (Debian/Ubuntu: apt-get install redis-server) "
            "or point REDIS_URL at a Redis server that may be used"
        )
    print("redis-server is missing: apt-get install -y redis-server", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "redis-server"], check=True, env=env, stdout=subprocess.DEVNULL)
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("apt-get installed redis-server but it is not on PATH")
    return exe


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # up (with a password: up too)
    except OSError:
        return False


def _server_pid(port: int, password: str | None = None) -> int | None:
    """The ``process_id`` of the server on ``port`` by ``INFO server``; None if it refuses or is not up."""
    client = redis.Redis("127.0.0.1", port, password=password, socket_timeout=0.5, socket_connect_timeout=0.5,
                         retry=Retry(NoBackoff(), 0))
    try:
        return int(client.info("server")["process_id"])
    except (OSError, redis.RedisError):  # not up, loading, or INFO refused (a password, an ACL user)
        return None
    finally:
        client.close()


class RedisServer:
    """A private redis-server process on 127.0.0.1; ``url`` points at it.

    Args:
        *extra: more ``redis-server`` arguments (e.g. ``"--maxmemory", "10mb"``).
        port: the port (default: a free one, chosen again if another process
            takes it before the server binds it). :meth:`restart` keeps it.
        appendonly: keep an AOF (``appendfsync everysec``) in the server's
            folder, so a restart keeps the data.
        exe: the ``redis-server`` binary (default: the one on PATH).
        own_session: start it in a session of its own, so a Ctrl-C in the
            terminal reaches only the caller, which stops the server itself.
    """

    def __init__(self, *extra: str, port: int | None = None, appendonly: bool = False,
                 exe: str | None = None, own_session: bool = False) -> None:
        self.exe = exe or ensure_redis_server()
        self.port = port or free_port()
        self._chosen_port = port is None
        self.dir = tempfile.mkdtemp(prefix="celery-delayed-redis-")
        self.own_session = own_session
        self.args = [
            self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes" if appendonly else "no", "--dir", self.dir,
            "--daemonize", "no", "--logfile", os.path.join(self.dir, "redis.log"), *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's URL (database 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def _log_text(self) -> str:
        try:
            return Path(self.dir, "redis.log").read_text(errors="replace")
        except OSError:
            return ""

    @property
    def log(self) -> str:
        """The tail of the server's log."""
        return self._log_text()[-2000:]

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING.

        Raises:
            RuntimeError: it did not start in ``timeout`` seconds, or exited
                (e.g. another process holds the port: a PING answered by that
                other server does not count).
        """
        deadline = time.monotonic() + timeout
        for _ in range(5):
            logged = len(self._log_text())  # the log is appended to: judge this attempt by its own lines
            self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=self.own_session)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if _ping(self.port) and self._ready():
                    self._chosen_port = False  # a restart keeps it
                    return self
                time.sleep(0.02)
            self.stop("kill")
            taken = "Address already in use" in self._log_text()[logged:]
            if not (self._chosen_port and taken and time.monotonic() < deadline):
                break
            # The free port this object chose was taken before the server bound it: choose another.
            self.port = free_port()
            self.args[self.args.index("--port") + 1] = str(self.port)
        raise RuntimeError(f"redis-server did not start on port {self.port}: {self.log}")

    def _ready(self) -> bool:
        """The server answering on the port is this object's process, not another one."""
        assert self.proc is not None
        password = self.args[self.args.index("--requirepass") + 1] if "--requirepass" in self.args else None
        pid = _server_pid(self.port, password)
        if pid is not None:
            return pid == self.proc.pid
        # INFO refused (e.g. ACL users): this start's own log line, at the default log level.
        log = self._log_text()
        start = log.rfind("Server initialized")  # a restart appends to the log
        return start >= 0 and "Ready to accept connections" in log[start:]

    def stop(self, sig: str = "term") -> None:
        """Stop the server: ``"term"`` (SIGTERM, a clean shutdown) or ``"kill"`` (SIGKILL)."""
        if self.proc is None:
            return
        if sig == "kill":
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def restart(self, sig: str = "term", down_s: float = 0.0, timeout: float = 10.0) -> RedisServer:
        """Stop the server, wait ``down_s`` seconds, and start it again on the same port and folder."""
        self.stop(sig)
        if down_s > 0:
            time.sleep(down_s)
        return self.start(timeout)

    def close(self) -> None:
        """Stop the server and remove its folder."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (+10000) is free too, neither of them in ``taken``.

    The ports are free when asked but not held, so the caller passes the ports
    it has already chosen: the kernel may hand the same one out twice.
    """
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port > 55535:
            port -= 20000
        if {port, port + 10000} & taken:
            continue
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        taken.update((port, port + 10000))
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisClusterServers:
    """A private Redis Cluster on 127.0.0.1: ``masters`` masters, each with ``replicas`` replicas.

    Starts ``masters * (1 + replicas)`` redis-servers with ``--cluster-enabled
    yes`` on free ports, joins them with ``redis-cli --cluster create`` and
    waits until every node reports ``cluster_state:ok``. :attr:`url` names the
    first node (the cluster client finds the others). :meth:`close` stops
    every node and removes their folders.

    Args:
        masters: number of masters (at least 3: Redis Cluster's minimum).
        replicas: replicas per master.
        node_timeout_ms: ``cluster-node-timeout``: how long a master may be
            unreachable before its replica is promoted.
    """

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 2000) -> None:
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters")
        self.masters, self.replicas = masters, replicas
        taken: set[int] = set()
        self.nodes = [
            RedisServer("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", str(node_timeout_ms), port=_cluster_port(taken))
            for _ in range(masters * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        """A URL of one node (database 0)."""
        return self.nodes[0].url

    def start(self, timeout: float = 60.0) -> RedisClusterServers:
        """Start the nodes, create the cluster and wait until it serves every slot."""
        cli = shutil.which("redis-cli") or str(Path(self.nodes[0].exe).with_name("redis-cli"))
        try:
            for node in self.nodes:
                node.start()
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas),
                            "--cluster-yes"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           timeout=timeout)
            deadline = time.monotonic() + timeout
            while not all(self._ok(n.port, cli) for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _ok(port: int, cli: str) -> bool:
        """The node serves every slot and, if it is a replica, has synced with its master."""
        out = subprocess.run([cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True,
                             timeout=10).stdout
        if "cluster_state:ok" not in out or "cluster_slots_assigned:16384" not in out:
            return False
        repl = subprocess.run([cli, "-p", str(port), "info", "replication"], capture_output=True, text=True,
                              timeout=10).stdout
        return "role:slave" not in repl or "master_link_status:up" in repl

    def close(self) -> None:
        """Stop every node and remove its folder."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
