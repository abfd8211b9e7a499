"""An outage backlog: everything is released late but not lost, in batches, round robin over shards."""

from __future__ import annotations

import collections
import json
import time
from datetime import datetime, timedelta, timezone

import pytest
import redis
from support import RedisServer, SchedulerProcess, make_app, wait_for

from celery_delayed import apply_later_many, get_store
from celery_delayed.store import ShardStatus

pytestmark = pytest.mark.e2e

SHARDS = 16
BATCH = 500
SPREAD = 20_000  # jobs spread over every shard by their ids
HOT = 20_000  # jobs in one shard (one shard_key)


@pytest.mark.timeout(300)
def test_outage_backlog_is_released_round_robin(uid, workers):
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        conf = {"delayed_shards": SHARDS, "delayed_batch_size": BATCH}
        app = make_app(server.url, uid, **conf)
        prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
        store = get_store(app)

        # No scheduler runs: jobs come due over the last few seconds and pile up.
        t0 = time.monotonic()
        now = datetime.now(timezone.utc)
        past = [now - timedelta(seconds=k / 10) for k in range(100)]
        ids: list[str] = []
        for start in range(0, SPREAD, 5000):
            calls = [{"args": (i,), "when": past[i % 100]} for i in range(start, start + 5000)]
            ids += [h.id for h in apply_later_many(app, "e2e.mark", calls, strict=False)]
        hot_ids: list[str] = []
        for start in range(0, HOT, 5000):
            calls = [{"args": (i,), "when": past[i % 100], "shard_key": "hot"}
                     for i in range(start, start + 5000)]
            hot_ids += [h.id for h in apply_later_many(app, "e2e.mark", calls, strict=False)]
        hot = store.layout.shard_of("", "hot")
        print(f"\nscheduled {SPREAD + HOT} due jobs in {time.monotonic() - t0:.1f}s")
        status = ShardStatus(store).rows()
        assert sum(r["overdue"] for r in status) == SPREAD + HOT
        assert status[hot]["pending"] >= HOT

        started = time.monotonic()
        s = SchedulerProcess(server.url, prefix, queue, conf=conf)
        workers.append(s)
        total = SPREAD + HOT
        wait_for(lambda: client.llen(queue) >= total or s.proc.poll() is not None, 180, interval=0.1,
                 what=f"{total} released jobs")
        took = time.monotonic() - started
        print(f"released {total} overdue jobs in {took:.1f}s (incl. scheduler start) = {total / took:.0f}/s")
        assert s.proc.poll() is None, s.output()[-3000:]

        # LPUSH puts the newest at the head: reversed, the list is the release order.
        order = [json.loads(m)["headers"]["id"] for m in reversed(client.lrange(queue, 0, -1))]
        counts = collections.Counter(order)
        assert set(counts) == set(ids) | set(hot_ids), "jobs lost"
        assert max(counts.values()) == 1, "a job was released twice"
        assert sum(r["pending"] for r in ShardStatus(store).rows()) == 0

        shard_of = {jid: store.layout.shard_of(jid) for jid in ids}
        shard_of.update(dict.fromkeys(hot_ids, hot))
        last_small = max(i for i, jid in enumerate(order) if shard_of[jid] != hot)
        hot_before = sum(1 for jid in order[:last_small] if shard_of[jid] == hot)
        per_shard = collections.Counter(shard_of[jid] for jid in order)
        rounds = -(-max(n for sh, n in per_shard.items() if sh != hot) // BATCH)
        print(f"the other shards were drained after {hot_before} of {per_shard[hot]} hot-shard jobs "
              f"({rounds} rounds of {BATCH})")
        # Round robin: while the others drain, the hot shard gets one batch per round, no more.
        assert hot_before <= (rounds + 1) * BATCH, hot_before
        # In batches: the first batch of the hot shard does not hold more than one batch.
        first_hot = [i for i, jid in enumerate(order) if shard_of[jid] == hot][:BATCH + 1]
        assert first_hot[BATCH] - first_hot[0] > BATCH, "the hot shard was not released in batches"
        s.stop()
        client.close()
