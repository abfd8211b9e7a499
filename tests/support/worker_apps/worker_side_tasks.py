"""Extra tasks for the worker-side tests, loaded into e2e_app workers with E2E_CONF
``{"imports": ["worker_side_tasks"]}``.

Each records its start in ``<prefix>:started`` and its completed run in
``<prefix>:ran`` ("<task id>|<pid>|..."), so a test can tell a body that began
from one that ran to its end.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Task
from e2e_app import PREFIX, STORE, app, record

from celery_delayed import DelayedTask

_client: redis.Redis | None = None


def started(task_id: str) -> None:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(STORE, decode_responses=True)
    _client.rpush(f"{PREFIX}:started", f"{task_id}|{os.getpid()}|{time.time():.6f}")


@app.task(base=DelayedTask, bind=True, name="ws.slow", acks_late=True)
def slow(self: DelayedTask, seconds: float) -> str:
    started(self.request.id)
    time.sleep(seconds)
    record(self.request.id)
    return str(self.request.id)


@app.task(base=Task, bind=True, name="ws.plain_slow", acks_late=True)
def plain_slow(self: Task, seconds: float) -> str:
    started(self.request.id)
    time.sleep(seconds)
    record(self.request.id)
    return str(self.request.id)
