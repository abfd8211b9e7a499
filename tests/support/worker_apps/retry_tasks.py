"""Tasks for the retry, dead-letter and interception end-to-end tests.

Imported by the e2e worker (``E2E_CONF={"imports": ["retry_tasks"]}``); every
run is recorded like the e2e tasks: RPUSH <prefix>:ran "<id>|<pid>|<retries>|<time>".
"""

from __future__ import annotations

import time
from typing import Any

from celery import Task
from e2e_app import app, record

from celery_delayed import DelayedTask

Base: Any = DelayedTask  # DelayedTask(RetryMixin, Task): failures go to delayed_handle_failure


class Flaky(ValueError):
    """The error the flaky tasks raise."""


@app.task(base=Base, bind=True, name="rt.flaky", autoretry_for=(Flaky,), max_attempts=5)
def flaky(self: Any, fail_times: int) -> str:
    time.sleep(0.1)  # long enough for the test's watcher to see the delivered message
    record(self.request.id, self.request.retries or 0)
    if (self.request.retries or 0) < fail_times:
        raise Flaky(f"attempt {self.request.retries + 1} fails")
    return "ok"


@app.task(base=Base, bind=True, name="rt.manual")
def manual(self: Any, fail_times: int, countdown: float | None = None) -> str:
    record(self.request.id, self.request.retries or 0)
    if (self.request.retries or 0) < fail_times:
        try:
            raise ConnectionError("backend busy")
        except ConnectionError as exc:
            self.retry_later(exc=exc, countdown=countdown)
    return "ok"


@app.task(base=Base, bind=True, name="rt.doomed", autoretry_for=(Flaky,), max_attempts=2)
def doomed(self: Any, order: int, note: str = "") -> str:
    record(self.request.id, self.request.retries or 0)
    raise Flaky(f"order {order} cannot be processed")


@app.task(base=Base, bind=True, name="rt.broken")
def broken(self: Any) -> str:
    record(self.request.id, self.request.retries or 0)
    raise KeyError("not retryable")


@app.task(bind=True, name="rt.plain_mark")
def plain_mark(self: Task, *args: Any) -> str:
    record(self.request.id, self.request.retries or 0)
    return "ok"


@app.task(bind=True, name="rt.plain_retry", max_retries=3)
def plain_retry(self: Task, countdown: float) -> str:
    record(self.request.id, self.request.retries or 0)
    if (self.request.retries or 0) < 1:
        raise self.retry(countdown=countdown)
    return "ok"


@app.task(name="rt.dead_letter_sink", bind=True)
def dead_letter_sink(self: Task, letter: dict[str, Any]) -> str:
    record(f"dlq:{letter['id']}", 0)
    return "ok"
