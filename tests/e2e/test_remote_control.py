"""Celery's remote control with interception on (issue 16): ``inspect scheduled`` and ``revoke`` know the store.

Real worker and scheduler processes: a worker lists the stored jobs of its
queues in ``inspect scheduled``; Celery's revoke, from the caller or from
any process's broadcast, cancels a stored job in the store, durably.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from support import SchedulerProcess, WorkerProcess, make_app, wait_for
from support.retry import runs

import celery_delayed
from celery_delayed import DelayedResult, get_store
from celery_delayed.timeutil import from_ms

pytestmark = pytest.mark.e2e

CONF: dict[str, Any] = {"imports": ["fidelity_tasks"], "delayed_intercept_eta": True}


def _stub(app: Any, name: str) -> Any:
    @app.task(name=name, bind=True, shared=False)
    def stub(self: Any, *args: Any, **kwargs: Any) -> None:  # the real body lives in the worker (fidelity_tasks.py)
        raise AssertionError("runs in the worker only")

    return stub


def _app(redis_url: str, uid: str, **conf: Any) -> Any:
    return celery_delayed.install(make_app(redis_url, uid, **{**CONF, **conf, "imports": []}))


@pytest.mark.timeout(120)
def test_inspect_scheduled_lists_the_stored_jobs_of_the_workers_queues(redis_url, uid, workers, rclient):
    app = _app(redis_url, uid)
    plain = _stub(app, "fd.plain")
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    celery_only = make_app(redis_url, uid)  # no interception: Celery's own ETA message, held by the worker
    held = _stub(celery_only, "fd.plain").apply_async(args=(0,), countdown=60)
    workers.append(w := WorkerProcess(redis_url, prefix, queue, conf=CONF, concurrency=1, pool="solo"))
    w.wait_ready()
    exec_time = datetime.now(timezone.utc) + timedelta(seconds=60)
    res = plain.apply_async([1, 2], {"z": 3}, eta=exec_time)  # as Celery's test_inspect::test_scheduled
    elsewhere = plain.apply_async(args=(9,), countdown=60, queue=f"other{uid}")
    assert isinstance(res, DelayedResult) and isinstance(elsewhere, DelayedResult)

    def entries() -> dict[str, Any]:
        reply = app.control.inspect(destination=[w.name], timeout=3).scheduled() or {}
        return {e["request"]["id"]: e for e in reply.get(w.name, [])}

    got = wait_for(lambda: (e := entries()) and held.id in e and e, 20, what="the held ETA task listed")
    assert got[res.id] == {
        "eta": exec_time.strftime("%Y-%m-%dT%H:%M:%S.%f") + "+00:00",
        "priority": 6,
        "request": {
            "id": res.id, "name": "fd.plain", "args": [1, 2], "kwargs": {"z": 3}, "type": "fd.plain",
            "hostname": w.name, "time_start": None, "acknowledged": False,
            "delivery_info": {"exchange": "", "routing_key": queue, "priority": 0, "redelivered": False},
            "worker_pid": None,
        },
    }
    assert got[held.id]["eta"] is not None  # Celery's own entry is still there
    assert elsewhere.id not in got  # another queue's job: that queue's workers list it
    assert set(got) == {res.id, held.id}


@pytest.mark.timeout(150)
def test_celerys_revoke_cancels_a_stored_job_durably(redis_url, uid, workers, rclient):
    conf = {**CONF, "result_backend": redis_url}
    app = _app(redis_url, uid, **conf)
    plain = _stub(app, "fd.plain")
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    store = get_store(app)
    a, b, c = (plain.apply_async(args=(i,), countdown=4) for i in range(3))
    # The caller's revoke (an installed app), no worker running: cancelled in the store at once.
    app.AsyncResult(a.id).revoke()
    app.control.revoke([b.id])
    assert store.lookup.get(a.id)["st"] == store.lookup.get(b.id)["st"] == "CANCELLED"
    assert app.AsyncResult(a.id).state == "REVOKED"
    # A revoke broadcast by a process without celery-delayed (what `celery control revoke` sends):
    # the worker cancels the job in the store.
    workers.append(w := WorkerProcess(redis_url, prefix, queue, conf=conf, concurrency=1, pool="solo"))
    w.wait_ready()
    make_app(redis_url, uid).control.broadcast("revoke", arguments={"task_id": c.id, "terminate": False,
                                                                      "signal": "SIGTERM"})
    wait_for(lambda: store.lookup.get(c.id)["st"] == "CANCELLED", 10, what="the worker to cancel c in the store")
    # Durable: a new worker (no revoke in memory) and a scheduler run nothing of them once due.
    w.stop()
    workers.append(w2 := WorkerProcess(redis_url, prefix, queue, conf=conf, concurrency=1, pool="solo"))
    workers.append(SchedulerProcess(redis_url, prefix, queue, conf=conf))
    w2.wait_ready()
    d = plain.apply_async(args=(3,), countdown=1)  # a job that does run: the pipeline works
    wait_for(lambda: runs(rclient, prefix, d.id), 20, what="the control job")
    wait_for(lambda: time.time() > c.eta.timestamp() + 1.5, 10, what="the revoked jobs' due time to pass")
    assert not any(runs(rclient, prefix, h.id) for h in (a, b, c))
    assert {store.lookup.get(h.id)["st"] for h in (a, b, c)} == {"CANCELLED"}
    assert from_ms(int(store.lookup.get(d.id)["due"])) <= datetime.now(timezone.utc)
