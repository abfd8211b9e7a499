"""Shared fixtures: a private redis-server, per-test apps, real worker subprocesses.

Tests import their helpers from the ``support`` package (this folder is put
on ``sys.path``); worker subprocesses load the apps in ``support/worker_apps``.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE / "support" / "worker_apps"))

from support import RedisServer, SchedulerProcess, WorkerProcess, make_app, need, port_open  # noqa: E402

pytest_plugins = ("celery.contrib.pytest",)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server for the whole session (tests isolate by key prefix / queue)."""
    need("redis-server", shutil.which("redis-server") is not None)
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def rclient(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def uid() -> str:
    """A short unique id to name this test's keys and queues."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def app(redis_url: str, uid: str) -> Celery:
    """A Celery app on the private Redis with its own key prefix and default queue."""
    return make_app(redis_url, uid)


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess | SchedulerProcess]]:
    """Collects worker/scheduler subprocesses started by a test and stops them after it."""
    procs: list[WorkerProcess | SchedulerProcess] = []
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    need("RabbitMQ on 127.0.0.1:5672", port_open("127.0.0.1", 5672))
    return "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture
def rabbit_queue(rabbitmq_url: str, uid: str) -> Iterator[str]:
    """This test's queue name on RabbitMQ (``make_app``'s default queue), deleted with its exchange after it."""
    from kombu import Connection

    name = f"q{uid}"
    yield name
    with Connection(rabbitmq_url) as conn:
        ch = conn.default_channel
        ch.queue_delete(name)
        ch.exchange_delete(name)


@pytest.fixture(params=["postgresql", "sqlite"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A private database, once PostgreSQL (created and dropped) and once SQLite (a file)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'delayed.db'}"
        return
    from support.databases import postgres_database

    with postgres_database() as url:
        yield url
