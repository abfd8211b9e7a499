"""Flower sees delayed jobs through Celery's own events (a real Flower process, through its HTTP API).

With ``task_send_sent_event = True``: ``apply_later`` sends ``task-sent`` with
the eta (Flower lists the job as pending, with its ETA), a cancel sends
``task-revoked`` (REVOKED), and a job released and run ends as SUCCESS from
the worker's own events (``-E``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import urllib.error
import urllib.request
from datetime import datetime
from typing import Any

import pytest
from support import Proc, SchedulerProcess, WorkerProcess, app_env, free_port, make_app, need, wait_for

from celery_delayed import apply_later, cancel

pytestmark = pytest.mark.e2e
CONF = {"task_send_sent_event": True}


def _get(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read().decode())
    except (urllib.error.URLError, OSError, ValueError):
        return None


class Flower(Proc):
    """``celery -A e2e_app flower`` on a free port, its API open (FLOWER_UNAUTHENTICATED_API), no persistence."""

    def __init__(self, broker: str, prefix: str, queue: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = tempfile.mkdtemp(prefix="flower-")
        env = app_env(broker, prefix, queue, conf=CONF) | {"FLOWER_UNAUTHENTICATED_API": "true"}
        args = [sys.executable, "-m", "celery", "-A", "e2e_app", "flower", f"--port={self.port}",
                "--address=127.0.0.1", "--persistent=False", "--purge_offline_workers=1"]
        super().__init__(args, env)

    def task(self, job_id: str) -> dict[str, Any] | None:
        return _get(f"{self.url}/api/task/info/{job_id}")


@pytest.mark.timeout(120)
def test_flower_shows_scheduled_eta_revoked_and_success(redis_url, uid, workers):
    need("flower", importlib.util.find_spec("flower") is not None)
    prefix, queue = f"t{uid}", f"q{uid}"
    flower = Flower(redis_url, prefix, queue)
    workers.append(flower)  # stopped after the test
    wait_for(lambda: _get(f"{flower.url}/api/workers?status=1") is not None or flower.proc.poll() is not None,
             30, what="Flower to answer")
    assert flower.proc.poll() is None, flower.output()[-2000:]
    worker = WorkerProcess(redis_url, prefix, queue, conf=CONF, pool="solo", concurrency=1, extra=["-E"])
    workers.append(worker)
    worker.wait_ready()
    app = make_app(redis_url, uid, **CONF)

    # Events are pub/sub: those sent before Flower subscribed are lost, so
    # schedule until one is seen (the others stay scheduled and never run).
    def scheduled_and_seen() -> Any:
        h = apply_later(app, "e2e.mark", args=(1,), when=600, strict=False)
        try:
            return h, wait_for(lambda: flower.task(h.id), 2, interval=0.1)
        except AssertionError:
            return None

    h, info = wait_for(scheduled_and_seen, 30, interval=0, what="Flower to see a scheduled job")
    assert info["state"] == "PENDING"
    assert info["name"] == "e2e.mark"
    assert datetime.fromisoformat(info["eta"]) == h.eta
    assert cancel(app, h.id) == "SCHEDULED"
    wait_for(lambda: (flower.task(h.id) or {}).get("state") == "REVOKED", 20, interval=0.2,
             what="Flower to show the cancelled job REVOKED")

    sched = SchedulerProcess(redis_url, prefix, queue, conf=CONF)
    workers.append(sched)
    h2 = apply_later(app, "e2e.mark", args=(2,), when=2, strict=False)
    info = wait_for(lambda: flower.task(h2.id), 20, interval=0.1, what="Flower to see the second job")
    assert info["eta"] is not None and datetime.fromisoformat(info["eta"]) == h2.eta
    done = wait_for(lambda: (flower.task(h2.id) or {}).get("state") == "SUCCESS" and flower.task(h2.id), 40,
                    interval=0.2, what="Flower to show the released job SUCCESS")
    assert done["worker"] == worker.name
    assert done["result"] == repr(h2.id)
