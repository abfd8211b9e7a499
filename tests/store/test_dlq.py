"""The dead-letter queue: dead.lua trimming, requeue, purge, the API and CLI, and real workers."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from support import SchedulerProcess, WorkerProcess, make_app, run_celery, wait_for

from celery_delayed import InvalidState, JobNotFound, apply_later, dlq, get_store
from celery_delayed.store import Pending
from celery_delayed.vocab import Reply


def _dead(store: Any, job_id: str, now_ms: int, shard: int = 0, **fields: str) -> tuple[int, str, int]:
    """Run dead.lua for a QUEUED job; return (code, previous state, letters trimmed)."""
    jk = store.keys.shard(shard).job(job_id)
    store.redis.client.hset(jk, mapping={"st": "QUEUED"})
    base = {"task": "t.x", "msg": "M", "etype": "app.Boom", "emsg": "boom", "tb": "Traceback ...",
            "attempts": "3", "host": "w1"}
    out = store.executions.dead(job_id, shard, base | fields, now_ms=now_ms)
    return out.code, out.state, out.dropped


def test_dead_letters_are_bounded_by_age_and_count(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=1, delayed_dlq_max_len=3, delayed_dlq_max_age_s=60)
    store = get_store(app)
    sk = store.keys.shard(0)
    for i in range(5):
        assert _dead(store, f"j{i}", 1_000_000 + i * 20_000)[0] == 1  # one death every 20 s
    # count: the 3 most recent stay, the records of the others are gone
    assert store.redis.client.zrange(sk.dlq, 0, -1) == ["j2", "j3", "j4"]
    assert not store.redis.client.exists(sk.job("j0")) and not store.redis.client.exists(sk.job("j1"))
    # age: a death at +105 s drops what died more than 60 s before it (j2, at +40 s)
    assert _dead(store, "late", 1_000_000 + 105_000)[2] == 1
    assert store.redis.client.zrange(sk.dlq, 0, -1) == ["j3", "j4", "late"]
    rec = store.lookup.get("late")
    assert rec["st"] == "DEAD" and rec["died"] == str(1_105_000) and store.redis.client.pttl(sk.job("late")) == -1


def test_dead_refuses_a_job_with_a_pending_retry(app):
    store = get_store(app)
    h = apply_later(app, "x.task", when=60, strict=False)
    out = store.executions.dead(h.id, h.shard, {"etype": "E"})
    assert (out.code, out.state) == (Reply.WRONG_STATE, "SCHEDULED")


@pytest.mark.parametrize("bucket_ms", [0, 60_000])
def test_list_show_requeue_purge(redis_url, uid, bucket_ms):
    app = make_app(redis_url, uid, delayed_shards=4, delayed_bucket_ms=bucket_ms)
    store = get_store(app)
    now = store.redis.now_ms()
    ids = [f"d{i}" for i in range(6)]
    for i, jid in enumerate(ids):
        _dead(store, jid, now - 10_000 + i, shard=i % 4, task="t.a" if i % 2 else "t.b")
    assert dlq.count(app) == 6
    listed = dlq.list_dead(app)
    assert [d.id for d in listed] == ids[::-1]  # most recent first, over all shards
    assert listed[0].error == "app.Boom: boom" and listed[0].attempts == 3 and listed[0].host == "w1"
    assert [d.id for d in dlq.list_dead(app, offset=1, limit=2)] == ["d4", "d3"]
    assert [d.id for d in dlq.list_dead(app, task="t.a")] == ["d5", "d3", "d1"]
    rec = dlq.show(app, "d2")
    assert rec["tb"] == "Traceback ..." and rec["etype"] == "app.Boom"
    with pytest.raises(JobNotFound):
        dlq.show(app, "nope")
    # requeue one: SCHEDULED again, attempt counter reset, out of the DLQ
    due = dlq.requeue(app, "d2", when=30)
    rec = store.lookup.get("d2")
    assert rec["st"] == "SCHEDULED" and rec["retries"] == "0" and rec["requeued"] == "1"
    assert "etype" not in rec and "attempts" not in rec and int(rec["due"]) == due
    assert [(p["id"], int(p["due"])) for p in Pending(store).page()] == [("d2", due)]
    with pytest.raises(InvalidState, match="SCHEDULED"):
        dlq.requeue(app, "d2")
    # requeue --all of one task
    assert dlq.requeue_all(app, when=60, task="t.a") == 3
    assert sorted(d.id for d in dlq.list_dead(app)) == ["d0", "d4"]
    # purge by age: nothing died more than 20 s ago; everything died more than 5 s ago
    assert dlq.purge(app, older_than=20) == 0
    assert dlq.purge(app, older_than=5) == 2
    assert dlq.count(app) == 0 and not store.redis.client.exists(store.keys.shard(0).job("d0"))
    assert store.lookup.get("d1")["st"] == "SCHEDULED"  # requeued letters are not purged


def _cli(redis_url: str, prefix: str, queue: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_celery(redis_url, prefix, queue, "delayed", "dlq", *args, timeout=60)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_dead_letter_after_max_attempts_then_cli_requeue(redis_url, uid, workers, rclient):
    dlq_queue = f"q{uid}-dead"
    conf = {"imports": ["retry_tasks"], "delayed_backoff": "fixed", "delayed_backoff_base_s": 0.2,
            "delayed_dlq_queue": dlq_queue, "delayed_dlq_task": "rt.dead_letter_sink"}
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, conf=conf, concurrency=1, pool="solo",
                      queues=[queue, dlq_queue])
    workers.append(w)
    workers.append(SchedulerProcess(redis_url, prefix, queue, conf=conf))
    w.wait_ready()
    h = apply_later(app, "rt.doomed", args=(42,), kwargs={"note": "vip"}, when=0, strict=False)
    wait_for(lambda: dlq.count(app) == 1, 30, what="the dead letter")
    rec = dlq.show(app, h.id)
    assert rec["st"] == "DEAD" and rec["attempts"] == "2" and rec["task"] == "rt.doomed"
    assert rec["etype"] == "retry_tasks.Flaky" and rec["emsg"] == "order 42 cannot be processed"
    assert "Traceback" in rec["tb"] and "order 42 cannot be processed" in rec["tb"]
    assert rec["args"] == "(42,)" or rec["args"] == "[42]"
    assert "vip" in rec["kwargs"] and rec["host"] == w.name
    assert int(rec["first_at"]) < int(rec["last_at"]) <= int(rec["died"])
    assert "dead-lettered after 2 attempt(s)" in w.output()
    assert "not dead-lettered" not in w.output()  # dead-lettered once, not again by the failure handler
    # the optional notification reached the dead-letter queue's consumer
    wait_for(lambda: f"dlq:{h.id}" in [str(x).split("|")[0] for x in rclient.lrange(f"{prefix}:ran", 0, -1)],
             20, what="the dead-letter notification")
    # CLI: list, show, requeue; the requeued job runs again from attempt 1 (retries 0)
    out = _cli(redis_url, prefix, queue, "list", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["id"] == h.id
    out = _cli(redis_url, prefix, queue, "show", h.id)
    assert out.returncode == 0 and "order 42 cannot be processed" in out.stdout
    before = len([x for x in rclient.lrange(f"{prefix}:ran", 0, -1) if str(x).startswith(h.id)])
    out = _cli(redis_url, prefix, queue, "requeue", h.id, "--when", "0")
    assert out.returncode == 0 and "requeued" in out.stdout, out.stderr
    wait_for(lambda: dlq.count(app) == 1 and dlq.show(app, h.id).get("requeued") == "1", 30,
             what="the requeued job to die again")
    runs = [str(x).split("|") for x in rclient.lrange(f"{prefix}:ran", 0, -1) if str(x).startswith(h.id)]
    assert [int(r[2]) for r in runs] == [0, 1, 0, 1] and before == 2
    out = _cli(redis_url, prefix, queue, "purge", "--older-than", "3600")
    assert out.returncode == 0 and "purged 0" in out.stdout
    out = _cli(redis_url, prefix, queue, "purge", "--yes")
    assert out.returncode == 0 and "purged 1" in out.stdout
    assert _cli(redis_url, prefix, queue, "show", h.id).returncode != 0
