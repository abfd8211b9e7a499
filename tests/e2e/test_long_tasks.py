"""Long tasks and crashed workers, with real worker processes on the Redis broker.

kombu's Redis transport redelivers a message left unacknowledged longer than
``visibility_timeout``; with ``acks_late`` a task that runs longer than that
runs again. DelayedTask's heartbeat extends its execution lease and, on the
Redis broker, refreshes the message's entry in kombu's unacked index, so the
message is not redelivered while the task runs (a redelivery that happens
anyway waits for the lease and then skips); a worker killed mid-task stops
the heartbeat, so its redelivery takes the job over once the lease passes.
"""

from __future__ import annotations

import collections
import os
import signal
import time

import pytest
from celery import Celery
from support import WorkerProcess, make_app, ran, wait_for

from celery_delayed import apply_later, apply_later_many, get_store
from celery_delayed.vocab import Reply
from celery_delayed.worker.execution import Execution, LeaseKeeper

VISIBILITY_S = 2
#: kombu's restore sweep: every second, a scan on each sweep (see issue 4's note on the throttle).
TRANSPORT = {"visibility_timeout": VISIBILITY_S, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
CONF = {
    "imports": ["worker_side_tasks"],
    "task_acks_late": True,
    "worker_prefetch_multiplier": 1,
    "broker_transport_options": TRANSPORT,
    "delayed_exec_lease_ms": 1000,
}


def _release_all(app: Celery) -> list[str]:
    store = get_store(app)
    return [jid for s in range(store.config.shards) for jid in store.release.release_due(s).ids]


def _started(rclient, prefix: str) -> list[tuple[str, str]]:
    return [tuple(x.split("|")[:2]) for x in rclient.lrange(f"{prefix}:started", 0, -1)]


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_task_running_3x_the_visibility_timeout_runs_once_plain_celery_twice(redis_url, uid, rclient, workers):
    app = make_app(redis_url, uid, **CONF)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    seconds = 3 * VISIBILITY_S + 0.5
    h = apply_later(app, "ws.slow", (seconds,), when=0, strict=False)
    assert _release_all(app) == [h.id]
    plain = app.send_task("ws.plain_slow", (seconds,), queue=queue)  # the same body on a plain Task
    w = WorkerProcess(redis_url, prefix, queue, conf=CONF, concurrency=4)
    workers.append(w)

    wait_for(lambda: h.job_state == "SUCCEEDED", 40, what="the delayed job to succeed")
    wait_for(lambda: ran(rclient, prefix).count(plain.id) >= 2, 30, what="the plain task's second run")
    # the lease heartbeat kept kombu's unacked entry fresh: the delayed job's
    # message was never redelivered (no copy had to wait for the lease)
    assert "is running elsewhere" not in w.output()
    runs = collections.Counter(ran(rclient, prefix))
    starts = collections.Counter(j for j, _ in _started(rclient, prefix))
    assert runs[h.id] == 1 and starts[h.id] == 1, "the delayed job ran more than once"
    assert runs[plain.id] >= 2 and starts[plain.id] >= 2, "plain Celery did not run it twice here"
    assert h.job()["att"] == "1"


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_worker_killed_mid_task_its_job_is_completed_by_another_worker(redis_url, uid, rclient, workers):
    app = make_app(redis_url, uid, **CONF)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    h = apply_later(app, "ws.slow", (2.0,), when=0, strict=False)
    assert _release_all(app) == [h.id]
    w1 = WorkerProcess(redis_url, prefix, queue, conf=CONF, concurrency=1)
    workers.append(w1)
    wait_for(lambda: _started(rclient, prefix), 30, what="the body to start on the first worker")
    assert h.job_state == "RUNNING"
    w1.kill()  # SIGKILL, the whole process group: no ack, no heartbeat any more

    w2 = WorkerProcess(redis_url, prefix, queue, conf=CONF, concurrency=1)
    workers.append(w2)
    wait_for(lambda: h.job_state == "SUCCEEDED", 40, what="the second worker to complete the job")
    starts = _started(rclient, prefix)
    assert [j for j, _ in starts] == [h.id, h.id] and starts[0][1] != starts[1][1]
    assert ran(rclient, prefix) == [h.id]  # the killed run never reached its end
    rec = h.job()
    assert rec["att"] == "2" and rec["wk"] == w2.name


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_pool_child_killed_redelivery_waits_for_the_lease_then_takes_over(redis_url, uid, rclient, workers):
    """task_reject_on_worker_lost requeues at once: the redelivery finds the dead child's lease still
    live, waits for it to pass (never two executions at a time), then completes the job."""
    # billiard notices a dead child within ~5 s: a longer lease makes the redelivery find it live
    conf = CONF | {"task_reject_on_worker_lost": True, "delayed_exec_lease_ms": 8000}
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    h = apply_later(app, "ws.slow", (1.0,), when=0, strict=False)
    assert _release_all(app) == [h.id]
    w = WorkerProcess(redis_url, prefix, queue, conf=conf, concurrency=1)
    workers.append(w)
    first = wait_for(lambda: _started(rclient, prefix), 30, what="the body to start")
    os.kill(int(first[0][1]), signal.SIGKILL)  # the pool child only; the worker requeues its message

    wait_for(lambda: h.job_state == "SUCCEEDED", 40, what="the redelivery to complete the job")
    assert "is running elsewhere" in w.output()  # it waited for the dead child's lease
    starts = _started(rclient, prefix)
    assert [j for j, _ in starts] == [h.id, h.id] and starts[0][1] != starts[1][1]
    assert ran(rclient, prefix) == [h.id]
    assert h.job()["att"] == "2"


def test_lease_keeper_beats_every_running_execution_until_stopped_or_lost(redis_url, uid):
    """One heartbeat thread keeps 20 leases of 1.5 s alive for 2 s, extending every one of them;
    stopped, they pass; a cancelled (terminated) job's keeper learns that its lease is lost."""
    lease_ms = 1500  # a beat every 500 ms: a second of headroom before a lease could pass
    app = make_app(redis_url, uid, delayed_exec_lease_ms=lease_ms)
    store = get_store(app)
    hs = apply_later_many(app, "e2e.mark", ({"args": (i,), "when": 0} for i in range(20)), strict=False)
    assert len(_release_all(app)) == 20
    keepers = []
    try:
        for h in hs:
            assert store.executions.start(h.id, h.shard, "me", "host").code == Reply.OK
            keepers.append(LeaseKeeper(store, Execution(h.id, h.shard, "me", 1)).start())

        def deadlines() -> tuple[int, list[int]]:
            """The Redis clock and every lease deadline, in one snapshot (MULTI)."""
            pipe = store.redis.client.pipeline(transaction=True)
            pipe.time()
            for h in hs:
                pipe.hget(store.keys.shard(h.shard).job(h.id), "lu")
            (sec, usec), *lus = pipe.execute()
            return int(sec) * 1000 + int(usec) // 1000, [int(lu or 0) for lu in lus]

        def live() -> int:
            now, lus = deadlines()
            return sum(lu > now for lu in lus)

        samples = []
        for _ in range(5):  # over 2 s, more than a lease long
            samples.append(deadlines())
            time.sleep(0.5)
        # The mechanism: every lease was extended (its deadline moved on, never beyond a lease from
        # the Redis clock), so none passed; more than a lease went by meanwhile.
        (first_now, first), (last_now, last) = samples[0], samples[-1]
        assert last_now - first_now > lease_ms
        assert all(f < lu <= last_now + lease_ms for f, lu in zip(first, last, strict=True)), (last_now, first, last)
        assert [sum(lu > now for lu in lus) for now, lus in samples] == [20] * 5
        store.jobs.cancel(hs[0].id, running=True)
        wait_for(lambda: keepers[0].lost, 2, what="the keeper to notice the lost lease")
    finally:
        for k in keepers:
            k.stop()
    wait_for(lambda: live() == 0, lease_ms / 1000 + 3, what="the leases to pass once stopped")
    assert not any(k.lost for k in keepers[1:])
