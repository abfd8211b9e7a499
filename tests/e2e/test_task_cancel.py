"""Cancellation in every state: SCHEDULED, QUEUED (skipped by the worker, seen as revoked),
RUNNING (refused, or terminated on request), and cancel racing release."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from support import WorkerProcess, make_app, ran, wait_for

from celery_delayed import InvalidState, apply_later, cancel, get_store
from celery_delayed.store import ShardStatus


def _release_all(app: Celery) -> list[str]:
    store = get_store(app)
    return [jid for s in range(store.config.shards) for jid in store.release.release_due(s).ids]


class EventLog:
    """Captures the app's events with a real ``app.events.Receiver`` in a thread."""

    def __init__(self, app: Celery) -> None:
        self.events: list[dict[str, Any]] = []
        self.conn = app.connection_for_read()
        self.recv = app.events.Receiver(self.conn, handlers={"*": self.events.append})
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        with app.connection_for_write() as conn:  # pub/sub: wait until the subscription is live
            dispatcher = app.events.Dispatcher(conn, enabled=True)
            wait_for(lambda: dispatcher.send("test-hello") or self.of("test-hello"), 15, interval=0.2,
                     what="the event receiver to subscribe")
            dispatcher.close()

    def _run(self) -> None:
        with contextlib.suppress(Exception):  # its connection is closed under it at the end
            self.recv.capture(limit=None, timeout=None, wakeup=False)

    def of(self, kind: str, uuid: str | None = None) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e.get("type") == kind and (uuid is None or e.get("uuid") == uuid)]

    def close(self) -> None:
        self.recv.should_stop = True
        self.conn.close()
        self.thread.join(5)


def test_cancel_scheduled(app):
    h = apply_later(app, "e2e.mark", when=3600, strict=False)
    assert cancel(app, h.id) == "SCHEDULED"
    assert h.job_state == "CANCELLED"
    assert sum(r["pending"] for r in ShardStatus(get_store(app)).rows()) == 0
    with pytest.raises(InvalidState) as err:
        cancel(app, h.id)
    assert err.value.state == "CANCELLED"
    assert h.cancel() is False
    assert _release_all(app) == []


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_cancelled_after_release_is_skipped_and_seen_as_revoked(redis_url, uid, rclient, workers):
    """QUEUED then cancelled: the worker acks it without running it; events and backend say REVOKED."""
    conf = {"result_backend": redis_url, "task_track_started": True, "worker_send_task_events": True}
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    h = apply_later(app, "e2e.mark", when=0, strict=False)
    keep = apply_later(app, "e2e.mark", when=0, strict=False)
    assert sorted(_release_all(app)) == sorted([h.id, keep.id])
    assert h.cancel() is True  # it is in the queue: the worker will skip it
    assert h.job_state == "CANCELLED"
    log = EventLog(app)
    try:
        w = WorkerProcess(redis_url, prefix, queue, conf=conf, extra=["-E"])
        workers.append(w)
        wait_for(lambda: log.of("task-revoked", h.id), 30, what="the task-revoked event")
        wait_for(lambda: keep.id in ran(rclient, prefix), 20, what="the other job to run")
        kinds = [e["type"] for e in log.events if e.get("uuid") == h.id]
        assert "task-succeeded" not in kinds and "task-failed" not in kinds
        ev = log.of("task-revoked", h.id)[0]
        assert ev["terminated"] is False and ev["expired"] is False
    finally:
        log.close()
    assert ran(rclient, prefix) == [keep.id]
    assert app.AsyncResult(h.id).state == "REVOKED"  # not stuck in STARTED (task_track_started)
    assert app.AsyncResult(keep.id).state == "SUCCESS"
    assert rclient.llen(queue) == 0 and not rclient.hexists("unacked", h.id)


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_cancel_running_says_so_and_terminate_kills_it(redis_url, uid, rclient, workers):
    conf = {"imports": ["worker_side_tasks"], "result_backend": redis_url, "delayed_exec_lease_ms": 1500}
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    h = apply_later(app, "ws.slow", (30,), when=0, strict=False)
    _release_all(app)
    workers.append(WorkerProcess(redis_url, prefix, queue, conf=conf, concurrency=1))
    wait_for(lambda: rclient.llen(f"{prefix}:started") == 1, 30, what="the body to start")
    assert h.job_state == "RUNNING"
    with pytest.raises(InvalidState) as err:
        cancel(app, h.id)
    assert err.value.state == "RUNNING" and err.value.operation == "cancel"
    assert h.cancel() is False
    assert h.job_state == "RUNNING"

    assert cancel(app, h.id, terminate=True) == "RUNNING"
    assert h.job_state == "CANCELLED"
    wait_for(lambda: app.AsyncResult(h.id).state == "REVOKED", 20, what="the terminated task to be REVOKED")
    assert ran(rclient, prefix) == []  # killed before its end
    rec = h.job()
    assert rec["st"] == "CANCELLED" and "lo" not in rec


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_terminate_with_a_signal_and_from_the_handle(redis_url, uid, rclient, workers):
    """``cancel(app, id, terminate=True, signal="SIGKILL")`` kills the running pool process with that
    signal; ``h.cancel(terminate=True)`` cancels a running job from its handle (True) and kills it
    with the default SIGTERM."""
    conf = {"imports": ["worker_side_tasks"], "result_backend": redis_url}
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    by_id = apply_later(app, "ws.slow", (30,), when=0, strict=False)
    by_handle = apply_later(app, "ws.slow", (30,), when=0, strict=False)
    _release_all(app)
    w = WorkerProcess(redis_url, prefix, queue, conf=conf, concurrency=2)
    workers.append(w)
    wait_for(lambda: rclient.llen(f"{prefix}:started") == 2, 30, what="both bodies to start")
    assert by_handle.cancel() is False  # running: not without terminate
    assert cancel(app, by_id.id, terminate=True, signal="SIGKILL") == "RUNNING"
    assert by_handle.cancel(terminate=True) is True
    for h in (by_id, by_handle):
        wait_for(lambda h=h: app.AsyncResult(h.id).state == "REVOKED", 20, what=f"{h.id} to be REVOKED")
        assert h.job_state == "CANCELLED"
    # The worker sent each pool process the signal asked for (SIGKILL; SIGTERM by default) ...
    out = w.output()
    assert f"Terminating {by_id.id} ({int(signal.SIGKILL)})" in out, out[-3000:]
    assert f"Terminating {by_handle.id} ({int(signal.SIGTERM)})" in out, out[-3000:]
    # ... and both processes that ran the bodies are gone.
    pids = {int(x.split("|")[1]) for x in rclient.lrange(f"{prefix}:started", 0, -1)}
    wait_for(lambda: all(_gone(pid) for pid in pids), 20, what="the pool processes to die")
    assert ran(rclient, prefix) == []  # neither body reached its end


@pytest.mark.timeout(60)
def test_cancel_races_release_each_job_released_or_cancelled_never_both(redis_url, uid, rclient):
    """Cancels from one thread against releases from another, 2,000 jobs already due."""
    app = make_app(redis_url, uid, delayed_shards=4)
    store = get_store(app)
    queue = app.conf.task_default_queue
    n = 2000
    ids = [h.id for h in app_many(app, n)]
    released: list[str] = []
    outcome: dict[str, str] = {}
    go = threading.Barrier(2)

    def releaser() -> None:
        go.wait(5)
        while True:
            got = [jid for s in range(4) for jid in store.release.release_due(s, limit=1).ids]
            released.extend(got)
            if not got and sum(r["pending"] for r in ShardStatus(store).rows()) == 0:
                return

    def canceller() -> None:
        order = ids[:]
        random.Random(7).shuffle(order)
        go.wait(5)
        for jid in order:
            try:
                outcome[jid] = cancel(app, jid)
            except InvalidState as exc:  # pragma: no cover - a released job stays cancellable
                outcome[jid] = f"refused {exc.state}"

    threads = [threading.Thread(target=releaser), threading.Thread(target=canceller)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    cancelled_before = {j for j, prev in outcome.items() if prev == "SCHEDULED"}
    cancelled_after = {j for j, prev in outcome.items() if prev == "QUEUED"}
    queued = [json.loads(m)["headers"]["id"] for m in rclient.lrange(queue, 0, -1)]
    assert len(released) == len(set(released))  # released at most once
    assert not cancelled_before & set(released)  # never both
    assert cancelled_before | set(released) == set(ids)  # each one or the other
    assert sorted(queued) == sorted(released)  # exactly the released ones were pushed
    assert cancelled_after <= set(released)
    assert len(cancelled_before) > 100 and len(released) > 100, "no race happened"
    states = {store.lookup.get(j)["st"] for j in ids}
    assert states == {"CANCELLED"}


def _gone(pid: int) -> bool:
    """Whether process ``pid`` is dead (or a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return True


def app_many(app: Celery, n: int) -> list[Any]:
    from celery_delayed import apply_later_many

    return apply_later_many(app, "e2e.mark", ({"args": (i,), "when": 0} for i in range(n)), strict=False)
