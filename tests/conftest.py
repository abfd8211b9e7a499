"""Shared fixtures: a private redis-server, per-test apps, real worker subprocesses."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

sys.path.insert(0, str(Path(__file__).parent))

from helpers import SchedulerProcess, WorkerProcess
from redis_server import RedisServer

pytest_plugins = ("celery.contrib.pytest",)

IN_CI = bool(os.environ.get("CI"))


def need(what: str, available: bool) -> None:
    """Skip when a server the test needs is missing; fail instead when CI is set."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI but is not available")
    pytest.skip(f"{what} is not available")


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


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


def make_app(broker: str, uid: str, **conf: object) -> Celery:
    app = Celery(f"t{uid}", broker=broker, set_as_current=False)
    app.conf.update(
        delayed_key_prefix=f"t{uid}",
        task_default_queue=f"q{uid}",
        broker_connection_retry_on_startup=True,
        **conf,
    )
    return app


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
