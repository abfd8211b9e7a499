"""Tasks of the example project; ``base=DelayedTask`` gives them ``apply_later``."""

from __future__ import annotations

import logging
import threading
import time

import redis
from celery import Task

from celery_delayed import DelayedTask

from .celery import REDIS_URL, app

logger = logging.getLogger(__name__)

_client: redis.Redis | None = None
_client_lock = threading.Lock()


def _redis() -> redis.Redis:
    """One client per worker process (redis-py clients are thread-safe)."""
    global _client
    with _client_lock:
        if _client is None:
            _client = redis.Redis.from_url(REDIS_URL)
        return _client


@app.task(base=DelayedTask)
def remind(user_id: int, text: str = "time is up") -> str:
    """Remind a user of something (here: log it)."""
    logger.info("reminding user %s: %s", user_id, text)
    return f"reminded {user_id}"


@app.task(base=DelayedTask, bind=True)
def tick(self: Task, record_key: str, due_ms: int) -> None:
    """Record when this run started next to when it was due (used by the demo).

    Appends ``"<task id>|<due ms>|<start ms>"`` to the Redis list ``record_key``;
    the demo turns the records into lateness figures and duplicate counts.
    """
    start_ms = time.time() * 1000.0
    _redis().rpush(record_key, f"{self.request.id}|{due_ms}|{start_ms:.3f}")
