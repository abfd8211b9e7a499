"""Scenarios 3, 10 and 11: moving due jobs into the queue.

3. One scheduler subprocess (direct path) releases N jobs that are all due,
   ~1 KB messages; reference: a bare Lua script moving 100 members per call
   from a sorted set to a list, on the same server.
10. Time bucketing off vs on: schedule rate, release rate and Redis memory
    per job with N pending.
11. PostgreSQL baseline: the same release from a well-indexed table with
    ``SELECT ... FOR UPDATE SKIP LOCKED LIMIT 100``.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery_delayed.producer.prepare import prepare
from celery_delayed.store import NewJob, Store, get_store

from .celery_app import make_app
from .common import Ctx, delayed_scheduler, delete_prefix, procs, uid, used_memory, wait_for

S3 = "3 release throughput (direct path)"
S10 = "10 time bucketing off vs on"
S11 = "11 PostgreSQL SKIP LOCKED baseline"

_MOVER = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 100)
if #ids > 0 then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, #ids - 1)
  redis.call('LPUSH', KEYS[2], unpack(ids))
end
return #ids
"""
# The same, plus the per-job bookkeeping a job store needs (state and release
# time, drop the message, expire the record): what the gap to the bare mover is made of.
_MOVER_BOOKKEEPING = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 100)
if #ids == 0 then return 0 end
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, #ids - 1)
local msgs = {}
for i, id in ipairs(ids) do
  local jk = KEYS[3] .. id
  msgs[i] = redis.call('HGET', jk, 'msg')
  redis.call('HSET', jk, 'st', 'QUEUED', 'released', ARGV[1])
  redis.call('HDEL', jk, 'msg')
  redis.call('PEXPIRE', jk, 600000)
end
redis.call('LPUSH', KEYS[2], unpack(msgs))
return #ids
"""
_PAD = "x" * 330  # makes the stored envelope ~1 KB (base64 grows it by a third)


def _fill(store: Store, app: Any, n: int, u: str, due_of: Any, pad: str = _PAD, chunk: int = 20_000) -> float:
    """Schedule n jobs through ``store.jobs.schedule`` (one message text shared by all); return seconds."""
    p = prepare(app, store, "bench.late_d", (0.0,), {"pad": pad}, 0, task_type=app.tasks["bench.late_d"])
    base = p.job

    def one(start: int) -> None:
        jobs = []
        for i in range(start, min(n, start + chunk)):
            jid = f"{u}-{i}"
            jobs.append(NewJob(jid, store.layout.shard_of(jid), due_of(i), base.fields, base.common, base.template))
        store.jobs.schedule(jobs)

    t0 = time.perf_counter()
    # Two threads: one builds and sends a chunk while Redis runs the other's.
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(one, s) for s in range(0, n, chunk)]:
            f.result()
    return time.perf_counter() - t0


def release(ctx: Ctx) -> None:
    n = ctx.size(1_000_000, 50_000)
    print(f"[{S3}] {n} due jobs, ~1 KB messages", flush=True)
    u = uid()
    prefix, queue = f"b3{u}", f"q3{u}"
    app = make_app(ctx.redis_url, prefix, queue)
    store = get_store(app)
    client = ctx.client()
    now_ms = store.redis.now_ms()
    fill_s = _fill(store, app, n, u, lambda i: str(now_ms - 1000))
    # the message each job's release pushes (a compact record renders it from its template)
    size = len((store.lookup.messages([(store.layout.shard_of(f"{u}-0"), f"{u}-0")])[0] or "").encode())
    ctx.add(S3, "celery-delayed (fill via store.jobs.schedule)", "schedule rate", n / fill_s, "jobs/s",
            note=f"message {size} B, 2 threads, chunks of 20,000")
    with procs() as ps:
        ps.append(delayed_scheduler(ctx.redis_url, prefix, queue))
        seen = wait_for(lambda: client.llen(queue), 60, interval=0.002)
        t0 = time.perf_counter()
        first = int(seen or 0)
        # the first 250,000 too: the references below move that many (a list of 1,000,000
        # ~1.7 KB messages is itself slower to grow, whatever fills it)
        part = min(n, first + 250_000)
        wait_for(lambda: client.llen(queue) >= part, 300, interval=0.01)
        t_part = time.perf_counter()
        done = wait_for(lambda: client.llen(queue) >= n, 300, interval=0.01)
        t1 = time.perf_counter()
    if not done:
        ctx.add(S3, "celery-delayed scheduler", "release rate", None, "jobs/s",
                note=f"only {client.llen(queue)} of {n} released in time")
    else:
        ctx.add(S3, "celery-delayed scheduler", "release rate", (n - first) / (t1 - t0), "jobs/s",
                note=f"one `celery delayed run` process, 16 shards, batch 500, all {n:,}")
        if part < n:
            ctx.add(S3, "celery-delayed scheduler, first 250,000", "release rate", (part - first) / (t_part - t0),
                    "jobs/s", note="the same run, while its queue held as many messages as the references'")
    delete_prefix(client, f"{prefix}:*")
    client.unlink(queue)
    # References: the bare mover, then the bare mover with job records. Their rate
    # hardly depends on the set's size (a batch is read from the head of the set),
    # so a full run measures them on 250,000 members to save time and memory.
    n = min(n, 250_000)
    key, dest = f"zref3{u}", f"lref3{u}"
    for start in range(0, n, 10_000):
        client.zadd(key, {f"{i:09d}{_PAD}{_PAD}{_PAD}"[:size]: 1 for i in range(start, min(n, start + 10_000))})
    sha = client.script_load(_MOVER)
    t0 = time.perf_counter()
    while int(client.evalsha(sha, 2, key, dest, 2)) > 0:
        pass
    ctx.add(S3, "reference: bare Lua ZSET->LIST mover", "release rate", n / (time.perf_counter() - t0),
            "jobs/s", note=f"100 members per call, same member size, {n:,} members")
    client.unlink(key, dest)
    # Reference 2: the bare mover with a job record per member.
    rec = f"rref3{u}:"
    for start in range(0, n, 10_000):
        pipe = client.pipeline(transaction=False)
        ids = {f"{i:09d}": 1 for i in range(start, min(n, start + 10_000))}
        for jid in ids:
            pipe.hset(rec + jid, mapping={"st": "SCHEDULED", "due": "1", "msg": "m" * size})
        pipe.zadd(key, ids)
        pipe.execute()
    sha = client.script_load(_MOVER_BOOKKEEPING)
    t0 = time.perf_counter()
    while int(client.evalsha(sha, 3, key, dest, rec, 2)) > 0:
        pass
    ctx.add(S3, "reference: bare mover + job records", "release rate", n / (time.perf_counter() - t0), "jobs/s",
            note="also sets state/released, drops the message, expires the record (4 more calls per job)")
    client.unlink(key, dest)
    delete_prefix(client, f"{rec}*")
    ctx.relate(S3, "release rate", "reference: bare Lua ZSET->LIST mover")


def _release_all(store: Store) -> tuple[int, float]:
    """Release every due job of every shard in-process (one batch per shard per round)."""
    total, t0 = 0, time.perf_counter()
    live = set(range(store.config.shards))
    while live:
        for s in list(live):
            b = store.release.release_due(s)
            total += b.count
            if b.count + b.skipped < store.config.batch_size:
                live.discard(s)
    return total, time.perf_counter() - t0


def buckets(ctx: Ctx) -> None:
    n = ctx.size(1_000_000, 50_000)
    print(f"[{S10}] {n} pending jobs spread over an hour, 10% of them due", flush=True)
    if not ctx.quick:
        ctx.notes.append("scenario 10 ran at 1,000,000 pending jobs only: 10,000,000 (~6 GB of Redis at ~550 B "
                         "per job, and ~3 min to schedule per variant) does not fit this machine's time budget")
    client = ctx.client()
    for bucket_ms in (0, 60_000):
        u = uid()
        prefix, queue = f"b10{u}", f"q10{u}"
        app = make_app(ctx.redis_url, prefix, queue, delayed_bucket_ms=bucket_ms)
        store = get_store(app)
        label = f"celery-delayed bucket_ms={bucket_ms}"
        before = used_memory(client)
        now_ms = store.redis.now_ms()
        span = 3_600_000
        fill_s = _fill(store, app, n, u, lambda i, t=now_ms - span // 10, w=span: str(t + i * w // n), pad="")
        per_job = (used_memory(client) - before) / n
        ctx.add(S10, label, "schedule rate", n / fill_s, "jobs/s")
        ctx.add(S10, label, "Redis memory per pending job", per_job, "bytes")
        released, secs = _release_all(store)
        ctx.add(S10, label, "release rate (10% due)", released / secs if secs else None, "jobs/s",
                note=f"{released} released in-process")
        delete_prefix(client, f"{prefix}:*")
        client.unlink(queue)
    for metric in ("schedule rate", "Redis memory per pending job", "release rate (10% due)"):
        ctx.relate(S10, metric, "celery-delayed bucket_ms=0")


def postgres(ctx: Ctx) -> None:
    n = ctx.size(200_000, 20_000)
    print(f"[{S11}] {n} due jobs, ~1 KB messages", flush=True)
    try:
        import psycopg
    except ImportError:
        ctx.notes.append("scenario 11 skipped: psycopg is not installed (pip install -e '.[bench]')")
        return
    dsn = "host=127.0.0.1 port=5432 dbname=test user=postgres connect_timeout=3"
    try:
        conn = psycopg.connect(dsn, autocommit=True)
    except Exception as exc:
        ctx.notes.append(f"scenario 11 skipped: PostgreSQL not reachable at 127.0.0.1:5432 ({exc})"[:300])
        return
    u = uid()
    table = f"bench_jobs_{u}"
    client = ctx.client()
    dest = f"lpg{u}"
    msg = "m" * 1000
    try:
        conn.execute(f"CREATE TABLE {table} (id bigserial PRIMARY KEY, due_ms bigint NOT NULL, "
                     "queue text NOT NULL, msg text NOT NULL)")
        conn.execute(f"CREATE INDEX ON {table} (due_ms)")
        t0 = time.perf_counter()
        with conn.transaction(), conn.cursor() as cur, \
                cur.copy(f"COPY {table} (due_ms, queue, msg) FROM STDIN") as copy:
            for i in range(n):
                copy.write_row((1000 + i, dest, msg))
        fill = time.perf_counter() - t0
        conn.execute(f"ANALYZE {table}")
        ctx.add(S11, "PostgreSQL (COPY)", "schedule rate", n / fill, "jobs/s", note="bulk COPY into a logged table")
        sql = (f"WITH c AS (SELECT id FROM {table} WHERE due_ms <= %s ORDER BY due_ms LIMIT 100 "
               f"FOR UPDATE SKIP LOCKED) DELETE FROM {table} t USING c WHERE t.id = c.id RETURNING t.queue, t.msg")
        moved, t0 = 0, time.perf_counter()
        while True:
            with conn.transaction():
                rows = conn.execute(sql, (int(time.time() * 1000),)).fetchall()
                if rows:
                    client.lpush(dest, *[m for _, m in rows])
            if not rows:
                break
            moved += len(rows)
        rate = moved / (time.perf_counter() - t0)
        ctx.add(S11, "PostgreSQL SKIP LOCKED poller", "release rate", rate, "jobs/s",
                note="100 rows per transaction (DELETE ... RETURNING), LPUSH to Redis, commit")
        ref = next((r for r in ctx.rows if r.scenario == S3 and r.system == "celery-delayed scheduler"
                    and r.value), None)
        if ref is not None:
            ctx.add(S11, "celery-delayed scheduler (from scenario 3)", "release rate", ref.value, "jobs/s",
                    note="sorted sets, same message size")
        ctx.relate(S11, "release rate", "PostgreSQL SKIP LOCKED poller")
    finally:
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.close()
        client.unlink(dest)
