"""The Celery app of the benchmark: loaded by its worker and scheduler subprocesses.

Configured by environment variables: BENCH_REDIS (broker and store URL),
BENCH_PREFIX (delayed_key_prefix and the key runs are recorded under),
BENCH_QUEUE (default queue), BENCH_CONF (JSON of extra settings). The
benchmark process itself builds the same app with :func:`make_app`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_delayed import DelayedTask

_clients: dict[str, redis.Redis] = {}


def make_app(url: str, prefix: str, queue: str, **conf: Any) -> Celery:
    """A Celery app on ``url`` with the two benchmark tasks.

    Each run of a task appends "<task id>|<start time>|<due time>|<pid>" to
    the list ``<prefix>:ran`` (times are epoch seconds).
    """
    app = Celery(f"bench-{prefix}", broker=url, set_as_current=False)
    app.conf.update(
        delayed_key_prefix=prefix,
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        **conf,
    )

    def record(task_id: str, due: float) -> None:
        start = time.time()
        client = _clients.get(url)
        if client is None:
            client = _clients[url] = redis.Redis.from_url(url)
        client.rpush(f"{prefix}:ran", f"{task_id}|{start:.6f}|{due:.6f}|{os.getpid()}")

    @app.task(bind=True, name="bench.late")
    def late(self: Any, due: float = 0.0, pad: str = "") -> None:
        """A plain Celery task (Celery's ETA path)."""
        record(self.request.id, due)

    @app.task(bind=True, base=DelayedTask, name="bench.late_d")
    def late_d(self: Any, due: float = 0.0, pad: str = "") -> None:
        """The same task on the celery-delayed base class."""
        record(self.request.id, due)

    return app


app = make_app(
    os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0"),
    os.environ.get("BENCH_PREFIX", "bench"),
    os.environ.get("BENCH_QUEUE", "bench"),
    **json.loads(os.environ.get("BENCH_CONF", "{}")),
)
