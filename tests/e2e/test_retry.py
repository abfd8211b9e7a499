"""Retries through the store: retry.lua on a real Redis, and real workers retrying with backoff."""

from __future__ import annotations

import collections
import contextlib
import math
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import Ignore, Retry
from support import SchedulerProcess, WorkerProcess, make_app, wait_for
from support.delivery import looked_ahead
from support.retry import QueueWatch, runs

from celery_delayed import DelayedTask, apply_later, dlq, get_store
from celery_delayed.errors import ConfigurationError, InvalidOption, InvalidWhen
from celery_delayed.store.loader import scripts
from celery_delayed.testing import DelayedTestKit
from celery_delayed.vocab import DELAY_HEADER, Reply
from celery_delayed.worker import intercept
from celery_delayed.worker.backoff import Backoff, rng_for

SEED = 20261130


def _job(store: Any, job_id: str) -> dict[str, str]:
    return store.lookup.get(job_id)


# -- retry.lua ------------------------------------------------------------------


def test_retry_script_reschedules_a_released_job(app, rclient):
    store = get_store(app)
    h = apply_later(app, "x.task", args=(1,), when=0, strict=False)
    batch = store.release.release_due(h.shard, now_ms=store.redis.now_ms() + 10)
    assert batch.ids == [h.id]
    assert rclient.pttl(store.keys.shard(h.shard).job(h.id)) > 0
    out = store.executions.retry(h.id, h.shard, "+5000", 1, {"msg": "M", "etype": "E"}, now_ms=1000)
    assert (out.code, out.state, out.due_ms) == (Reply.OK, "QUEUED", 6000)
    rec = _job(store, h.id)
    assert rec["st"] == "SCHEDULED" and rec["retries"] == "1" and rec["due"] == "6000" and rec["etype"] == "E"
    assert rclient.pttl(store.keys.shard(h.shard).job(h.id)) == -1  # no longer expiring
    assert rclient.zscore(store.keys.shard(h.shard).due, h.id) == 6000
    # a second retry of the same attempt (duplicate delivery) changes nothing
    assert store.executions.retry(h.id, h.shard, "+1", 1, {"msg": "N"}, now_ms=2000).code == Reply.UNCHANGED == 2
    assert rclient.hget(store.keys.shard(h.shard).job(h.id), "msg") == "M"


def test_retry_script_refuses_cancelled_and_foreign_lease(app, rclient):
    store = get_store(app)
    h = apply_later(app, "x.task", when=60, strict=False)
    store.jobs.cancel(h.id)
    out = store.executions.retry(h.id, h.shard, "+1", 1, {"msg": "M"})
    assert (out.code, out.state) == (Reply.WRONG_STATE, "CANCELLED")
    jk = store.keys.shard(h.shard).job("running-1")
    rclient.hset(jk, mapping={"st": "RUNNING", "lo": "owner-a", "lu": "1"})
    assert store.executions.retry("running-1", h.shard, "+1", 1, {"msg": "M"}, owner="owner-b").code == Reply.NOT_OWNER
    assert store.executions.retry("running-1", h.shard, "+1", 1, {"msg": "M"}, owner="owner-a").code == Reply.OK
    assert rclient.hmget(jk, "st", "lo", "lu") == ["SCHEDULED", None, None]


def test_retry_script_creates_a_missing_record_and_fail_marks_failed(app, rclient):
    store = get_store(app)
    out = store.executions.retry("fresh", 0, "+100", 2, {"msg": "M", "task": "t"})
    assert (out.code, out.state) == (Reply.OK, "")
    rec = _job(store, "fresh")
    assert rec["st"] == "SCHEDULED" and rec["retries"] == "2" and "created" in rec
    assert store.executions.fail("fresh", 0, {"etype": "E"}).code == Reply.WRONG_STATE  # a retry is pending
    jk = store.keys.shard(0).job("gone-wrong")
    rclient.hset(jk, mapping={"st": "QUEUED", "msg": "M"})
    out = store.executions.fail("gone-wrong", 0, {"etype": "KeyError", "emsg": "x"})
    assert (out.code, out.state) == (Reply.OK, "QUEUED")
    assert rclient.hmget(jk, "st", "etype", "msg") == ["FAILED", "KeyError", None]
    assert rclient.pttl(jk) > 0


# -- real workers ------------------------------------------------------------------


def _start(redis_url: str, uid: str, workers: list[Any], **conf: Any) -> tuple[Any, str, str]:
    conf = {"imports": ["retry_tasks"], **conf}
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, conf=conf, concurrency=1, pool="solo")
    workers.append(w)
    workers.append(SchedulerProcess(redis_url, prefix, queue, conf=conf))
    w.wait_ready()
    return app, prefix, queue


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_fails_twice_then_succeeds_with_the_documented_delays(redis_url, uid, workers, rclient):
    conf = {"delayed_backoff": "equal", "delayed_backoff_base_s": 1.0, "delayed_backoff_seed": SEED}
    app, prefix, queue = _start(redis_url, uid, workers, **conf)
    h = apply_later(app, "rt.flaky", args=(2,), when=0.3, strict=False)
    watch = QueueWatch(rclient, queue, h.id)
    wait_for(lambda: len(runs(rclient, prefix, h.id)) >= 3, 30, what="three runs")
    time.sleep(0.3)
    seen = watch.stop()
    got = runs(rclient, prefix, h.id)
    assert [r for r, _ in got] == [0, 1, 2], got  # the retries header of each attempt
    # The documented delays: equal jitter, base 1 s, factor 2, seeded per job and retry.
    policy = Backoff("equal", 1.0, 2.0, 600.0)
    expected = [policy.delay(n, rng=rng_for(SEED, h.id, n)) for n in (1, 2)]
    gaps = [got[1][1] - got[0][1], got[2][1] - got[1][1]]
    print(f"expected delays {expected}, observed gaps {gaps}")
    # The mechanism, exactly: each retry's message carries the delay the policy chose for it
    # (ms, rounded up), and the store released it no earlier than that; the upper bound is
    # wall-clock slack for a loaded 2-core machine (release, fetch and start of the next run).
    delays = {hd["retries"]: hd.get(DELAY_HEADER) for hd in seen}
    assert delays == {0: None, 1: math.ceil(expected[0] * 1000), 2: math.ceil(expected[1] * 1000)}, seen
    for want, gap in zip(expected, gaps, strict=True):
        assert want <= gap <= want + 2.0, (expected, gaps)
    # Every message of this job that appeared in the queue came from the store (an eta
    # only when released ahead of its due time: look-ahead) and carried its attempt in
    # the retries header.
    assert sorted(hd["retries"] for hd in seen) == [0, 1, 2], seen
    assert all(looked_ahead(hd) for hd in seen), seen
    rec = get_store(app).lookup.get(h.id)
    assert rec["retries"] == "2" and rec["etype"].endswith("Flaky")


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_retry_later_countdown_and_a_final_failure(redis_url, uid, workers, rclient):
    app, prefix, _queue = _start(redis_url, uid, workers)
    store = get_store(app)
    manual = apply_later(app, "rt.manual", args=(1, 0.8), when=0, strict=False)
    broken = apply_later(app, "rt.broken", when=0, strict=False)
    wait_for(lambda: len(runs(rclient, prefix, manual.id)) >= 2, 30, what="the manual retry")
    got = runs(rclient, prefix, manual.id)
    assert [r for r, _ in got] == [0, 1]
    assert 0.8 <= got[1][1] - got[0][1] <= 0.8 + 2.0  # never early; slack for a loaded machine
    assert store.lookup.get(manual.id)["etype"] == "builtins.ConnectionError"
    # KeyError is not in autoretry_for: one run, FAILED, not dead-lettered
    wait_for(lambda: store.lookup.get(broken.id).get("st") == "FAILED", 20, what="FAILED")
    rec = store.lookup.get(broken.id)
    assert rec["etype"] == "builtins.KeyError" and "not retryable" in rec["emsg"] and "KeyError" in rec["tb"]
    assert len(runs(rclient, prefix, broken.id)) == 1
    assert rclient.zcard(store.keys.shard(int(rec["shard"])).dlq) == 0


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_retries_on_the_publish_path_with_rabbitmq(rabbitmq_url, redis_url, uid, workers, rclient):
    """RabbitMQ broker, Redis store: the retry is stored, claimed and published by the scheduler."""
    conf = {"imports": ["retry_tasks"], "delayed_backoff": "fixed", "delayed_backoff_base_s": 0.5}
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    store = get_store(app)
    assert not store.broker.direct
    w = WorkerProcess(rabbitmq_url, prefix, queue, store=redis_url, conf=conf, concurrency=1, pool="solo")
    workers.append(w)
    workers.append(SchedulerProcess(rabbitmq_url, prefix, queue, store=redis_url, conf=conf))
    w.wait_ready()
    h = apply_later(app, "rt.flaky", args=(1,), when=0, strict=False)
    wait_for(lambda: len(runs(rclient, prefix, h.id)) >= 2, 30, what="two runs")
    got = runs(rclient, prefix, h.id)
    assert [r for r, _ in got] == [0, 1]
    assert got[1][1] - got[0][1] >= 0.5
    wait_for(lambda: store.lookup.get(h.id)["st"] == "SUCCEEDED", 10, what="SUCCEEDED")
    rec = store.lookup.get(h.id)
    assert rec["retries"] == "1" and "lk" not in rec  # published by kombu, not pushed by Lua


# -- the failure decision, in process (a pushed worker request, the real store) ----


class Boom(ValueError):
    pass


def _running(app: Any, retries: int = 0, **attrs: Any) -> tuple[Any, Any]:
    """A DelayedTask with a pushed worker request for a released job at attempt ``retries + 1``."""
    name = f"t.decide.{len(app.tasks)}"

    def body(self: Any) -> None:
        return None

    task = app.task(base=DelayedTask, bind=True, name=name, shared=False, **attrs)(body)
    store = get_store(app)
    h = apply_later(app, name, when=0)
    store.release.release_due(h.shard, now_ms=store.redis.now_ms() + 10)
    task.push_request(id=h.id, called_directly=False, is_eager=False, retries=retries, hostname="w@test",
                      args=(), kwargs={}, delivery_info={"exchange": "", "routing_key": app.conf.task_default_queue},
                      delayed_shard=h.shard)
    return task, h


def _decide(app: Any, exc: BaseException, retries: int = 0, **attrs: Any) -> tuple[str, dict[str, str]]:
    """Run delayed_handle_failure for a released job at attempt ``retries + 1``; return (outcome, record).

    The outcome: "retry" (it raised Retry), the script that ended the attempt ("dead", "fail"), or
    "none" (not a failure it ends).
    """
    task, h = _running(app, retries, **attrs)
    store = get_store(app)
    try:
        ended = task.delayed_handle_failure(exc, None)
        outcome = "none" if ended is None else ended.by.value
    except Retry:
        outcome = "retry"
    finally:
        task.pop_request()
    return outcome, store.lookup.get(h.id)


def test_failure_decision(app):
    out, rec = _decide(app, Boom("x"), autoretry_for=(Boom,), max_attempts=3)
    assert out == "retry" and rec["st"] == "SCHEDULED" and rec["retries"] == "1"
    out, rec = _decide(app, Boom("x"), retries=2, autoretry_for=(Boom,), max_attempts=3)
    assert out == "dead" and rec["st"] == "DEAD" and rec["attempts"] == "3"
    out, rec = _decide(app, KeyError("k"), autoretry_for=(Boom,))
    assert out == "fail" and rec["st"] == "FAILED" and rec["etype"] == "builtins.KeyError"
    out, rec = _decide(app, KeyError("k"), dlq_all_failures=True)
    assert out == "dead" and rec["st"] == "DEAD"
    out, rec = _decide(app, Boom("x"), autoretry_for=(ValueError,), dont_autoretry_for=(Boom,))
    assert out == "fail" and rec["st"] == "FAILED"
    out, rec = _decide(app, Ignore())
    assert out == "none" and rec["st"] == "QUEUED"  # not a failure


def _push(app: Any, task: Any, h: Any, retries: int) -> None:
    """Push a worker request for job ``h`` at attempt ``retries + 1``."""
    task.push_request(id=h.id, called_directly=False, is_eager=False, retries=retries, hostname="w@test",
                      args=(), kwargs={}, delivery_info={"exchange": "", "routing_key": app.conf.task_default_queue},
                      delayed_shard=h.shard)


def test_celery_retry_with_max_retries_goes_through_the_store(app):
    """``self.retry(max_retries=N)`` means ``max_attempts = N + 1``: attempt 1 of a job with
    max_retries=1 is retried through the store (not as an ETA message), attempt 2 is dead-lettered."""
    store = get_store(app)
    task, h = _running(app, 0)
    try:
        with pytest.raises(Retry) as info:
            task.retry(exc=Boom("first"), max_retries=1, countdown=5)
    finally:
        task.pop_request()
    rec = store.lookup.get(h.id)
    assert (rec["st"], rec["retries"], rec["delay"], rec["etype"]) == ("SCHEDULED", "1", "5000", "test_retry.Boom")
    assert int(rec["due"]) == int(info.value.when.timestamp() * 1000)
    assert store.release.release_due(h.shard, now_ms=int(rec["due"])).ids == [h.id]  # the next attempt, released
    _push(app, task, h, 1)
    try:
        with pytest.raises(Boom, match="second"):
            task.retry(exc=Boom("second"), max_retries=1, countdown=5)
    finally:
        task.pop_request()
    rec = store.lookup.get(h.id)
    assert (rec["st"], rec["attempts"], rec["emsg"]) == ("DEAD", "2", "second")
    assert dlq.count(app) == 1
    # Without a countdown the delay is the backoff policy's, not Celery's default_retry_delay (180 s).
    task, h = _running(app, 0)
    try:
        with pytest.raises(Retry):
            task.retry(exc=Boom("x"), max_retries=3)
    finally:
        task.pop_request()
    assert 0 <= int(store.lookup.get(h.id)["delay"]) <= 1000  # exponential, full jitter, base 1 s


def test_backoff_factor_and_cap_settings(redis_url, uid):
    """Non-default ``delayed_backoff_factor`` and ``delayed_backoff_cap_s``: each retry's delay is the
    policy's (seeded), grows by the factor and stops at the cap."""
    seed = 7
    app = make_app(redis_url, uid, delayed_backoff="equal", delayed_backoff_base_s=0.5, delayed_backoff_factor=3.0,
                   delayed_backoff_cap_s=2.0, delayed_backoff_seed=seed, delayed_max_attempts=10)
    policy = Backoff("equal", 0.5, 3.0, 2.0)
    got = []
    for retry in (1, 2, 3, 4):
        out, rec = _decide(app, Boom("x"), retries=retry - 1, autoretry_for=(Boom,))
        assert out == "retry" and rec["retries"] == str(retry)
        want = policy.delay(retry, rng=rng_for(seed, rec["id"], retry))
        assert int(rec["delay"]) == math.ceil(want * 1000)
        got.append(int(rec["delay"]))
    # equal jitter: between half and all of base * factor ** (retry - 1), capped
    assert 250 <= got[0] <= 500 and 750 <= got[1] <= 1500  # the default factor 2 would give 500 .. 1000
    assert 1000 <= got[2] <= 2000 and 1000 <= got[3] <= 2000  # capped at 2 s (uncapped: 2.25 .. 4.5 s)


def test_dlq_all_failures_setting(redis_url, uid):
    app = make_app(redis_url, uid, delayed_dlq_all_failures=True)
    out, rec = _decide(app, KeyError("k"))  # not retryable: dead-lettered, not FAILED
    assert out == "dead" and rec["st"] == "DEAD" and rec["etype"] == "builtins.KeyError"
    assert dlq.count(app) == 1
    out, rec = _decide(app, KeyError("k"), dlq_all_failures=False)  # the task attribute wins
    assert out == "fail" and rec["st"] == "FAILED"


@pytest.mark.parametrize(("call", "error"), [
    ({"countdown": -1}, InvalidWhen), ({"bogus": 1}, InvalidOption), ({"backoff": "linear"}, ConfigurationError),
    ({"max_attempts": 0}, ConfigurationError),
])
def test_retry_later_bad_input_writes_nothing(app, call, error):
    task, h = _running(app)
    try:
        before = get_store(app).lookup.get(h.id)
        with pytest.raises(error):
            task.retry_later(exc=Boom("x"), **call)
        assert get_store(app).lookup.get(h.id) == before
    finally:
        task.pop_request()


# -- one store call ends each attempt (run in process as a worker runs it, counted on the server) --


_WORKER_SCRIPTS = ("start", "extend_lease", "finish", "retry", "dead", "fail")


@contextlib.contextmanager
def _worker_scripts(redis_url: str, prefix: str) -> Iterator[dict[str, list[str]]]:
    """The worker-side scripts the server runs for each job of ``prefix``, in order (its MONITOR)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    names = {}
    for flags in (False, True):
        for script in scripts(flags).all():
            client.script_load(script.source)  # loaded now: no NOSCRIPT retry in the count
            if script.name in _WORKER_SCRIPTS:
                names[script.sha] = script.name
    seen: dict[str, list[str]] = collections.defaultdict(list)
    job = re.compile(r"\S*:job:(\S+)")
    ready, done = threading.Event(), threading.Event()

    def listen() -> None:
        with client.monitor() as m:
            for cmd in m.listen():
                words = cmd["command"].split(" ")
                if words[:2] == ["ECHO", f"{prefix}-start"]:
                    ready.set()
                elif words[:2] == ["ECHO", f"{prefix}-end"]:
                    break
                elif words[0] == "EVALSHA" and words[1] in names and prefix in cmd["command"]:
                    hit = job.search(cmd["command"])
                    if hit:
                        seen[hit.group(1)].append(names[words[1]])
        done.set()

    threading.Thread(target=listen, daemon=True).start()
    wait_for(lambda: client.echo(f"{prefix}-start") and ready.wait(0.2), 10, what="the MONITOR")
    try:
        yield seen
    finally:
        client.echo(f"{prefix}-end")
        assert done.wait(10), "the MONITOR did not end"
        client.close()


@pytest.mark.timeout(30)
def test_each_attempt_ends_with_one_store_call(redis_url):
    """A failed attempt ends with one of retry.lua, dead.lua or fail.lua and no finish.lua after it
    (those give the execution lease back: a finish could only be refused); a success, or a plain
    task's failure, with one finish.lua. Jobs run through Celery's tracer as a worker runs them
    (the test kit), their scripts counted by the server."""
    app = Celery("ends", broker="memory://", set_as_current=False)
    app.conf.update(delayed_backoff="fixed", delayed_backoff_base_s=1.0, delayed_intercept_eta=True)

    @app.task(base=DelayedTask, bind=True, name="ends.flaky", autoretry_for=(Boom,), max_attempts=2, shared=False)
    def flaky(self: Any, fails: int) -> str:
        if self.request.retries < fails:
            raise Boom("flaky")
        return "ok"

    @app.task(base=DelayedTask, bind=True, name="ends.broken", autoretry_for=(Boom,), shared=False)
    def broken(self: Any) -> None:
        raise KeyError("not retryable")

    @app.task(base=DelayedTask, bind=True, name="ends.manual", max_attempts=1, shared=False)
    def manual(self: Any) -> None:
        try:
            raise ConnectionError("busy")
        except ConnectionError as exc:
            self.retry_later(exc=exc)  # on its last attempt: dead-lettered, ConnectionError raised

    @app.task(bind=True, name="ends.plain", shared=False)
    def plain(self: Any, fail: bool) -> str:
        if not self.request.retries:
            if fail:
                raise KeyError("plain")
            raise self.retry(countdown=5)  # intercepted: retry.lua on the job's record
        return "ok"

    intercept.install(app)
    with DelayedTestKit(app, redis_url) as kit:
        with _worker_scripts(redis_url, kit.store.config.key_prefix) as seen:
            cases = {
                "retried": (apply_later(app, "ends.flaky", (1,)), ["RETRY", "SUCCESS"], "SUCCEEDED"),
                "dead": (apply_later(app, "ends.flaky", (5,)), ["RETRY", "FAILURE"], "DEAD"),
                "failed": (apply_later(app, "ends.broken"), ["FAILURE"], "FAILED"),
                "retry on the last attempt": (apply_later(app, "ends.manual"), ["FAILURE"], "DEAD"),
                "plain, failed": (apply_later(app, "ends.plain", (True,)), ["FAILURE"], "FAILED"),
                "plain, retried": (apply_later(app, "ends.plain", (False,)), ["RETRY", "SUCCESS"], "SUCCEEDED"),
            }
            ran = kit.run_due()
            kit.clock.advance(seconds=10)
            ran += kit.run_due()
        want = {
            "retried": ["start", "retry", "start", "finish"],
            "dead": ["start", "retry", "start", "dead"],
            "failed": ["start", "fail"],
            "retry on the last attempt": ["start", "dead"],
            "plain, failed": ["start", "finish"],
            "plain, retried": ["start", "retry", "start", "finish"],
        }
        assert {case: seen[h.id] for case, (h, _, _) in cases.items()} == want
        for case, (h, celery_states, final) in cases.items():
            assert [r.state for r in ran if r.id == h.id] == celery_states, case
            assert kit.job_state(h.id) == final, case
        assert kit.store.lookup.get(cases["retried"][0].id)["retries"] == "1"
