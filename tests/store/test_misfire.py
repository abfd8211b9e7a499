"""Misfire policy (max_lateness + misfire) and Celery's ``expires``, decided at release time."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from support import SchedulerProcess, WorkerProcess, make_app, ran, wait_for

from celery_delayed import ConfigurationError, DelayedTask, InvalidOption, apply_later, get_config, get_store
from celery_delayed.store import ShardStatus


def _release(app: Celery, now_ms: int | None = None) -> list[str]:
    store = get_store(app)
    return [jid for s in range(store.config.shards) for jid in store.release.release_due(s, now_ms=now_ms).ids]


def _claim(app: Celery, now_ms: int | None = None) -> list[str]:
    store = get_store(app)
    return [jid for s in range(store.config.shards) for jid in store.release.claim_due(s, now_ms=now_ms).ids]


def _key(app: Celery, h) -> str:
    return get_store(app).keys.shard(h.shard).job(h.id)


@pytest.mark.parametrize("mode", ["direct", "publish"])
def test_late_job_follows_its_misfire_policy(redis_url, uid, rclient, mode):
    app = make_app(redis_url, uid, delayed_release_mode=mode)
    store = get_store(app)
    handles = {p: apply_later(app, "e2e.mark", when=0, max_lateness=5, misfire=p, strict=False)
               for p in ("run", "skip", "dead")}
    late = max(h.due_ms for h in handles.values()) + 10_000  # released 10 s after the due time
    released = (_release if mode == "direct" else _claim)(app, now_ms=late)
    assert handles["run"].id in released
    assert handles["skip"].id not in released and handles["dead"].id not in released

    skip = handles["skip"].job()
    assert skip["st"] == "SKIPPED" and skip["reason"].startswith("misfire: released ")
    assert "max_lateness 5000 ms" in skip["reason"]
    assert 0 < rclient.pttl(_key(app, handles["skip"])) <= store.config.record_ttl_ms
    assert not rclient.hexists(_key(app, handles["skip"]), "msg")

    dead = handles["dead"].job()
    assert dead["st"] == "DEAD" and dead["etype"] == "Misfire" and dead["emsg"] == dead["reason"]
    assert rclient.hexists(_key(app, handles["dead"]), "msg")  # kept, so it can be requeued
    assert rclient.pttl(_key(app, handles["dead"])) == -1  # the dead-letter trim owns its lifetime
    assert rclient.zscore(store.keys.shard(handles["dead"].shard).dlq, handles["dead"].id) == late
    assert sum(r["pending"] for r in ShardStatus(store).rows()) == 0


def test_within_max_lateness_every_policy_sends(app):
    store = get_store(app)
    hs = [apply_later(app, "e2e.mark", when=0, max_lateness=5, misfire=p, strict=False) for p in ("skip", "dead")]
    # both due, the earlier one 4,999 ms late: still within max_lateness (5 s)
    assert sorted(_release(app, now_ms=min(h.due_ms for h in hs) + 4_999)) == sorted(h.id for h in hs)
    assert {h.job_state for h in hs} == {"QUEUED"}
    assert store.lookup.get(hs[0].id).get("ml") == "5000"


@pytest.mark.parametrize("mode", ["direct", "publish"])
def test_expired_job_is_not_sent(redis_url, uid, rclient, mode):
    app = make_app(redis_url, uid, delayed_release_mode=mode)
    now = get_store(app).redis.now_ms()
    soon = apply_later(app, "e2e.mark", when=0, expires=2, strict=False)
    at = apply_later(app, "e2e.mark", when=0, strict=False,
                     expires=datetime.now(timezone.utc) + timedelta(seconds=2))
    later = apply_later(app, "e2e.mark", when=0, expires=60, strict=False)
    released = (_release if mode == "direct" else _claim)(app, now_ms=now + 5_000)
    assert released == [later.id]
    for h in (soon, at):
        rec = h.job()
        assert rec["st"] == "EXPIRED" and rec["reason"].startswith("expired: expires ")
        assert not rclient.hexists(_key(app, h), "msg")
    assert rclient.llen(app.conf.task_default_queue) == (1 if mode == "direct" else 0)


def test_precedence_call_option_then_task_attribute_then_setting(redis_url, uid):
    app = make_app(redis_url, uid, delayed_misfire="dead", delayed_max_lateness_s=1.5)

    @app.task(base=DelayedTask, name=f"t{uid}.strict", max_lateness=7, misfire="skip")
    def strict() -> None: ...

    @app.task(base=DelayedTask, name=f"t{uid}.loose")
    def loose() -> None: ...

    def fields(h) -> tuple[str | None, str | None]:
        rec = h.job()
        return rec.get("ml"), rec.get("mf")

    assert fields(strict.apply_later(when=60)) == ("7000", "skip")  # task attribute
    assert fields(strict.apply_later(when=60, max_lateness=2, misfire="dead")) == ("2000", "dead")  # call
    assert fields(loose.apply_later(when=60)) == ("1500", "dead")  # app setting
    assert fields(loose.apply_later(when=60, misfire="run")) == (None, None)  # "run": nothing to check
    assert get_config(app).misfire == "dead"


def test_bad_misfire_input_is_refused_and_writes_nothing(redis_url, uid, app):
    with pytest.raises(InvalidOption, match=r"misfire must be one of \('run', 'skip', 'dead'\)"):
        apply_later(app, "e2e.mark", when=0, misfire="later", strict=False)
    with pytest.raises(InvalidOption, match="max_lateness must be a number of seconds"):
        apply_later(app, "e2e.mark", when=0, max_lateness=-1, misfire="skip", strict=False)
    with pytest.raises(InvalidOption, match="expires must be seconds from now or a datetime"):
        apply_later(app, "e2e.mark", when=0, expires="soon", strict=False)
    with pytest.raises(InvalidOption, match=r"misfire='skip' needs max_lateness"):
        apply_later(app, "e2e.mark", when=0, misfire="skip", strict=False)
    with pytest.raises(InvalidOption, match="max_lateness has no effect with misfire='run'"):
        apply_later(app, "e2e.mark", when=0, max_lateness=5, strict=False)
    assert sum(r["pending"] for r in ShardStatus(get_store(app)).rows()) == 0
    with pytest.raises(ConfigurationError, match="delayed_misfire"):
        get_config(make_app(redis_url, uid + "x", delayed_misfire="never"))


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_scheduler_and_worker_run_only_the_job_within_its_lateness(redis_url, uid, rclient, workers):
    """Jobs whose due time passed 30 s ago (the schedulers were down): only misfire="run" runs."""
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    past = datetime.now(timezone.utc) - timedelta(seconds=30)
    run = apply_later(app, "e2e.mark", when=past, max_lateness=5, misfire="run", strict=False)
    skip = apply_later(app, "e2e.mark", when=past, max_lateness=5, misfire="skip", strict=False)
    dead = apply_later(app, "e2e.mark", when=past, max_lateness=5, misfire="dead", strict=False)
    fresh = apply_later(app, "e2e.mark", when=0, max_lateness=5, misfire="skip", strict=False)
    workers.append(SchedulerProcess(redis_url, prefix, queue))
    workers.append(WorkerProcess(redis_url, prefix, queue, concurrency=1))
    wait_for(lambda: len(ran(rclient, prefix)) >= 2, 40, what="the two sendable jobs to run")
    wait_for(lambda: skip.job_state == "SKIPPED" and dead.job_state == "DEAD", 10, what="the misfires")
    assert sorted(ran(rclient, prefix)) == sorted([run.id, fresh.id])


def test_misfire_dead_letters_are_bounded_by_the_dlq_trim(redis_url, uid, rclient):
    app = make_app(redis_url, uid, delayed_shards=2, delayed_dlq_max_len=6)  # 3 per shard
    store = get_store(app)
    hs = [apply_later(app, "e2e.mark", when=0, max_lateness=1, misfire="dead", shard_key="one", strict=False)
          for _ in range(5)]
    _release(app, now_ms=max(h.due_ms for h in hs) + 5_000)
    dlq = store.keys.shard(hs[0].shard).dlq
    assert rclient.zcard(dlq) == 3
    kept = set(rclient.zrange(dlq, 0, -1))
    for h in hs:  # the trimmed ones are deleted, not left behind
        assert rclient.exists(_key(app, h)) == (h.id in kept)


def test_misfire_dead_letter_is_listed_and_requeued_by_the_dlq_api(app):
    from celery_delayed import dlq

    h = apply_later(app, "e2e.mark", (1,), when=0, max_lateness=1, misfire="dead", strict=False)
    _release(app, now_ms=h.due_ms + 5_000)
    [letter] = dlq.list_dead(app)
    assert letter.id == h.id and letter.error.startswith("Misfire: misfire: released 5000 ms late")
    dlq.requeue(app, h.id)
    assert h.job_state == "SCHEDULED"
    assert _release(app) == [h.id]  # requeued "now": within its max_lateness again
