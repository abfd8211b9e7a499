"""Tasks for the drop-in fidelity tests (issue 16): what a task sees of its own request.

Imported by the e2e worker (``E2E_CONF={"imports": ["fidelity_tasks"]}``).
Each run is recorded like the e2e tasks (RPUSH <prefix>:ran ...) and its
request as JSON: RPUSH <prefix>:seen {"id", "retries", "eta", "stamps", "stamped_headers"}.
"""

from __future__ import annotations

import json
from typing import Any

import redis
from celery import Task
from e2e_app import PREFIX, STORE, app, record

from celery_delayed import DelayedTask

_client: redis.Redis | None = None


def seen(request: Any) -> None:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(STORE, decode_responses=True)
    _client.rpush(f"{PREFIX}:seen", json.dumps({
        "id": request.id, "retries": request.retries or 0, "eta": request.eta,
        "stamps": getattr(request, "stamps", None), "stamped_headers": getattr(request, "stamped_headers", None),
    }))


@app.task(bind=True, name="fd.plain")
def plain(self: Task, *args: Any, **kwargs: Any) -> str:
    seen(self.request)
    record(self.request.id, self.request.retries or 0)
    return "ok"


@app.task(base=DelayedTask, bind=True, name="fd.tracked")
def tracked(self: DelayedTask, *args: Any, **kwargs: Any) -> str:
    seen(self.request)
    record(self.request.id, self.request.retries or 0)
    return "ok"


@app.task(bind=True, name="fd.retry_once")
def retry_once(self: Task, countdown: float = 1.0) -> int:
    """As Celery's own t.integration.tasks.retry_once: fails once, retried with a countdown."""
    seen(self.request)
    record(self.request.id, self.request.retries or 0)
    if self.request.retries:
        return int(self.request.retries)
    raise self.retry(countdown=countdown, max_retries=1)
