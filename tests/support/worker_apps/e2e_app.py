"""The Celery app that end-to-end tests run in real worker subprocesses.

Configured by environment variables so one module serves every test:
E2E_BROKER (broker URL), E2E_REDIS (store URL, default the broker),
E2E_PREFIX (delayed_key_prefix and record keys), E2E_QUEUE (default queue),
E2E_CONF (JSON of extra settings). Task bodies record each run in Redis:
RPUSH <prefix>:ran "<task id>|<pid>|<retries>".

``e2e.plain`` is a plain Celery task (no ``DelayedTask``). Released from the
store, it still runs under the execution record (CONTRACTS rule 5: a duplicate message
becomes a skip), so tests of the release path count the messages themselves:
on the queue with no worker running, or the workers' "received" lines
(``support.delivery``), which come before the execution record.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery
from redis.cluster import RedisCluster

from celery_delayed import DelayedTask, get_store

BROKER = os.environ.get("E2E_BROKER", "redis://127.0.0.1:6379/0")
STORE = os.environ.get("E2E_REDIS", BROKER)
PREFIX = os.environ.get("E2E_PREFIX", "e2e")
QUEUE = os.environ.get("E2E_QUEUE", "celery")

app = Celery("e2e_app", broker=BROKER)
app.conf.update({
    "delayed_redis_url": STORE,
    "delayed_key_prefix": PREFIX,
    "task_default_queue": QUEUE,
    "broker_connection_retry_on_startup": True,
    "worker_hijack_root_logger": False,
    # E2E_CONF may set any of the above too (a Sentinel store: delayed_redis_url; E2E_REDIS keeps the run log).
    **json.loads(os.environ.get("E2E_CONF", "{}")),
})

_client: redis.Redis | None = None


def record(task_id: str, retries: int = 0) -> None:
    global _client
    if _client is None:
        if app.conf.get("delayed_redis_cluster") is True or (
                app.conf.delayed_redis_url == STORE and get_store(app).redis.cluster):  # "auto" found a cluster
            _client = RedisCluster.from_url(STORE, decode_responses=True)  # type: ignore[assignment]
        else:
            _client = redis.Redis.from_url(STORE, decode_responses=True)
    _client.rpush(f"{PREFIX}:ran", f"{task_id}|{os.getpid()}|{retries}|{time.time():.6f}")


@app.task(base=DelayedTask, bind=True, name="e2e.mark")
def mark(self: DelayedTask, *args: object, **kwargs: object) -> str:
    record(self.request.id, self.request.retries or 0)
    return str(self.request.id)


@app.task(base=DelayedTask, bind=True, name="e2e.sleep")
def sleep(self: DelayedTask, seconds: float) -> str:
    time.sleep(seconds)
    record(self.request.id, self.request.retries or 0)
    return str(self.request.id)


@app.task(bind=True, name="e2e.plain")
def plain(self: object, *args: object, **kwargs: object) -> str:
    """A plain Celery task (not a DelayedTask): the worker side tracks it when the store released it."""
    request = self.request  # type: ignore[attr-defined]
    record(request.id, request.retries or 0)
    return str(request.id)


@app.task(bind=True, name="e2e.live_requests")
def live_requests(self: object, ids: list[str]) -> int:
    """How many worker requests of ``ids`` are still alive in this process (run it on ``-P solo``:
    the worker's main process); RPUSH <prefix>:live "<count>"."""
    import gc

    wanted = set(ids)
    alive = sum(1 for o in gc.get_objects()
                if type(o).__name__ == "Request" and getattr(o, "id", None) in wanted)
    redis.Redis.from_url(STORE).rpush(f"{PREFIX}:live", alive)
    return alive


def _gc_off(**_: object) -> None:
    """With ``e2e_gc_disabled``: no automatic cycle collection in the worker (what reference counting
    alone frees is then all that is freed)."""
    if app.conf.get("e2e_gc_disabled"):
        import gc

        gc.disable()


from celery.signals import worker_ready  # noqa: E402

worker_ready.connect(_gc_off, weak=False)
