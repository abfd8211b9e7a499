"""A private Redis Sentinel deployment on free ports, for tests and benchmarks.

A master, its replicas and three Sentinels (``redis-server --sentinel``),
each in its own process, all on 127.0.0.1, with short failure detection
(``down-after-milliseconds``) so a failover takes a second or two. Nothing
starts at import; use it as a context manager, which stops every process and
removes their folders on exit::

    with SentinelGroup() as group:
        app.conf.delayed_redis_url = group.url
        app.conf.delayed_redis_options = {"master_name": group.master_name}
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from .servers import RedisServer, ensure_redis_server, free_port

__all__ = ["SentinelGroup", "SentinelServer", "make_certs"]


def make_certs(folder: str) -> dict[str, str]:
    """A throw-away CA and a server certificate for 127.0.0.1 (``openssl``), in ``folder``.

    Returns the paths: ``ca``, ``cert``, ``key``.
    """
    exe = shutil.which("openssl")
    if exe is None:
        raise FileNotFoundError("openssl is not installed (needed for a TLS test deployment)")
    f = {name: str(Path(folder, name)) for name in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt",
                                                    "san.ext")}
    Path(f["san.ext"]).write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run([exe, *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    run("req", "-x509", "-new", "-nodes", "-newkey", "rsa:2048", "-keyout", f["ca.key"], "-out", f["ca.crt"],
        "-days", "2", "-subj", "/CN=celery-delayed test CA")
    run("req", "-new", "-nodes", "-newkey", "rsa:2048", "-keyout", f["server.key"], "-out", f["server.csr"],
        "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", f["server.csr"], "-CA", f["ca.crt"], "-CAkey", f["ca.key"], "-CAcreateserial",
        "-out", f["server.crt"], "-days", "2", "-extfile", f["san.ext"])
    return {"ca": f["ca.crt"], "cert": f["server.crt"], "key": f["server.key"]}


def _tls_lines(certs: dict[str, str]) -> list[str]:
    return [f"tls-cert-file {certs['cert']}", f"tls-key-file {certs['key']}", f"tls-ca-cert-file {certs['ca']}",
            "tls-auth-clients no", "tls-replication yes"]


class SentinelServer:
    """One Sentinel process (``redis-server <conf> --sentinel``) watching ``master_name``."""

    def __init__(self, master_name: str, master_port: int, *, quorum: int = 2, down_after_ms: int = 500,
                 failover_timeout_ms: int = 2000, password: str | None = None,
                 sentinel_password: str | None = None, certs: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.tls_port = free_port() if certs else None
        self.password = sentinel_password
        self.dir = tempfile.mkdtemp(prefix="celery-delayed-sentinel-")
        self.conf = Path(self.dir, "sentinel.conf")
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndaemonize no\ndir {self.dir}\n"
            f"logfile {Path(self.dir, 'sentinel.log')}\n"
            f"sentinel monitor {master_name} 127.0.0.1 {master_port} {quorum}\n"
            f"sentinel down-after-milliseconds {master_name} {down_after_ms}\n"
            f"sentinel failover-timeout {master_name} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {master_name} 1\n"
            + (f"sentinel auth-pass {master_name} {password}\n" if password else "")
            + (f"requirepass {sentinel_password}\nsentinel sentinel-pass {sentinel_password}\n"
               if sentinel_password else "")
            + ("".join(f"{line}\n" for line in [f"tls-port {self.tls_port}", *_tls_lines(certs)]) if certs else "")
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        """The tail of the Sentinel's log."""
        path = Path(self.dir, "sentinel.log")
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def start(self, timeout: float = 10.0) -> SentinelServer:
        """Start the Sentinel and wait until it answers PING."""
        self.proc = subprocess.Popen([ensure_redis_server(), str(self.conf), "--sentinel"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    if client.ping():
                        return self
                except redis.RedisError:
                    pass
                if self.proc.poll() is not None:
                    break
                time.sleep(0.02)
        finally:
            client.close()
        self.close()
        raise RuntimeError(f"redis-server --sentinel did not start on port {self.port}")

    def client(self) -> redis.Redis:
        """A client of this Sentinel (with its password)."""
        return redis.Redis(port=self.port, password=self.password, decode_responses=True, socket_timeout=1,
                           socket_connect_timeout=0.5)

    def close(self) -> None:
        """Stop the Sentinel and remove its folder."""
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelGroup:
    """A master, ``replicas`` replicas and ``sentinels`` Sentinels (quorum 2) on 127.0.0.1.

    Args:
        master_name: the name the Sentinels monitor.
        replicas: how many replicas of the master to start.
        sentinels: how many Sentinels (at least 2 for the quorum of 2).
        down_after_ms: ``sentinel down-after-milliseconds``: how long the
            master must be unreachable before a failover starts.
        failover_timeout_ms: ``sentinel failover-timeout``.
        password: the servers' ``requirepass`` (and ``masterauth``; the
            Sentinels' ``auth-pass``).
        sentinel_password: the Sentinels' own ``requirepass``.
        tls: every server and Sentinel also listens with TLS (a throw-away CA,
            :attr:`certs`), replication and the Sentinels' links use it, and
            :attr:`url` lists the Sentinels' TLS ports; the Sentinels name the
            masters' TLS ports. The plain ports stay open for the helpers.
    """

    def __init__(self, master_name: str = "delayedmaster", *, replicas: int = 1, sentinels: int = 3,
                 down_after_ms: int = 500, failover_timeout_ms: int = 2000, password: str | None = None,
                 sentinel_password: str | None = None, tls: bool = False) -> None:
        self.master_name = master_name
        self.password = password
        self.tls_dir = tempfile.mkdtemp(prefix="celery-delayed-tls-") if tls else None
        self.certs = make_certs(self.tls_dir) if self.tls_dir else None
        #: TLS port -> plain port of each server (TLS only)
        self.plain_port: dict[int, int] = {}

        def server(*extra: str) -> RedisServer:
            args = ["--requirepass", password, "--masterauth", password] if password else []
            if self.certs:
                tls_port = free_port()
                args += ["--tls-port", str(tls_port)]
                for line in _tls_lines(self.certs):
                    name, value = line.split(" ", 1)
                    args += [f"--{name}", value]
            srv = RedisServer(*args, *extra)
            if self.certs:
                self.plain_port[tls_port] = srv.port
                srv.tls_port = tls_port  # type: ignore[attr-defined]
            return srv

        self.master = server()
        named = getattr(self.master, "tls_port", self.master.port)  # the port the Sentinels and replicas use
        self.replicas = [server("--replicaof", "127.0.0.1", str(named)) for _ in range(replicas)]
        self.sentinels = [
            SentinelServer(master_name, named, quorum=min(2, sentinels), down_after_ms=down_after_ms,
                           failover_timeout_ms=failover_timeout_ms, password=password,
                           sentinel_password=sentinel_password, certs=self.certs)
            for _ in range(sentinels)
        ]

    @property
    def url(self) -> str:
        """The store URL: every Sentinel, ``sentinel://127.0.0.1:port`` parts joined by ``;``.

        With ``password``, the first part carries it (``sentinel://:password@...``: the master's).
        """
        auth = f":{self.password}@" if self.password else ""
        return ";".join(f"sentinel://{auth if i == 0 else ''}127.0.0.1:{s.tls_port or s.port}"
                        for i, s in enumerate(self.sentinels))

    def server_client(self, port: int) -> redis.Redis:
        """A client of the master or a replica on ``port`` (its plain port; a TLS port is mapped to it)."""
        return redis.Redis(port=self.plain_port.get(port, port), password=self.password, decode_responses=True,
                           socket_timeout=1, socket_connect_timeout=0.5)

    @property
    def servers(self) -> list[RedisServer]:
        """The master and the replicas, as started (the roles change with a failover)."""
        return [self.master, *self.replicas]

    def master_port(self) -> int | None:
        """The port of the master the first Sentinel that answers names now, or None."""
        for s in self.sentinels:
            client = s.client()
            try:
                host_port = client.sentinel_get_master_addr_by_name(self.master_name)
                if isinstance(host_port, (tuple, list)):
                    return int(host_port[1])
            except redis.RedisError:
                continue
            finally:
                client.close()
        return None

    def server_on(self, port: int) -> RedisServer:
        """The server listening on ``port`` (plain or TLS)."""
        port = self.plain_port.get(port, port)
        return next(s for s in self.servers if s.port == port)

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Wait until the replicas are in sync and every Sentinel knows every other and every replica."""
        deadline = time.monotonic() + timeout
        want_sentinels = len(self.sentinels) - 1
        while time.monotonic() < deadline:
            if self._ready(want_sentinels):
                return
            time.sleep(0.1)
        logs = "\n".join(s.log[-600:] for s in self.sentinels)
        raise RuntimeError(f"the Sentinel group did not come up within {timeout} s:\n{logs}")

    def _ready(self, want_sentinels: int) -> bool:
        master = self.server_client(self.master.port)
        try:
            info = master.info("replication")
            online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                      and v.get("state") == "online"]
            if len(online) < len(self.replicas):
                return False
        finally:
            master.close()
        for s in self.sentinels:
            client = s.client()
            try:
                fields = client.sentinel_master(self.master_name)
                if not isinstance(fields, dict):
                    return False
                if int(fields.get("num-slaves", 0)) < len(self.replicas):
                    return False
                if int(fields.get("num-other-sentinels", 0)) < want_sentinels:
                    return False
            except redis.RedisError:
                return False
            finally:
                client.close()
        return True

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until the Sentinels name a master other than ``old_port`` and it takes writes; its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            port = self.master_port()
            if port is not None and port != old_port:
                client = self.server_client(port)
                try:
                    if client.info("replication").get("role") == "master":
                        return port
                except redis.RedisError:
                    pass
                finally:
                    client.close()
            time.sleep(0.05)
        raise RuntimeError(f"no failover from port {old_port} within {timeout} s")

    def start(self) -> SentinelGroup:
        """Start the servers and the Sentinels, and wait until the group is ready."""
        try:
            for server in self.servers:
                server.start()
            for s in self.sentinels:
                s.start()
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process (Sentinels first, so none starts a failover) and remove their folders."""
        for s in self.sentinels:
            s.close()
        for server in self.servers:
            server.close()
        if self.tls_dir:
            shutil.rmtree(self.tls_dir, ignore_errors=True)

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

