"""Opt-in interception: plain apply_async(countdown=/eta=) and Task.retry(countdown=) go through the store."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from support import SchedulerProcess, WorkerProcess, make_app, wait_for
from support.delivery import looked_ahead
from support.retry import QueueWatch, runs

import celery_delayed
from celery_delayed import DelayedResult, get_store
from celery_delayed.errors import DuplicateJob, JobNotFound
from celery_delayed.worker import intercept

pytestmark = pytest.mark.e2e


def _stub(app: Any, name: str) -> Any:
    @app.task(name=name, bind=True, shared=False)
    def stub(self: Any, *args: Any) -> None:  # the real body lives in the worker (retry_tasks.py)
        raise AssertionError("runs in the worker only")

    return stub


def test_off_without_the_setting(redis_url, uid, rclient):
    app = celery_delayed.install(make_app(redis_url, uid))
    assert intercept.installed(app)  # wrapped, but inert without delayed_intercept_eta
    mark = _stub(app, "rt.plain_mark")
    res = mark.apply_async(countdown=30)  # Celery's own ETA message
    assert not isinstance(res, DelayedResult)
    assert rclient.llen(app.conf.task_default_queue) == 1
    with pytest.raises(JobNotFound):
        get_store(app).lookup.get(res.id)


@pytest.mark.timeout(120)
def test_plain_apply_async_and_retry_are_stored_not_sent(redis_url, uid, workers, rclient):
    conf = {"imports": ["retry_tasks"], "delayed_intercept_eta": True, "delayed_intercept_min_delay_s": 0.5}
    app = celery_delayed.install(make_app(redis_url, uid, **{k: v for k, v in conf.items() if k != "imports"}))
    mark, retrying = _stub(app, "rt.plain_mark"), _stub(app, "rt.plain_retry")
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    store = get_store(app)
    # apply_async(countdown=) on a plain task: a stored job, nothing in the broker
    t0 = time.time()
    h = mark.apply_async(args=(1,), countdown=1.5)
    assert isinstance(h, DelayedResult) and intercept.installed(app)
    rec = store.lookup.get(h.id)
    assert rec["st"] == "SCHEDULED" and rec["task"] == "rt.plain_mark"
    assert rclient.llen(queue) == 0
    # eta= (aware datetime) and send_task by name are intercepted too
    h_eta = mark.apply_async(args=(2,), eta=datetime.now(timezone.utc) + timedelta(seconds=1.5))
    h_name = app.send_task("rt.plain_mark", args=(3,), countdown=1.5)
    assert store.lookup.get(h_eta.id)["st"] == store.lookup.get(h_name.id)["st"] == "SCHEDULED"
    # below delayed_intercept_min_delay_s: Celery's own ETA message, as before
    short = mark.apply_async(args=(4,), countdown=0.2)
    with pytest.raises(JobNotFound):
        store.lookup.get(short.id)
    assert rclient.llen(queue) == 1
    w = WorkerProcess(redis_url, prefix, queue, conf=conf, concurrency=1, pool="solo")
    workers.append(w)
    workers.append(SchedulerProcess(redis_url, prefix, queue, conf=conf))
    w.wait_ready()
    ids = [h.id, h_eta.id, h_name.id, short.id]
    wait_for(lambda: all(runs(rclient, prefix, i) for i in ids), 30, what="the four runs")
    assert runs(rclient, prefix, h.id)[0][1] - t0 >= 1.5
    # released by the scheduler, then run under the execution record: plain tasks from the store are tracked too
    wait_for(lambda: store.lookup.get(h.id)["st"] == "SUCCEEDED", 10, what="the plain task's finish to be recorded")
    # Task.retry(countdown=) inside a plain task: the retry is stored, not an ETA message
    r = retrying.apply_async(args=(1.2,))  # no delay: sent to the broker directly
    watch = QueueWatch(rclient, queue, r.id)
    wait_for(lambda: len(runs(rclient, prefix, r.id)) >= 2, 30, what="the retried run")
    seen = watch.stop()
    got = runs(rclient, prefix, r.id)
    assert [n for n, _ in got] == [0, 1]
    assert got[1][1] - got[0][1] >= 1.2
    assert all(looked_ahead(hd) for hd in seen), seen
    wait_for(lambda: store.lookup.get(r.id)["st"] == "SUCCEEDED", 10, what="the retry's finish to be recorded")
    assert store.lookup.get(r.id)["retries"] == "1"


def test_publish_options_dropped_unknown_options_kept_as_properties(redis_url, uid, rclient, caplog):
    app = celery_delayed.install(make_app(redis_url, uid, delayed_intercept_eta=True))
    mark = _stub(app, "rt.plain_mark")
    store = get_store(app)
    # publish-only options have no meaning for a stored job: still stored
    h = mark.apply_async(args=(1,), countdown=60, retry=True, retry_policy={"max_retries": 1}, mandatory=False,
                         priority=5, headers={"tenant": "acme"})
    assert isinstance(h, DelayedResult) and store.lookup.get(h.id)["st"] == "SCHEDULED"
    env = json.loads(store.lookup.message(h.id, h.shard))
    assert env["headers"]["tenant"] == "acme" and env["properties"]["priority"] == 5
    assert env["headers"]["eta"] is None and env["headers"]["id"] == h.id
    # an option Celery does not know: a message property, as kombu's publish makes it (stored, no warning)
    with caplog.at_level("WARNING", logger="celery_delayed.intercept"):
        other = mark.apply_async(args=(2,), countdown=60, some_option="x")
    assert isinstance(other, DelayedResult) and not caplog.text
    env = json.loads(store.lookup.message(other.id, other.shard))
    assert env["properties"]["some_option"] == "x"
    # a message the store refuses (a priority over 255; kombu's Redis transport takes it as 9): Celery's
    # ETA message, as before, and a warning says why
    with caplog.at_level("WARNING", logger="celery_delayed.intercept"):
        sent = mark.apply_async(args=(2,), countdown=60, priority=300)
    assert not isinstance(sent, DelayedResult)
    assert "sent to the broker as an ETA message" in caplog.text and "InvalidOption" in caplog.text
    [plist] = rclient.keys(app.conf.task_default_queue + "*")  # kombu's priority list 9
    assert rclient.llen(plist) == 1 and json.loads(rclient.lindex(plist, 0))["headers"]["eta"] is not None
    # a task id still pending in the store is refused, not sent twice
    with pytest.raises(DuplicateJob):
        mark.apply_async(args=(3,), countdown=60, task_id=h.id)
