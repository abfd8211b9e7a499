"""Where released messages go: a store reached through a ``unix://`` URL, and
``delayed_release_mode`` forced to ``"direct"``.

``auto`` picks the direct path only when the broker URL names the store's
server and database; a unix socket and a TCP port of one server look like two
servers, so it publishes through kombu. Forcing ``"direct"`` is how such a
deployment gets the direct path: the release script pushes onto the store
server's lists, where the broker (the same server) finds them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from kombu import Connection
from support import RedisServer, make_app, need

from celery_delayed import ConfigurationError, apply_later, get_store
from celery_delayed.scheduler import PublishReleaser
from celery_delayed.store import Pending


class UnixRedis:
    def __init__(self, server: RedisServer, sock: str) -> None:
        self.server, self.sock = server, sock
        self.tcp_url = server.url
        self.unix_url = f"unix://{sock}?db=0"


@pytest.fixture(scope="module")
def unix_redis() -> Iterator[UnixRedis]:
    """A redis-server listening on a unix socket and on a TCP port."""
    need("redis-server", shutil.which("redis-server") is not None)
    folder = tempfile.mkdtemp(prefix="cd-sock-")  # short: a socket path has ~100 characters at most
    sock = os.path.join(folder, "redis.sock")
    try:
        with RedisServer("--unixsocket", sock, "--unixsocketperm", "700") as server:
            yield UnixRedis(server, sock)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def consume(broker_url: str, queue: str, n: int) -> list[str]:
    """Task ids of ``n`` messages taken from ``queue`` by a kombu consumer (what a worker would get)."""
    ids = []
    with Connection(broker_url) as conn, conn.SimpleQueue(queue) as q:
        for _ in range(n):
            msg = q.get(timeout=5)
            ids.append(msg.headers["id"])
            msg.ack()
    return ids


def test_store_on_a_unix_socket(unix_redis: UnixRedis, uid: str) -> None:
    app = make_app(unix_redis.tcp_url, uid, delayed_redis_url=unix_redis.unix_url)
    store = get_store(app)
    assert store.redis.client.connection_pool.connection_kwargs["path"] == unix_redis.sock
    assert not store.broker.direct, "auto cannot tell that a socket and a port are one server: it publishes"
    h = apply_later(app, "e2e.mark", args=(1,), when=0, strict=False)
    other = apply_later(app, "e2e.mark", args=(2,), when=3600, strict=False)
    assert sorted(r["id"] for r in Pending(store).page()) == sorted([h.id, other.id])
    assert other.cancel() is True
    releaser = PublishReleaser(app, store)
    try:
        assert releaser.release(h.shard, "", "", 10).ids == [h.id]
    finally:
        releaser.close()
    assert h.job_state == "QUEUED" and other.job_state == "CANCELLED"
    assert consume(unix_redis.tcp_url, app.conf.task_default_queue, 1) == [h.id]
    # The store's commands really went over the socket.
    assert any(c["addr"].startswith(unix_redis.sock) for c in store.redis.client.client_list())


def test_forced_direct_path_to_the_same_server_through_another_url(unix_redis: UnixRedis, uid: str) -> None:
    app = make_app(unix_redis.tcp_url, uid, delayed_redis_url=unix_redis.unix_url, delayed_release_mode="direct")
    store = get_store(app)
    assert store.broker.direct
    hs = [apply_later(app, "e2e.mark", args=(i,), when=0, strict=False) for i in range(3)]
    released = [j for s in {h.shard for h in hs} for j in store.release.release_due(s).ids]
    assert sorted(released) == sorted(h.id for h in hs)
    assert {h.job_state for h in hs} == {"QUEUED"}
    assert sorted(consume(unix_redis.tcp_url, app.conf.task_default_queue, 3)) == sorted(h.id for h in hs)


def test_forced_direct_path_with_the_broker_on_another_server_is_refused_or_delivered(
        unix_redis: UnixRedis, redis_url: str, uid: str) -> None:
    broker = unix_redis.tcp_url  # another server than the store's (the session's redis_url)
    app = make_app(broker, uid, delayed_redis_url=redis_url, delayed_release_mode="direct")
    queue = app.conf.task_default_queue
    try:
        h = apply_later(app, "e2e.mark", when=0, strict=False)
        released = get_store(app).release.release_due(h.shard).ids
    except ConfigurationError:
        return  # refused: fine
    assert released == [h.id]
    with Connection(broker) as conn:
        on_broker = conn.default_channel.client.llen(queue)
    assert on_broker == 1, f"job {h.id} is {h.job_state} but its message is not on the broker's queue"
