"""Drop-in fidelity (issue 16): with interception on, a task and its operators see what Celery shows them.

Real worker and scheduler processes: ``request.eta`` of a stored job, stamps
through a retry in the store, ``inspect scheduled`` answered from the store,
Celery's revoke cancelling a stored job durably, and every fallback to a
broker ETA message visible in ``delayed status``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery.canvas import StampingVisitor
from support import SchedulerProcess, WorkerProcess, make_app, run_celery, wait_for
from support.delivery import looked_ahead
from support.retry import QueueWatch, runs

import celery_delayed
from celery_delayed import DelayedResult, DelayedTask, apply_later, get_store
from celery_delayed.store import ShardStatus

pytestmark = pytest.mark.e2e

CONF: dict[str, Any] = {"imports": ["fidelity_tasks"], "delayed_intercept_eta": True}


def _stub(app: Any, name: str, base: Any = None) -> Any:
    opts = {"base": base} if base is not None else {}

    @app.task(name=name, bind=True, shared=False, **opts)
    def stub(self: Any, *args: Any, **kwargs: Any) -> None:  # the real body lives in the worker (fidelity_tasks.py)
        raise AssertionError("runs in the worker only")

    return stub


def _seen(rclient: Any, prefix: str) -> dict[str, list[dict[str, Any]]]:
    """What each run saw of its request (fidelity_tasks.seen), by task id."""
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for raw in rclient.lrange(f"{prefix}:seen", 0, -1):
        entry = json.loads(raw)
        out[entry["id"]].append(entry)
    return out


def _app(redis_url: str, uid: str, **conf: Any) -> Any:
    return celery_delayed.install(make_app(redis_url, uid, **{**CONF, **conf, "imports": []}))


@pytest.mark.timeout(120)
def test_a_task_sees_the_eta_it_was_scheduled_with(redis_url, uid, workers, rclient):
    conf = {**CONF, "delayed_intercept_min_delay_s": 0.5}
    app = _app(redis_url, uid, **conf)
    plain = _stub(app, "fd.plain")
    _stub(app, "fd.tracked", DelayedTask)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    store = get_store(app)
    workers.append(w := WorkerProcess(redis_url, prefix, queue, conf=conf, concurrency=2, pool="threads"))
    workers.append(SchedulerProcess(redis_url, prefix, queue, conf=conf))
    w.wait_ready()  # first: the lateness asserted below is the release's, not the worker's start-up
    now = datetime.now(timezone.utc)
    exact = (now + timedelta(seconds=3.2)).replace(microsecond=123457)
    exact2 = (now + timedelta(seconds=3.4)).replace(microsecond=654321)
    by_countdown = plain.apply_async(args=(1,), countdown=3)           # intercepted: stored
    by_eta = plain.apply_async(args=(2,), eta=exact)                      # intercepted: stored
    later = apply_later(app, "fd.tracked", (3,), when=exact2)             # a DelayedTask, apply_later
    moved = apply_later(app, "fd.tracked", (4,), when=3600)
    moved_due = moved.reschedule(timedelta(seconds=3))                  # the header follows the new due time
    short = plain.apply_async(args=(5,), countdown=0.2)                   # under the minimum: Celery's ETA message
    now_ = plain.apply_async(args=(6,))                                   # no delay: no eta
    assert all(isinstance(h, DelayedResult) for h in (by_countdown, by_eta, later, moved))
    stored = {h.id: json.loads(store.lookup.message(h.id, h.shard))["headers"]
              for h in (by_countdown, by_eta, later, moved)}
    assert all(hd["eta"] is None for hd in stored.values())  # no worker holds a stored job until then
    assert stored[by_eta.id]["delayed_eta"] == exact.isoformat()
    ids = [by_countdown.id, by_eta.id, later.id, moved.id, short.id, now_.id]
    wait_for(lambda: all(runs(rclient, prefix, i) for i in ids), 40, what="the six runs")
    seen = {k: v[0]["eta"] for k, v in _seen(rclient, prefix).items()}
    # Celery's eta for a countdown: the producer's clock + countdown (as the stored header has it)
    assert seen[by_countdown.id] == stored[by_countdown.id]["delayed_eta"]
    assert abs((datetime.fromisoformat(seen[by_countdown.id]) - by_countdown.eta).total_seconds()) < 1
    assert seen[by_eta.id] == exact.isoformat()
    assert seen[later.id] == exact2.isoformat()
    assert datetime.fromisoformat(seen[moved.id]) == moved_due  # rewritten by reschedule (Redis clock, ms)
    assert seen[short.id] is not None and "delayed_eta" not in stored.get(short.id, {})
    assert seen[now_.id] is None
    # an eta that has passed when the message arrives delays nothing
    for h in (by_countdown, by_eta, later):
        started = runs(rclient, prefix, h.id)[0][1]
        assert started - h.eta.timestamp() < 2.0, (h.id, started - h.eta.timestamp())


@pytest.mark.timeout(120)
def test_stamps_survive_a_retry_through_the_store(redis_url, uid, workers, rclient):
    """Celery's test_stamps_remain_on_task_retry, through the store (it used to fall back to the broker)."""
    conf = {**CONF, "delayed_intercept_min_delay_s": 0}
    app = _app(redis_url, uid, **conf)
    retry_once = _stub(app, "fd.retry_once")
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue

    class Stamper(StampingVisitor):  # type: ignore[misc]
        def on_signature(self, sig: Any, **headers: Any) -> dict[str, Any]:
            return {"stamp": 42}

    sig = retry_once.si(1.0)
    sig.stamp(visitor=Stamper())
    workers.append(w := WorkerProcess(redis_url, prefix, queue, conf=conf, concurrency=1, pool="solo"))
    workers.append(SchedulerProcess(redis_url, prefix, queue, conf=conf))
    w.wait_ready()
    res = sig.delay()
    watch = QueueWatch(rclient, queue, res.id)
    wait_for(lambda: len(runs(rclient, prefix, res.id)) >= 2, 30, what="the retried run")
    headers = watch.stop()
    first, second = _seen(rclient, prefix)[res.id]
    assert first["retries"] == 0 and second["retries"] == 1
    for run in (first, second):
        assert run["stamps"] == {"stamp": 42} and run["stamped_headers"] == ["stamp"]
    rec = get_store(app).lookup.get(res.id)
    assert rec["retries"] == "1"  # the retry went through the store ...
    # ... not as a broker ETA message: each came from the store (an eta only for a look-ahead release)
    assert all(looked_ahead(hd) for hd in headers), headers
    assert second["eta"] is not None  # and the retried task still sees its eta
    assert ShardStatus(get_store(app)).eta_fallbacks().count == 0
    assert "sent to the broker" not in w.output()


def test_every_fallback_to_a_broker_eta_message_is_counted(redis_url, uid, rclient, caplog):
    app = _app(redis_url, uid, delayed_max_payload_bytes=4096)
    plain = _stub(app, "fd.plain")
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    status = ShardStatus(get_store(app))
    assert status.eta_fallbacks().count == 0
    # what the store refuses but Celery sends: a message over delayed_max_payload_bytes
    with caplog.at_level("WARNING", logger="celery_delayed.intercept"):
        big = plain.apply_async(args=("x" * 8000,), countdown=60)
    assert not isinstance(big, DelayedResult)
    assert "fd.plain sent to the broker as an ETA message" in caplog.text and "PayloadTooLarge" in caplog.text
    [raw] = rclient.lrange(queue, 0, -1)
    assert json.loads(raw)["headers"]["eta"] is not None  # Celery's own ETA message
    got = status.eta_fallbacks()
    assert (got.count, got.last_task) == (1, "fd.plain") and got.last_reason.startswith("PayloadTooLarge")
    # positional publish arguments: Celery's, as before; counted on another shard (the fleet's sum)
    app.send_task("fd.plain", (1,), None, 60, None, "fixed-id-2", None)
    assert status.eta_fallbacks().count == 2
    # stamps and options Celery does not know are stored, not a fallback
    h = plain.apply_async(args=(1,), countdown=60, stamped_headers=["s"], s=1, x_custom="v")
    assert isinstance(h, DelayedResult)
    env = json.loads(get_store(app).lookup.message(h.id, h.shard))
    assert env["headers"]["stamps"] == {"s": 1} and env["properties"]["x_custom"] == "v"
    assert status.eta_fallbacks().count == 2
    # where an operator looks: delayed status
    out = run_celery(redis_url, prefix, queue, "delayed", "status", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["eta_fallbacks"]["count"] == 2
    text = run_celery(redis_url, prefix, queue, "delayed", "status").stdout
    assert "eta fallbacks: 2 delayed send(s) went to the broker as ETA messages" in text
