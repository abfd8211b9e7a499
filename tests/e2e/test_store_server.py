"""The store's Redis full or evicting: a typed error, nothing half-written, release goes on, warnings said."""

from __future__ import annotations

import pytest
import redis
from support import RedisServer, SchedulerProcess, make_app, run_celery, wait_for

from celery_delayed import DelayedError, StoreFull, StoreUnavailable, apply_later, apply_later_many, get_store
from celery_delayed.store import ShardStatus
from celery_delayed.store.health import ServerHealth


def _fill(client: redis.Redis) -> None:
    """Write filler keys until Redis refuses (maxmemory, noeviction), then leave it over its limit.

    Refused once, Redis sits a few KB under maxmemory, and idle connections' buffers it frees later move
    it further under: a write could then pass. maxmemory is lowered under what is used, so that the
    store is full for every write that follows, as a store that has been full for a while is.
    """
    i = 0
    try:
        while i < 1_000_000:
            client.set(f"filler:{i}", "x" * 4096)
            i += 1
    except redis.exceptions.OutOfMemoryError:
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", used - 256 * 1024)
        return
    raise AssertionError("Redis never filled up")


@pytest.fixture
def full_server():  # type: ignore[no-untyped-def]
    with RedisServer("--maxmemory", "8mb", "--maxmemory-policy", "noeviction") as server:
        yield server


@pytest.mark.timeout(60)
def test_a_full_store_refuses_jobs_with_a_typed_error_and_writes_nothing(full_server, uid):
    app = make_app(full_server.url, uid)
    apply_later(app, "t.full", when=60, strict=False)  # the store exists
    client = redis.Redis.from_url(full_server.url, decode_responses=True)
    _fill(client)
    before = sorted(client.scan_iter(f"t{uid}:*"))
    with pytest.raises(StoreFull, match="is full") as info:
        apply_later_many(app, "t.full", ({"args": ("x" * 2000,), "when": 60} for _ in range(200)), strict=False)
    assert isinstance(info.value, (DelayedError, StoreUnavailable))
    assert info.value.written == {}
    assert "maxmemory" in str(info.value) and "noeviction" in str(info.value)
    assert sorted(client.scan_iter(f"t{uid}:*")) == before  # nothing half-written


@pytest.mark.timeout(120)
def test_a_batch_over_many_shards_that_reaches_maxmemory_part_way_is_written_whole_or_not_at_all(uid):
    # One schedule.lua per shard: in a plain pipeline Redis judges each script's memory as it comes, so
    # the first shards' jobs could be written and the rest refused. In one MULTI/EXEC it is judged once.
    # The limit is swept over the memory the batch takes, through the band where a pipeline split it.
    calls = [{"args": ("x" * 2000,), "when": 60} for _ in range(400)]
    with RedisServer("--maxmemory-policy", "noeviction") as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)

        def jobs(prefix: str) -> int:
            return sum(1 for _ in client.scan_iter(f"{prefix}:*:job:*", count=1000))

        def attempt(n: int, headroom: int | None) -> tuple[str, int]:
            app = make_app(server.url, f"{uid}{n}", delayed_shards=8)
            apply_later(app, "t.full", when=60, strict=False)  # the store and its scripts exist
            client.config_set("maxmemory", 0)
            used = int(client.info("memory")["used_memory"])
            if headroom is not None:
                client.config_set("maxmemory", used + headroom)
            try:
                apply_later_many(app, "t.full", calls, strict=False)
                outcome = "written"
            except StoreFull:
                outcome = "refused"
            client.config_set("maxmemory", 0)
            grew = int(client.info("memory")["used_memory"]) - used
            kept = jobs(f"t{uid}{n}") - 1
            for key in client.scan_iter(f"t{uid}{n}:*", count=1000):
                client.delete(key)
            return outcome, kept if outcome == "refused" else grew

        outcome, grew = attempt(0, None)
        assert outcome == "written" and grew > 0
        seen = set()
        for n in range(1, 41):
            headroom = grew * n // 40
            outcome, kept = attempt(n, headroom)
            seen.add(outcome)
            if outcome == "refused":
                assert kept == 0, f"{kept} of {len(calls)} jobs kept after StoreFull (headroom {headroom} B)"
        assert seen == {"written", "refused"}


@pytest.mark.timeout(120)
def test_a_batch_that_keeps_redis_busy_past_the_socket_timeout_is_waited_for(uid):
    # Redis runs a batch over several shards as one MULTI/EXEC, and one shard's part as one script:
    # about 10-30 µs a job (100,000 jobs held it 2 s). redis-py reads a reply within the client's
    # socket_timeout (5 s by default since redis-py 8), so a large batch timed out and was called a
    # lost connection ("may or may not have been written") while Redis went on writing it whole.
    n, limit = 40_000, 0.1
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        app = make_app(server.url, uid, delayed_shards=8, delayed_redis_options={"socket_timeout": limit})
        apply_later(app, "t.slow", when=60, strict=False)  # the store and its scripts exist

        def busy(command: str) -> float:
            return float(client.info("commandstats").get(f"cmdstat_{command}", {}).get("usec", 0)) / 1e6

        for command, one_shard in (("exec", False), ("evalsha", True)):
            calls = [{"args": (i,), "when": 60, **({"shard_key": "one"} if one_shard else {})} for i in range(n)]
            client.config_resetstat()
            handles = apply_later_many(app, "t.slow", calls, strict=False)
            assert len(handles) == n and all(h.created for h in handles)
            assert len({h.shard for h in handles}) == (1 if one_shard else 8)
            assert busy(command) > limit, f"the batch took Redis only {busy(command):.3f} s: nothing was tested"
        pending = sum(client.zcard(f"t{uid}:{{{s}}}:due") for s in range(8))
        assert pending == 1 + 2 * n
        # The long calls' own connections never joined the pool: its connections keep the client's timeout.
        pool = get_store(app).redis.client.connection_pool
        held = [pool.get_connection() for _ in range(4)]
        try:
            assert [c.socket_timeout for c in held] == [limit] * 4
        finally:
            for c in held:
                pool.release(c)
        # An ordinary call still has the client's own timeout: a Redis that stops answering is noticed.
        client.execute_command("CLIENT", "PAUSE", 1500, "ALL")
        with pytest.raises(StoreUnavailable):
            apply_later(app, "t.slow", when=60, strict=False)


@pytest.mark.timeout(120)
def test_a_batch_refused_after_a_second_round_trip_names_the_jobs_it_stored(uid):
    # One shard's template was lost (as after a week unused): that shard's call goes again, with the
    # template, after the other shards' calls are written. If Redis fills up in between, StoreFull must
    # name exactly the jobs stored, not say that nothing was written.
    calls = [{"args": ("x" * 2000,), "when": 60} for _ in range(400)]
    with RedisServer("--maxmemory-policy", "noeviction") as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        app = make_app(server.url, uid, delayed_shards=8)
        store = get_store(app)

        def pending() -> set[str]:
            return {j for i in range(store.layout.shards) for j in client.zrange(store.keys.shard(i).due, 0, -1)}

        grew, partial = 0, 0
        for n in range(41):
            client.config_set("maxmemory", 0)
            apply_later_many(app, "t.full", calls[:64], strict=False)  # every shard has the template again
            before = pending()
            client.delete(next(iter(client.scan_iter(f"t{uid}:*:tpl:*"))))  # one shard's template, lost
            used = int(client.info("memory")["used_memory"])
            if n:
                client.config_set("maxmemory", used + grew * n // 40)
            try:
                hs = apply_later_many(app, "t.full", calls, strict=False)
                assert pending() - before == {h.id for h in hs}
            except StoreFull as err:
                stored = pending() - before
                assert stored == {h.id for h in err.written.values()}, "StoreFull.written is not what is stored"
                if stored:
                    partial += 1
                    assert f"{len(stored)} of the 400 jobs were written" in str(err)
                    assert all(0 <= i < 400 for i in err.written)
                else:
                    assert "nothing was written" in str(err)
            client.config_set("maxmemory", 0)
            if not n:
                grew = int(client.info("memory")["used_memory"]) - used
        assert partial, "no headroom let the first round trip pass and refused the second"


@pytest.mark.timeout(60)
def test_a_store_within_one_percent_of_maxmemory_is_reported_full(uid):
    # Filled until a write is refused, Redis stays a few KB under maxmemory (the refused value is freed):
    # the check must call that full, not wait for a client's buffers to push it over.
    with RedisServer("--maxmemory-policy", "noeviction") as server:
        app = make_app(server.url, uid)
        client = redis.Redis.from_url(server.url)
        health = ServerHealth(get_store(app))
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", int(used * 1.2))
        assert not any("is full" in w for w in health.warnings())
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory", int(used / 0.995))
        (full,) = [w for w in health.warnings() if "is full" in w]
        assert "99." in full and "raise maxmemory" in full


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_a_full_store_keeps_releasing_and_says_so(full_server, uid, workers):
    app = make_app(full_server.url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    hs = apply_later_many(app, "e2e.mark", ({"args": (i,), "when": 0} for i in range(300)), strict=False)
    client = redis.Redis.from_url(full_server.url, decode_responses=True)
    _fill(client)
    sched = SchedulerProcess(full_server.url, prefix, queue)
    workers.append(sched)
    wait_for(lambda: client.llen(queue) == len(hs), 30, what="every overdue job released into a full Redis")
    assert sum(r["pending"] for r in ShardStatus(get_store(app)).rows()) == 0
    wait_for(lambda: "store's Redis is full" in sched.output(), 10, what="the scheduler to say the store is full")


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_an_evicting_policy_is_reported_at_start_and_in_status(uid, workers):
    with RedisServer("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru") as server:
        app = make_app(server.url, uid)
        prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
        sched = SchedulerProcess(server.url, prefix, queue)
        workers.append(sched)
        wait_for(lambda: "maxmemory-policy allkeys-lru" in sched.output(), 30, what="the scheduler's warning")
        assert "ERROR" in sched.output().split("maxmemory-policy allkeys-lru")[0].splitlines()[-1]
        res = run_celery(server.url, prefix, queue, "delayed", "status")
        assert res.returncode == 0, res.stderr
        assert "WARNING: the store's Redis has maxmemory-policy allkeys-lru" in res.stdout
        sched.stop()
