"""Security: Redis AUTH and TLS, JSON-only by default, no user data in Lua source, a least-privilege ACL.

Each test runs its own redis-server (password, TLS, ACL) so nothing leaks
into the shared test server.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from support import RedisServer, SchedulerProcess, WorkerProcess, free_port, make_app, need, ran, wait_for

import celery_delayed as cd
from celery_delayed import StoreUnavailable, apply_later, get_store
from celery_delayed.errors import SerializationError
from celery_delayed.store.loader import lua_dir, scripts, source

TASK = "e2e.mark"
PACKAGE = Path(cd.__file__).parent


# -- AUTH ------------------------------------------------------------------------------


@pytest.fixture
def auth_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        # Set after start: RedisServer's readiness probe is an unauthenticated PING.
        redis.Redis(port=server.port).config_set("requirepass", "s3cr3t-pw")
        yield server


def _released(app) -> list[str]:  # type: ignore[no-untyped-def]
    store = get_store(app)
    out: list[str] = []
    for s in range(store.config.shards):
        out += store.release.release_due(s).ids
    return out


def test_store_works_with_a_password(auth_server: RedisServer, uid: str) -> None:
    url = f"redis://:s3cr3t-pw@127.0.0.1:{auth_server.port}/0"
    app = make_app(url, uid)
    h = apply_later(app, TASK, args=(1,), when=0, strict=False)
    assert h.job()["st"] == "SCHEDULED"
    assert _released(app) == [h.id]
    client = redis.Redis.from_url(url, decode_responses=True)
    assert client.llen(app.conf.task_default_queue) == 1


@pytest.mark.parametrize("url_auth", ["", ":wrong-pw@"])
def test_bad_password_is_a_typed_error_without_the_password(auth_server: RedisServer, uid: str, url_auth: str) -> None:
    app = make_app(f"redis://{url_auth}127.0.0.1:{auth_server.port}/0", uid)
    with pytest.raises(StoreUnavailable) as info:
        apply_later(app, TASK, when=0, strict=False)
    msg = str(info.value)
    assert "wrong-pw" not in msg and "s3cr3t" not in msg
    if url_auth:
        assert ":***@" in msg
    admin = redis.Redis(port=auth_server.port, password="s3cr3t-pw")
    assert admin.dbsize() == 0


# -- TLS -------------------------------------------------------------------------------


class TLSRedis:
    """A redis-server that only speaks TLS (``--port 0``), with a throw-away CA."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="celery-delayed-tls-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def _certs(self) -> None:
        d = self.dir

        def run(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "2", "-subj", "/CN=celery-delayed test CA")
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=127.0.0.1")
        (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf")

    @property
    def ca(self) -> str:
        return str(self.dir / "ca.crt")

    def url(self, verify: bool = True) -> str:
        if verify:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_cert_reqs=required&ssl_ca_certs={self.ca}"
        return f"rediss://127.0.0.1:{self.port}/0?ssl_cert_reqs=required"

    def start(self) -> TLSRedis:
        self._certs()
        d = self.dir
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
             "--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
             "--tls-ca-cert-file", self.ca, "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
             "--dir", str(d), "--logfile", str(d / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ctx = ssl.create_default_context(cafile=self.ca)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError((d / "redis.log").read_text(errors="replace")[-2000:])
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw, \
                        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the TLS redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _tls_supported() -> bool:
    if shutil.which("openssl") is None or shutil.which("redis-server") is None:
        return False
    out = subprocess.run(["redis-server", "--tls-port", "0", "--port", "0", "--tls-cert-file", "/nonexistent"],
                         capture_output=True, text=True, timeout=10)
    # A build without TLS rejects the option itself; a TLS build fails on the missing file.
    return "Bad directive" not in out.stdout + out.stderr


@pytest.fixture
def tls_server() -> Iterator[TLSRedis]:
    need("redis-server built with TLS, and openssl", _tls_supported())
    server = TLSRedis().start()
    yield server
    server.stop()


def test_store_works_over_tls(tls_server: TLSRedis, uid: str) -> None:
    app = make_app(tls_server.url(), uid)
    store = get_store(app)
    assert store.redis.client.connection_pool.connection_class is redis.SSLConnection
    assert store.broker.direct  # same rediss:// URL as the broker
    h = apply_later(app, TASK, args=("over tls",), when=0, strict=False)
    assert h.job()["st"] == "SCHEDULED"
    assert _released(app) == [h.id]
    assert h.job()["st"] == "QUEUED"
    other = apply_later(app, TASK, when=60, strict=False)
    assert cd.cancel(app, other.id) == "SCHEDULED"


def test_tls_scheduler_and_worker(tls_server: TLSRedis, uid: str, workers: list) -> None:  # type: ignore[type-arg]
    """A real scheduler and worker (kombu's Redis transport over TLS) run a job end to end."""
    url = tls_server.url()
    app = make_app(url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    workers.append(SchedulerProcess(url, prefix, queue))
    w = WorkerProcess(url, prefix, queue, concurrency=1, pool="solo")
    workers.append(w)
    ids = {apply_later(app, TASK, args=(i,), when=0.2, strict=False).id for i in range(3)}
    client = get_store(app).redis.client
    wait_for(lambda: set(ran(client, prefix)) == ids, 45, what="3 jobs over TLS")


def test_tls_without_the_ca_is_refused(tls_server: TLSRedis, uid: str) -> None:
    app = make_app(tls_server.url(verify=False), uid)
    with pytest.raises(StoreUnavailable, match="certificate verify failed"):
        apply_later(app, TASK, when=0, strict=False)


# -- serializers -----------------------------------------------------------------------


def test_only_json_by_default(app) -> None:  # type: ignore[no-untyped-def]
    """accept_content is json-only by default: a pickle job could never run, so it is refused."""
    client = get_store(app).redis.client
    with pytest.raises(SerializationError, match=r"'pickle'.*not in accept_content.*application/json"):
        apply_later(app, TASK, args=(1,), when=0, serializer="pickle", strict=False)
    app.conf.task_serializer = "pickle"
    with pytest.raises(SerializationError, match="not in accept_content"):
        apply_later(app, TASK, args=(1,), when=0, strict=False)
    assert list(client.scan_iter(match=f"{app.conf.delayed_key_prefix}*")) == []


def test_pickle_only_when_the_app_accepts_it(redis_url: str, uid: str) -> None:
    app = make_app(redis_url, uid, accept_content=["json", "pickle"])
    h = apply_later(app, TASK, args=(b"\x00bytes",), when=0, serializer="pickle", strict=False)
    assert _released(app) == [h.id]
    env = json.loads(get_store(app).redis.client.lpop(app.conf.task_default_queue))
    assert env["content-type"] == "application/x-python-serialize"
    # The store and the scheduler never unpickle: the body is opaque base64 to them.
    assert env["properties"]["body_encoding"] == "base64"
    assert base64.b64decode(env["body"])[:1] == b"\x80"


def test_the_package_never_deserializes_untrusted_formats() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for pattern in (r"\bpickle\.loads?\b", r"\byaml\.(load|unsafe_load)\b", r"\bmarshal\.loads?\b", r"\beval\("):
            if re.search(pattern, text):
                offenders.append(f"{path.name}: {pattern}")
    assert offenders == []


# -- Lua source ------------------------------------------------------------------------

HOSTILE = [
    "'; redis.call('FLUSHALL') --",
    '"]] .. redis.call("FLUSHALL") .. [[',
    "]]--[==[ \\\" \\0 \x00 end",
    "{0}:{1} %s %d \\n",
    "ünï 🚀 \u202e",
]


def test_scripts_are_static_files() -> None:
    """Each script's source is its file with includes inlined, and the SHA Redis runs is its SHA."""
    table = scripts()
    names = sorted(p.stem for p in lua_dir().glob("*.lua"))
    assert names, "no Lua scripts found"
    # Every file is a registered script and every registered script is a file: no Lua file
    # escapes the checks below, and nothing is run that is not in lua/.
    assert sorted(s.name for s in table.all()) == names
    for name in names:
        script = getattr(table, name, None)
        assert script is not None, f"lua/{name}.lua has no registered script"
        text = (lua_dir() / f"{name}.lua").read_text(encoding="utf-8")
        assert script.source == source(name)
        assert script.sha == hashlib.sha1(script.source.encode()).hexdigest()
        # Inlining only replaces include lines, with other static files.
        skeleton = re.sub(r'^-- @include "[a-z_]+"$', "", text, flags=re.MULTILINE)
        for line in skeleton.splitlines():
            assert line in script.source
    # Nothing in the package builds Lua at run time or runs unregistered source.
    for path in PACKAGE.rglob("*.py"):
        code = path.read_text()
        assert not re.search(r"\.(eval|register_script)\(", code), f"{path.name} evaluates ad-hoc Lua"
        for m in re.finditer(r"script_load\(([^)]*)\)", code):
            assert m.group(1).strip() == "self.source", f"{path.name} loads Lua that is not a script file"


def test_hostile_strings_round_trip_and_never_reach_lua_source(app, rclient) -> None:  # type: ignore[no-untyped-def]
    table = get_store(app).redis.scripts.all()
    known = {s.sha for s in table}
    heads = {s.source[:60] for s in table}
    seen: list[dict[str, str]] = []
    with rclient.monitor() as mon:  # type: ignore[no-untyped-call]
        rclient.echo("monitor-start")
        wait_for(lambda: mon.next_command()["command"] == "ECHO monitor-start", 5, interval=0)
        get_store(app).redis.client.script_flush()  # so that the scripts are loaded again, in view
        results = []
        for n, text in enumerate(HOSTILE):
            # ids and keys refuse control characters (test_bad_input): their hostile part is the printable rest
            printable = "".join(c for c in text if c.isprintable()) or "x"
            results.append(apply_later(app, TASK, args=(text, {text: [text]}), kwargs={"k": text}, when=0,
                                       task_id=f"id-{n}-{printable}", shard_key=printable,
                                       headers={"x-user": text}, strict=False))
        keyed = apply_later(app, TASK, args=("k",), when=60, idempotency_key=HOSTILE[0], strict=False)
        released = _released(app)
        cd.cancel(app, keyed.id)
        rclient.echo("monitor-end")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            cmd = mon.next_command()
            if cmd["command"] == "ECHO monitor-end":
                break
            seen.append(cmd)
    assert sorted(released) == sorted(r.id for r in results)
    assert get_store(app).lookup.get(keyed.id)["st"] == "CANCELLED"
    assert get_store(app).lookup.get(keyed.id)["ik"] == HOSTILE[0]
    # Every script call ran a known SHA; no EVAL with a body, no SCRIPT LOAD of anything else.
    tcp = [c["command"] for c in seen if c["client_type"] != "lua"]
    assert sum(c.upper().startswith("EVALSHA") for c in tcp) >= len(HOSTILE) + 2, tcp[:20]
    loads = [c for c in tcp if c.upper().startswith("SCRIPT LOAD")]
    assert loads, "the scripts were not loaded again after SCRIPT FLUSH"
    for cmd in tcp:
        word = cmd.split(" ", 1)[0].upper()
        assert word != "EVAL", cmd[:200]
        if word == "EVALSHA":
            assert cmd.split(" ")[1] in known
    for cmd in loads:
        body = cmd[len("SCRIPT LOAD "):].replace("\\n", "\n")[:40]
        assert any(h.startswith(body) for h in heads), cmd[:100]
    # The messages on the queue carry the strings unchanged.
    bodies = [json.loads(m) for m in rclient.lrange(app.conf.task_default_queue, 0, -1)]
    by_id = {b["headers"]["id"]: b for b in bodies}
    for n, (text, result) in enumerate(zip(HOSTILE, results, strict=True)):
        assert result.id.startswith(f"id-{n}-")
        b = by_id[result.id]
        args, kwargs, _ = json.loads(base64.b64decode(b["body"]))
        assert args == [text, {text: [text]}] and kwargs == {"k": text}
        assert b["headers"]["x-user"] == text
    assert rclient.dbsize() > 0  # nothing was flushed


# -- ACL -------------------------------------------------------------------------------


def acl_rule(store_prefix: str, broker_prefix: str, db: int = 0) -> list[str]:
    """The least privilege celery-delayed and a Celery worker need (docs/guarantees-faults.md).

    Keys: the store's prefix and the broker's ``global_keyprefix``. Channels: the
    scheduler wake-up channel, the broker's fanout channels and, literally (PSUBSCRIBE
    patterns are matched literally), kombu's remote-control channel. Commands: all
    but @dangerous (no FLUSHALL, KEYS, CONFIG, DEBUG, ...), and INFO (read for the
    store's maxmemory policy).
    """
    return ["on", f"~{store_prefix}:*", f"~{broker_prefix}*", f"&{store_prefix}:wake", f"&{broker_prefix}*",
            f"&{broker_prefix}/{db}.celery.pidbox", "+@all", "-@dangerous", "+info"]


@pytest.mark.timeout(90)
def test_acl_user_limited_to_the_store_and_broker_prefixes_is_enough(workers: list, uid: str) -> None:  # type: ignore[type-arg]
    with RedisServer() as server:
        admin = redis.Redis(port=server.port, decode_responses=True)
        prefix, bk = f"t{uid}", f"bk{uid}:"
        admin.execute_command("ACL", "SETUSER", "delayed", "reset", ">acl-pw", *acl_rule(prefix, bk))
        url = f"redis://delayed:acl-pw@127.0.0.1:{server.port}/0"
        conf = {"broker_transport_options": {"global_keyprefix": bk}}
        app = make_app(url, uid, **conf)
        queue = app.conf.task_default_queue
        workers.append(SchedulerProcess(url, prefix, queue, conf=conf))
        w = WorkerProcess(url, prefix, queue, concurrency=2, pool="threads", conf=conf)
        workers.append(w)
        ids = {apply_later(app, TASK, args=(i,), when=0.3, strict=False).id for i in range(5)}
        gone = apply_later(app, TASK, when=60, strict=False)
        assert cd.cancel(app, gone.id) == "SCHEDULED"
        wait_for(lambda: set(ran(admin, prefix)) == ids, 45, what="5 jobs run by the ACL user")
        assert admin.execute_command("ACL", "LOG") == [], "something needed a permission the rule lacks"
        # ... and the rule really is narrow.
        user = redis.Redis.from_url(url, decode_responses=True)
        admin.set("someone-else:key", "x")
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.get("someone-else:key")
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.keys("*")
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.publish("other-channel", "x")
