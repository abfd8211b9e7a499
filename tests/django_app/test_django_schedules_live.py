"""A recurring schedule edited in the admin fires in a scheduler that is already running (no restart).

A real ``celery -A e2e_app delayed run`` process on the test's store; the
admin adds a schedule, changes its arguments, then disables it. Each change
shows in what the scheduler releases onto the queue (the broker's list: the
direct release path), within seconds.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import redis
from celery import Celery
from conftest import client_for
from support import SchedulerProcess, wait_for

SCHEDULES = "/admin/celery_delayed/schedule/"


def released_args(client: redis.Redis, queue: str) -> list[Any]:
    """The args of every message released onto ``queue`` (oldest first)."""
    out = []
    for raw in reversed(client.lrange(queue, 0, -1)):
        env = json.loads(raw)
        out.append(json.loads(base64.b64decode(env["body"]))[0])
    return out


def test_a_schedule_edited_in_the_admin_fires_in_the_running_scheduler(
        admin_app: Celery, redis_url: str, uid: str, rclient: redis.Redis, workers: list[Any]) -> None:
    queue = f"q{uid}"
    sched = SchedulerProcess(redis_url, f"t{uid}", queue)
    workers.append(sched)
    wait_for(lambda: "scheduler" in sched.output().lower() and sched.proc.poll() is None, 20,
             what="the scheduler to start")
    c = client_for("admin")
    form = {"name": "tick", "task": "e2e.mark", "enabled": "on", "kind": "interval", "every": "1",
            "minute": "*", "hour": "*", "day_of_month": "*", "month_of_year": "*", "day_of_week": "*",
            "timezone": "", "args": '["v1"]', "kwargs": "{}", "queue": "", "misfire": "latest"}
    assert c.post(f"{SCHEDULES}add/", form).status_code == 302
    wait_for(lambda: released_args(rclient, queue).count(["v1"]) >= 2, 20, what="two occurrences released")

    assert c.post(f"{SCHEDULES}tick/change/", {**form, "args": '["v2"]'}).status_code == 302
    wait_for(lambda: released_args(rclient, queue).count(["v2"]) >= 2, 20, what="the edited schedule's occurrences")
    after_edit = released_args(rclient, queue)
    assert after_edit[after_edit.index(["v2"]):].count(["v1"]) <= 1  # at most one already on its way

    assert c.post(f"{SCHEDULES}tick/change/", {**form, "args": '["v2"]', "enabled": ""}).status_code == 302
    time.sleep(1.5)  # an occurrence released as the form was saved may still arrive
    stopped = len(released_args(rclient, queue))
    time.sleep(2.5)
    assert len(released_args(rclient, queue)) == stopped  # disabled: nothing more fires
    assert sched.proc.poll() is None, sched.output()[-3000:]
