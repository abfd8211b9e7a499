"""Counting messages where a promise about enqueueing is made: on the broker and at the worker.

A ``DelayedTask`` turns a duplicate message into a skip that its run log never
shows, so "enqueued once" is counted here instead: the messages on a queue's
Redis lists, the deliveries a worker logged ("Task <name>[<id>] received"),
and what is left to deliver (on a list, in kombu's unacked hash, scheduled or
in flight in the store).
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import redis
from celery import Celery

from celery_delayed import get_store
from celery_delayed.store import ShardStatus

_RECEIVED = re.compile(r"Task ([\w.]+)\[([^\]]+)\] received")
#: kombu's Redis transport: priority lists are ``queue + sep + step`` (default steps 0, 3, 6, 9).
SEP = "\x06\x16"


def received(output: str, task: str | None = None) -> collections.Counter[str]:
    """Deliveries per task id from a worker's log, before any execution record could drop one."""
    return collections.Counter(tid for name, tid in _RECEIVED.findall(output) if task is None or name == task)


def queue_keys(queue: str, global_keyprefix: str = "") -> list[str]:
    """The Redis lists kombu keeps for ``queue``: the queue itself and its priority lists."""
    base = f"{global_keyprefix}{queue}"
    return [base] + [f"{base}{SEP}{step}" for step in (3, 6, 9)]


def queued_ids(client: redis.Redis, keys: Sequence[str]) -> collections.Counter[str]:
    """Task ids of the messages on the Redis lists ``keys``, one count per message."""
    pipe = client.pipeline(transaction=True)
    for k in keys:
        pipe.lrange(k, 0, -1)
    out: collections.Counter[str] = collections.Counter()
    for raws in pipe.execute():
        out.update(json.loads(raw)["headers"]["id"] for raw in raws)
    return out


def undelivered(client: redis.Redis, ids: Iterable[str], keys: Sequence[str],
                unacked: str = "unacked") -> list[str]:
    """Ids among ``ids`` whose message is still on one of the lists or in kombu's unacked hash.

    One snapshot (MULTI), so a message moving from a list to the unacked hash
    is seen in one place or the other. A worker that was stopped has restored
    what it held, so after its stop this is everything left to deliver.
    """
    pipe = client.pipeline(transaction=True)
    for k in keys:
        pipe.lrange(k, 0, -1)
    pipe.hvals(unacked)
    *lists, held = pipe.execute()
    found: set[str] = set()
    for raws in lists:
        found.update(json.loads(raw)["headers"]["id"] for raw in raws)
    for raw in held:
        found.add(json.loads(raw)[0]["headers"]["id"])
    want = set(ids)
    return sorted(found & want)


def pending(app: Celery) -> int:
    """Jobs still scheduled or in flight in the app's store (what a scheduler may still send)."""
    return sum(r["pending"] + r["inflight"] for r in ShardStatus(get_store(app)).rows())


def record_fields(app: Celery, ids: Sequence[str], *fields: str) -> dict[str, list[Any]]:
    """``fields`` of each job's record (jobs without a shard key), in one round trip."""
    store = get_store(app)
    pipe = store.redis.client.pipeline(transaction=False)
    for i in ids:
        pipe.hmget(store.keys.shard(store.layout.shard_of(i)).job(i), *fields)
    return dict(zip(ids, pipe.execute(), strict=True))


def claims(app: Celery, ids: Sequence[str]) -> collections.Counter[str]:
    """How many times each job was claimed on the publish path (each claim is published once)."""
    return collections.Counter({i: int(c or 0) for i, (c,) in record_fields(app, ids, "claims").items()})


def looked_ahead(headers: dict) -> bool:  # type: ignore[type-arg]
    """A stored job's message: no eta (released when due), or, released ahead of its due time
    (look-ahead), Celery's eta set to the due time, within a few seconds of its delayed_eta."""
    eta, want = headers.get("eta"), headers.get("delayed_eta")
    if eta is None:
        return True
    if not isinstance(eta, str) or not isinstance(want, str):
        return False
    return abs((datetime.fromisoformat(eta) - datetime.fromisoformat(want)).total_seconds()) < 5
