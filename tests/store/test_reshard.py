"""``delayed reshard``: a live store moves to another shard count, every key kept by shard with it.

Real Redis; the moves are the scripts ``move_out.lua`` / ``move_in.lua`` (one shard each).
"""

from __future__ import annotations

import json

import pytest
from celery import Celery
from support import make_app, run_celery

from celery_delayed import (
    ConfigurationError,
    DuplicateJob,
    InvalidOption,
    apply_later,
    cancel,
    dlq,
    get_store,
    lookup,
    schedules,
)
from celery_delayed.reconciler import Reconciler
from celery_delayed.store import Pending, shard_for
from celery_delayed.store.reshard import Resharder
from celery_delayed.store.stats import FleetStats
from celery_delayed.vocab import SHARD_HEADER

pytestmark = pytest.mark.timeout(90)


def _home(job_id: str, shard_key: str | None, n: int) -> int:
    return shard_for(shard_key or job_id, n)


def _job_keys(rclient, prefix: str) -> dict[str, int]:
    """Every job record of the store: id -> the shard it is in."""
    out = {}
    for key in rclient.scan_iter(f"{prefix}:{{*}}:job:*", count=1000):
        head, _, job_id = key.partition(":job:")
        out[job_id] = int(head[head.index("{") + 1:head.index("}")])
    return out


def _pending(store) -> tuple[set[str], set[str]]:
    """The pending jobs' ids, read in due order and by the pending index of their task."""
    return ({str(r["id"]) for r in Pending(store).page(limit=10_000)},
            {str(r["id"]) for r in Pending(store).page(task="e2e.mark", limit=10_000)})


def _moving(name: str) -> str:
    """A job id whose shard differs under 16, 64 and 5 shards: it moves in every reshard tested here."""
    return next(f"{name}-{i}" for i in range(1000) if len({shard_for(f"{name}-{i}", n) for n in (16, 64, 5)}) == 3)


def _fill(app: Celery) -> dict[str, object]:
    """One of each kind of key a shard keeps; returns what the checks need."""
    store = get_store(app)
    made: dict[str, object] = {}
    made["compact"] = [apply_later(app, "e2e.mark", args=(i,), when=3600, strict=False).id for i in range(60)]
    made["full"] = [apply_later(app, "e2e.mark", args=(i,), when=3600, expires=7200, strict=False).id
                    for i in range(20)]
    made["keyed"] = [apply_later(app, "e2e.mark", args=(i,), when=3600, shard_key="user-7", strict=False).id
                     for i in range(10)]
    made["idem"] = apply_later(app, "e2e.mark", when=3600, idempotency_key="order-1", strict=False).id
    gone = apply_later(app, "e2e.mark", when=3600, task_id=_moving("cancelled"), strict=False)
    cancel(app, gone.id)
    made["cancelled"] = gone.id
    dead = apply_later(app, "e2e.mark", when=0, max_lateness=1, misfire="dead", task_id=_moving("dead"),
                       strict=False)
    store.release.release_due(dead.shard, now_ms=dead.due_ms + 60_000)
    assert lookup(app, dead.id).job_state == "DEAD"
    made["dead"] = dead.id
    made["debounced"] = apply_later(app, "e2e.mark", args=(1,), when=3600, debounce_key="search-9",
                                    strict=False).id
    schedules.add(app, "nightly-report", "e2e.mark", 3600, strict=False)
    return made


@pytest.mark.parametrize(("old", "new"), [(16, 64), (64, 16), (16, 5)])
def test_reshard_moves_every_kind_of_key_to_its_new_shard(redis_url, uid, rclient, old, new):
    app = make_app(redis_url, uid, delayed_shards=old)
    prefix = app.conf.delayed_key_prefix
    made = _fill(app)
    pending_before = _pending(get_store(app))

    report = Resharder(get_store(app)).run(new, wait_s=5)
    assert report.finished, report
    assert rclient.hgetall(f"{prefix}:layout") == {"shards": str(new), "bucket_ms": "0"}

    # every record in its home shard, none left behind, none doubled
    where = _job_keys(rclient, prefix)
    sk = {j: rclient.hget(f"{prefix}:{{{s}}}:job:{j}", "sk") for j, s in where.items()}
    assert {sk[i] for i in made["keyed"]} == {"user-7"}
    for job_id, shard in where.items():
        assert shard == _home(job_id, sk.get(job_id), new), job_id
    assert report.moved_jobs == sum(1 for j, s in where.items() if _home(j, sk.get(j), old) != s)
    assert len({where[i] for i in made["keyed"]}) == 1  # one shard key, one shard

    # a process that starts with the new count works on the moved store
    fresh = make_app(redis_url, uid, delayed_shards=new)
    store = get_store(fresh)
    assert _pending(store) == pending_before
    # idempotency: the done markers and keys moved too
    with pytest.raises(DuplicateJob):
        apply_later(fresh, "e2e.mark", when=3600, task_id=made["cancelled"], strict=False)
    again = apply_later(fresh, "e2e.mark", when=3600, idempotency_key="order-1", strict=False)
    assert again.id == made["idem"] and not again.created
    # the dead letter is listed and can be requeued
    assert lookup(fresh, made["dead"]).job_state == "DEAD"
    assert made["dead"] in {d.id for d in dlq.list_dead(fresh, limit=100)}
    assert dlq.count(fresh) == 1
    # the debounce key still finds its job
    d2 = apply_later(fresh, "e2e.mark", args=(2,), when=3600, debounce_key="search-9", strict=False)
    assert d2.id == made["debounced"]
    # the schedule moved with its name
    s = schedules.get(fresh, "nightly-report")
    assert s.name == "nightly-report"
    assert rclient.sismember(f"{prefix}:{{{shard_for('nightly-report', new)}}}:scheds", "nightly-report")
    # the moved jobs can be cancelled, and each pending one is released once, with its new shard in its header
    cancel(fresh, made["compact"][0])
    released: list[str] = []
    for shard in range(new):
        batch = store.release.claim_due(shard, now_ms=store.redis.now_ms() + 3700_000, limit=10_000)
        released += batch.ids
        for msg, *_rest in batch.messages:
            assert json.loads(msg)["headers"][SHARD_HEADER] == shard
    assert len(released) == len(set(released))
    # exactly the pending jobs (the schedule's next occurrence too): not the cancelled job, not the dead letter
    want = pending_before[0] - {made["compact"][0]}
    assert {*made["compact"][1:], *made["full"], *made["keyed"], made["idem"], made["debounced"]} <= want
    assert made["cancelled"] not in want and made["dead"] not in want
    extra = set(released) - want
    assert extra == set(), {i: store.lookup.get(i) for i in extra}
    assert set(released) == want


def test_a_producer_that_has_not_seen_the_reshard_is_sealed_out_and_places_anew(redis_url, uid, rclient):
    old = make_app(redis_url, uid)  # 16 shards, and it keeps its store (and count) across the reshard
    first = apply_later(old, "e2e.mark", when=3600, strict=False)
    resharder = Resharder(get_store(make_app(redis_url, uid)))
    assert resharder.begin(64) == 16  # switched and sealed; nothing moved yet
    assert get_store(old).layout.shards == 16

    stale = [apply_later(old, "e2e.mark", args=(i,), when=3600, strict=False) for i in range(40)]
    assert get_store(old).layout.shards == 64  # the seal told it
    where = _job_keys(rclient, old.conf.delayed_key_prefix)
    for h in stale:
        assert where[h.id] == shard_for(h.id, 64) == h.shard
    keyed = apply_later(old, "e2e.mark", when=3600, debounce_key="k-1", strict=False)
    assert keyed.shard == shard_for("k-1", 64)
    # a job of the old layout, not moved yet, can be found, cancelled and is not stored twice
    assert lookup(old, first.id).job_state == "SCHEDULED"
    with pytest.raises(DuplicateJob):  # its id is in its old shard still: not stored again in the new one
        apply_later(old, "e2e.mark", when=3600, task_id=first.id, strict=False)
    report = resharder.run(64, wait_s=5)
    assert report.finished
    assert _job_keys(rclient, old.conf.delayed_key_prefix)[first.id] == shard_for(first.id, 64)
    assert cancel(old, first.id) == "SCHEDULED"


def test_a_released_job_moves_once_it_is_done(redis_url, uid, rclient):
    app = make_app(redis_url, uid)
    store = get_store(app)
    # a job whose home changes from 16 to 64 shards, released (QUEUED) before the reshard
    h = next(h for h in (apply_later(app, "e2e.mark", when=0, strict=False) for _ in range(50))
             if shard_for(h.id, 64) != h.shard)
    store.release.release_due(h.shard, now_ms=h.due_ms + 1)
    for s in range(16):
        store.release.release_due(s, now_ms=h.due_ms + 1)
    report = Resharder(store).run(64, wait_s=0)
    assert not report.finished and report.left_running >= 1
    assert rclient.hget(f"{app.conf.delayed_key_prefix}:layout", "from") == "16"
    # the worker side still finds it by its message's shard header
    started = store.executions.start(h.id, h.shard, "w|1|tag|n")
    assert started.run
    store.executions.finish(h.id, h.shard, "w|1|tag|n", "SUCCEEDED")
    for s in range(64):  # and the others, released above
        for job_id in [str(x) for x in rclient.zrange(store.keys.shard(s).released, 0, -1)]:
            store.executions.start(job_id, s, f"w|1|{job_id}|n")
            store.executions.finish(job_id, s, f"w|1|{job_id}|n", "SUCCEEDED")
    report = Resharder(store).run(64, wait_s=5)
    assert report.finished, report
    assert _job_keys(rclient, app.conf.delayed_key_prefix)[h.id] == shard_for(h.id, 64)
    assert lookup(app, h.id).job_state == "SUCCEEDED"
    with pytest.raises(DuplicateJob):  # the done marker moved: the id is still taken
        apply_later(make_app(redis_url, uid, delayed_shards=64), "e2e.mark", when=60, task_id=h.id, strict=False)


def test_reshard_refuses_bad_input_and_a_second_target(redis_url, uid):
    app = make_app(redis_url, uid)
    with pytest.raises(ConfigurationError, match="nothing to reshard"):
        Resharder(get_store(app)).run(32)
    apply_later(app, "e2e.mark", when=3600, strict=False)
    for bad in (0, -1, 1 << 20, True):
        with pytest.raises(InvalidOption, match="--shards"):
            Resharder(get_store(app)).run(bad)  # type: ignore[arg-type]
    # a job released before the move keeps the reshard open: another target is refused meanwhile
    h = apply_later(app, "e2e.mark", when=0, task_id=next(f"x{i}" for i in range(1000)
                                                           if shard_for(f"x{i}", 32) != shard_for(f"x{i}", 16)),
                    strict=False)
    get_store(app).release.release_due(h.shard, now_ms=h.due_ms + 1)
    assert not Resharder(get_store(app)).run(32, wait_s=0).finished
    with pytest.raises(ConfigurationError, match="in progress"):
        Resharder(get_store(app)).run(8)
    # and a process configured with either count but the layout's is refused at start
    refused = r"has 32 \(a reshard from 16 shards is in progress\).*set delayed_shards = 32"
    with pytest.raises(ConfigurationError, match=refused):
        apply_later(make_app(redis_url, uid, delayed_shards=16), "e2e.mark", when=60, strict=False)


def test_the_cli_reshards_and_status_says_so(redis_url, uid):
    app = make_app(redis_url, uid)
    ids = [apply_later(app, "e2e.mark", when=3600, strict=False).id for _ in range(30)]
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    out = run_celery(redis_url, prefix, queue, "delayed", "reshard", "--shards", "24", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["finished"] and report["new"] == 24
    assert "now set delayed_shards = 24" in out.stderr
    st = run_celery(redis_url, prefix, queue, "delayed", "status", "--json", conf={"delayed_shards": 24})
    assert st.returncode == 0, st.stderr
    assert len(json.loads(st.stdout)["shards"]) == 24
    assert sum(r["pending"] for r in json.loads(st.stdout)["shards"]) == len(ids)
    stale = run_celery(redis_url, prefix, queue, "delayed", "status", "--json")  # configured with 16: reads 24
    assert stale.returncode == 0, stale.stderr
    assert len(json.loads(stale.stdout)["shards"]) == 24
    assert json.loads(stale.stdout)["resharding_from"] is None


def test_a_debounce_key_called_during_the_reshard_still_replaces_its_job(redis_url, uid, rclient):
    app = make_app(redis_url, uid)
    key = next(f"search-{i}" for i in range(1000) if shard_for(f"search-{i}", 16) != shard_for(f"search-{i}", 64))
    first = apply_later(app, "e2e.mark", args=(1,), when=3600, debounce_key=key, strict=False)
    tkey = next(f"t-{i}" for i in range(1000) if shard_for(f"t-{i}", 16) != shard_for(f"t-{i}", 64))
    throttled = apply_later(app, "e2e.mark", when=3600, throttle_key=tkey, window=600, strict=False)
    Resharder(get_store(make_app(redis_url, uid))).begin(64)  # switched; nothing moved yet
    # this app's store has not seen it: sealed out, it reads the layout, moves the key's entry and job, replaces
    again = apply_later(app, "e2e.mark", args=(2,), when=7200, debounce_key=key, strict=False)
    assert again.id == first.id and again.shard == shard_for(key, 64)
    assert get_store(app).layout.shards == 64
    t2 = apply_later(app, "e2e.mark", when=3600, throttle_key=tkey, window=600, strict=False)
    assert t2.id == throttled.id and not t2.created
    where = _job_keys(rclient, app.conf.delayed_key_prefix)
    assert where[first.id] == shard_for(key, 64)
    assert Resharder(get_store(app)).run(64, wait_s=5).finished
    pending, _ = _pending(get_store(app))
    assert first.id in pending and throttled.id in pending and len(pending) == 2


def test_an_old_message_of_a_moved_job_is_not_run(redis_url, uid):
    app = make_app(redis_url, uid)
    h = next(h for h in (apply_later(app, "e2e.mark", when=3600, strict=False) for _ in range(50))
             if shard_for(h.id, 64) != h.shard)
    assert Resharder(get_store(app)).run(64, wait_s=5).finished
    # e.g. a redelivery of a message released before a retry put the job back: it names the old shard
    started = get_store(make_app(redis_url, uid, delayed_shards=64)).executions.start(h.id, h.shard, "w|1|t|n")
    assert not started.run and not started.untracked
    assert (started.state, started.why) == ("SCHEDULED", "moved")
    assert lookup(app, h.id).job_state == "SCHEDULED"


# -- promises of the README's Resharding section ------------------------------------------------------


def _moves(app: Celery, new: int, n: int = 1, **options: object) -> list:
    """``n`` new jobs (``when`` 3600 unless given) whose home under ``new`` shards is another shard."""
    out: list = []
    while len(out) < n:
        h = apply_later(app, "e2e.mark", **{"when": 3600, "strict": False, **options})
        if shard_for(h.id, new) != h.shard:
            out.append(h)
        else:
            cancel(app, h.id)
    return out


def _run_all_released(store, span: int) -> int:
    """Start and finish every released job, as a worker would; how many."""
    n = 0
    for s in range(span):
        for job_id in [str(x) for x in store.redis.client.zrange(store.keys.shard(s).released, 0, -1)]:
            assert store.executions.start(job_id, s, f"w|1|{job_id}|n").run
            store.executions.finish(job_id, s, f"w|1|{job_id}|n", "SUCCEEDED")
            n += 1
    return n


def test_pause_flags_in_force_hold_the_new_shards_too(redis_url, uid, rclient):
    app = make_app(redis_url, uid)
    get_store(app).jobs.pause(["task:e2e.mark"])
    assert Resharder(get_store(app)).run(64, wait_s=5).finished
    fresh = make_app(redis_url, uid, delayed_shards=64)
    store = get_store(fresh)
    prefix = app.conf.delayed_key_prefix
    assert all("task:e2e.mark" in rclient.hgetall(f"{prefix}:{{{s}}}:paused") for s in range(64))
    # a job of the paused task that lands in a new shard is held there, not released
    h = next(h for h in (apply_later(fresh, "e2e.mark", when=0, strict=False) for _ in range(100)) if h.shard >= 16)
    assert h.id not in store.release.claim_due(h.shard, now_ms=h.due_ms + 1000).ids
    assert lookup(fresh, h.id).job_state == "SCHEDULED"
    store.jobs.resume(["task:e2e.mark"])
    assert h.id in store.release.claim_due(h.shard, now_ms=store.redis.now_ms() + 1000).ids


def test_counters_of_removed_shards_are_added_to_the_shards_that_remain(redis_url, uid, rclient):
    app = make_app(redis_url, uid, delayed_shards=64)
    store = get_store(app)
    due = [apply_later(app, "e2e.mark", when=0, strict=False) for _ in range(150)]
    for h in due[:15]:
        cancel(app, h.id)
    for s in range(64):
        store.release.release_due(s, now_ms=store.redis.now_ms() + 1000)
    assert _run_all_released(store, 64) == 135
    pending = [apply_later(app, "e2e.mark", when=3600, strict=False).id for _ in range(40)]
    before = FleetStats(store).snapshot()
    prefix = app.conf.delayed_key_prefix
    removed = sum(int(v) for s in range(16, 64) for v in rclient.hgetall(f"{prefix}:{{{s}}}:stats").values())
    assert removed > 0 and before.counters["released"] == before.counters["succeeded"] == 135

    assert Resharder(store).run(16, wait_s=5).finished
    after = FleetStats(get_store(make_app(redis_url, uid, delayed_shards=16))).snapshot()
    assert after.shards == 16
    assert after.counters == before.counters
    assert (after.release_lateness, after.start_lateness) == (before.release_lateness, before.start_lateness)
    assert (after.queued, after.running, after.pending) == (before.queued, before.running, len(pending))
    assert not [s for s in range(16, 64) if rclient.exists(f"{prefix}:{{{s}}}:stats")]


def test_with_a_database_the_rows_shard_column_follows(redis_url, uid, database_url):
    from celery_delayed.sql.rows import get_rows

    app = make_app(redis_url, uid, delayed_database_url=database_url)
    rows = get_rows(app)
    assert rows is not None
    rows.init_schema()
    try:
        jobs = [apply_later(app, "e2e.mark", when=3600, strict=False) for _ in range(40)]
        home = {h.id: shard_for(h.id, 64) for h in jobs}
        keyed = [apply_later(app, "e2e.mark", args=(i,), when=3600, shard_key="user-3", strict=False)
                 for i in range(5)]
        home.update((h.id, shard_for("user-3", 64)) for h in keyed)
        jobs += keyed
        moving = [h for h in jobs if home[h.id] != h.shard]
        assert moving and all(rows.get(h.id).shard == h.shard for h in jobs)
        prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
        out = run_celery(redis_url, prefix, queue, "delayed", "reshard", "--shards", "64", "--json",
                         conf={"delayed_database_url": database_url})
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["finished"] and report["rows_updated"] == report["moved_jobs"] == len(moving)
        assert {h.id: rows.get(h.id).shard for h in jobs} == home
    finally:
        rows.dispose()


def test_the_cli_exits_3_while_a_released_job_holds_the_reshard_and_a_rerun_finishes(redis_url, uid, rclient):
    app = make_app(redis_url, uid)
    store = get_store(app)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    [held] = _moves(app, 64, when=0)
    store.release.release_due(held.shard, now_ms=held.due_ms + 1)  # QUEUED: it stays until it is done
    waiting = _moves(app, 64, n=20)

    out = run_celery(redis_url, prefix, queue, "delayed", "reshard", "--shards", "64", "--wait", "0")
    assert out.returncode == 3, out.stdout + out.stderr
    assert "reshard 16 -> 64 not finished" in out.stdout
    assert "1 job(s) released or running" in out.stdout
    assert "run `delayed reshard --shards 64` again to finish" in out.stdout
    # correct in between: the pending jobs moved, the released one is still where its message says
    assert rclient.hget(f"{prefix}:layout", "from") == "16"
    where = _job_keys(rclient, prefix)
    assert all(where[h.id] == shard_for(h.id, 64) for h in waiting)
    assert where[held.id] == held.shard
    assert _run_all_released(store, 16) == 1

    again = run_celery(redis_url, prefix, queue, "delayed", "reshard", "--shards", "64", "--wait", "5")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.startswith("resharded 16 -> 64 shards"), again.stdout
    assert rclient.hgetall(f"{prefix}:layout") == {"shards": "64", "bucket_ms": "0"}
    assert _job_keys(rclient, prefix)[held.id] == shard_for(held.id, 64)
    assert lookup(app, held.id).job_state == "SUCCEEDED"


class Crash(Exception):
    """The reshard's process dies (here: between taking jobs out of a shard and writing them in their new one)."""


def test_a_reshard_that_died_between_the_halves_of_a_move_is_finished_by_a_rerun(redis_url, uid, rclient):
    app = make_app(redis_url, uid)
    store = get_store(app)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    jobs = [apply_later(app, "e2e.mark", args=(i,), when=3600, strict=False) for i in range(80)]
    before = _pending(store)

    def crash(calls: object) -> None:
        raise Crash

    store.moves.move_in = crash  # type: ignore[method-assign]  # move_out runs (the real script), then this
    with pytest.raises(Crash):
        Resharder(store).run(64, wait_s=5)
    taken = {str(j) for s in range(16) for j in rclient.smembers(f"{prefix}:{{{s}}}:moving")}
    assert taken and all(lookup(app, j).job_state == "MOVING" for j in taken)

    out = run_celery(redis_url, prefix, queue, "delayed", "reshard", "--shards", "64", "--wait", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("resharded 16 -> 64 shards"), out.stdout
    fresh = get_store(make_app(redis_url, uid, delayed_shards=64))
    assert _pending(fresh) == before
    where = _job_keys(rclient, prefix)
    assert {h.id: where[h.id] for h in jobs} == {h.id: shard_for(h.id, 64) for h in jobs}
    assert not [s for s in range(64) if rclient.scard(f"{prefix}:{{{s}}}:moving")]
    assert {lookup(app, j).job_state for j in taken} == {"SCHEDULED"}


def test_the_reconciler_leaves_rows_and_records_alone_while_jobs_move(redis_url, uid, rclient, database_url):
    from celery_delayed.sql.rows import get_rows

    app = make_app(redis_url, uid, delayed_database_url=database_url)
    rows = get_rows(app)
    assert rows is not None
    rows.init_schema()
    try:
        jobs = [apply_later(app, "e2e.mark", when=3600, strict=False) for _ in range(40)]
        store = get_store(app)
        resharder = Resharder(store, rows)
        resharder.begin(64)  # switched, nothing moved yet: most rows' homes under 64 hold no record
        assert any(shard_for(h.id, 64) != h.shard for h in jobs)
        report = Reconciler(app, store, rows).run_pass()
        assert (report.reindexed, report.adopted, report.dropped) == (0, 0, 0), report.details
        prefix = app.conf.delayed_key_prefix
        assert _job_keys(rclient, prefix) == {h.id: h.shard for h in jobs}  # nothing written, nothing dropped
        assert {rows.get(h.id).shard for h in jobs} == {h.shard for h in jobs}

        assert resharder.run(64, wait_s=5).finished
        report = Reconciler(app, store, rows).run_pass()  # and after it, it finds every job where it belongs
        assert (report.reindexed, report.adopted, report.dropped) == (0, 0, 0), report.details
        assert _job_keys(rclient, prefix) == {h.id: shard_for(h.id, 64) for h in jobs}
    finally:
        rows.dispose()


# -- the worker side meets the first messages of the new shards -----------------------------------


def _released_after_switch(redis_url: str, uid: str) -> tuple[str, int, dict[str, object]]:
    """A shard-key job placed after a 16 -> 64 switch in a new shard (16..63) that is not its id's shard,
    released from there: (id, shard, its message's headers)."""
    producer = make_app(redis_url, uid, delayed_shards=64)
    h = next(h for h in (apply_later(producer, "e2e.mark", when=0, shard_key=f"k-{i}", strict=False)
                         for i in range(200))
             if h.shard >= 16 and h.shard not in (shard_for(h.id, 16), shard_for(h.id, 64)))
    batch = get_store(producer).release.claim_due(h.shard, now_ms=h.due_ms + 1)
    assert batch.ids == [h.id]
    headers = json.loads(batch.messages[0][0])["headers"]
    assert headers[SHARD_HEADER] == h.shard
    return h.id, h.shard, headers


def test_a_worker_that_read_the_layout_just_before_the_switch_takes_the_new_shard_a_message_names(redis_url, uid):
    from types import SimpleNamespace

    from celery_delayed.worker.execution import job_shard

    worker = get_store(make_app(redis_url, uid))
    worker.layout.check()  # read just now: 16 shards
    Resharder(get_store(make_app(redis_url, uid))).begin(64)
    job_id, shard, headers = _released_after_switch(redis_url, uid)
    # the message names a shard this worker has not seen: the layout is read again, not the id's shard guessed
    assert job_shard(worker, SimpleNamespace(id=job_id, headers=headers)) == shard
    started = worker.executions.start(job_id, shard, "w|1|t|n")
    assert started.run, started


def test_worker_threads_that_meet_a_new_shard_together_all_take_it(redis_url, uid):
    """The first messages of the new shards reach a threaded worker in a burst: every thread that reads
    the layout again must take the shard, not only the one whose read saw it change."""
    import threading

    first = get_store(make_app(redis_url, uid))
    first.layout.check()  # the store's layout: 16 shards
    Resharder(first).begin(64)
    refused = 0
    for _round in range(20):
        layout = get_store(make_app(redis_url, uid)).layout  # a worker's: 16 shards, not read yet
        gate = threading.Barrier(8)
        got: list[bool] = []

        def take(layout=layout, gate=gate, got=got) -> None:
            gate.wait()
            got.append(layout.valid_shard(40))

        threads = [threading.Thread(target=take) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        refused += got.count(False)
    assert refused == 0, f"{refused} of 160 threads took a valid new shard for an invalid one"



def test_threads_that_look_a_moved_job_up_together_all_find_it(redis_url, uid):
    """A job in a new shard of a reshard this process has not seen: every thread's lookup finds it,
    not only the one whose read of the layout saw the change."""
    import threading
    import time

    from celery_delayed import JobNotFound

    missed = 0
    for n in range(5):
        store = get_store(make_app(redis_url, f"{uid}r{n}"))
        store.layout.check()  # a worker's store, its layout read at start: 16 shards
        Resharder(get_store(make_app(redis_url, f"{uid}r{n}"))).begin(64)
        job_id, _shard, _headers = _released_after_switch(redis_url, f"{uid}r{n}")
        time.sleep(1.05)  # read more than a second ago: a miss reads it again
        gate = threading.Barrier(8)
        got: list[object] = []

        def find(store=store, gate=gate, got=got, job_id=job_id) -> None:
            gate.wait()
            try:
                got.append(store.lookup.locate(job_id))
            except JobNotFound as exc:
                got.append(exc)

        threads = [threading.Thread(target=find) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        missed += sum(1 for g in got if isinstance(g, JobNotFound))
    assert missed == 0, f"{missed} of 40 lookups missed a job that is there"
