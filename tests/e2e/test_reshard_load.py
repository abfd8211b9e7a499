"""``delayed reshard`` from 16 to 64 shards under load: producers keep scheduling, two schedulers keep
releasing, a worker keeps running jobs, and every job runs exactly once (issue 13).

The producer here is a process that does not know of the reshard (its store keeps the count it
started with): the scripts seal it out of the old shards and it places its jobs anew. The schedulers
and the worker were started with ``delayed_shards = 16`` too and follow the layout as it changes.
"""

from __future__ import annotations

import collections
import json
import random
import threading
import time
from datetime import datetime, timezone

import pytest
from support import SchedulerProcess, WorkerProcess, make_app, ran, run_celery, wait_for
from support.delivery import pending

from celery_delayed import apply_later, apply_later_many, get_store
from celery_delayed.store import shard_for

pytestmark = pytest.mark.e2e

CONF = {"delayed_lease_ms": 2000, "delayed_shards": 16}


@pytest.mark.timeout(240)
def test_reshard_16_to_64_under_load_loses_and_doubles_nothing(redis_url, uid, workers, rclient):
    app = make_app(redis_url, uid, **CONF)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, concurrency=4, pool="threads", conf=CONF)
    scheds = [SchedulerProcess(redis_url, prefix, queue, conf=CONF) for _ in range(2)]
    workers.extend([w, *scheds])
    w.wait_ready(60)
    # both schedulers run before the reshard (one started after it with delayed_shards=16 would refuse the store)
    wait_for(lambda: rclient.zcard(f"{prefix}:schedulers") == 2, 30, what="two schedulers to join")
    get_store(app).layout.check()
    ids: list[str] = []
    ordered: list[str] = []  # one shard key, due 150 ms apart across the reshard: released in due order
    stop = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            rnd = random.Random(7)
            start = time.time()
            ordered.extend(apply_later(app, "e2e.plain", args=(i,),
                                       when=datetime.fromtimestamp(start + 2 + 0.15 * i, tz=timezone.utc),
                                       shard_key="ordered", strict=False).id for i in range(60))
            while not stop.is_set():
                calls = [{"args": (n,), "when": rnd.uniform(0, 2.5)} for n in range(40)]
                ids.extend(h.id for h in apply_later_many(app, "e2e.plain", calls, strict=False))
                ids.extend(apply_later(app, "e2e.plain", when=rnd.uniform(0, 2), shard_key=f"user-{k}",
                                       strict=False).id for k in range(5))
                time.sleep(0.05)
        except BaseException as exc:  # the test fails below with it
            errors.append(exc)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    time.sleep(3)  # jobs pending, due and running in 16 shards
    before = len(ids)
    out = run_celery(redis_url, prefix, queue, "delayed", "reshard", "--shards", "64", "--json", conf=CONF,
                     timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    print(f"reshard under load: {report}")
    time.sleep(3)  # and after it, still from the producer that started with 16
    stop.set()
    producer.join(30)
    assert not errors, errors
    assert before > 500 and len(ids) > before + 500
    assert report["finished"] and report["moved_jobs"] > 0, report
    assert get_store(app).layout.shards == 64  # the producer was told by the seal

    everything = [*ids, *ordered]
    try:
        wait_for(lambda: rclient.llen(f"{prefix}:ran") >= len(everything), 90, interval=0.2,
                 what=f"{len(everything)} runs")
    except AssertionError:
        missing = sorted(set(everything) - set(ran(rclient, prefix)))
        look = get_store(make_app(redis_url, uid, **{**CONF, "delayed_shards": 64}))
        seen = collections.Counter()
        for job_id in missing[:200]:
            try:
                rec = look.lookup.get(job_id)
                seen[(rec.get("st"), rec["shard"] == str(shard_for(rec.get("sk") or job_id, 64)))] += 1
            except Exception as exc:
                seen[type(exc).__name__] += 1
        raise AssertionError(f"{len(missing)} never ran: (state, in its home) {dict(seen)}; "
                             f"layout {rclient.hgetall(f'{prefix}:layout')}; report {report}; "
                             f"scheduler: {scheds[0].output()[-1500:]}") from None
    time.sleep(1)  # a second run of any job would show by now
    counts = collections.Counter(ran(rclient, prefix))
    lost = set(everything) - set(counts)
    doubled = {k: v for k, v in counts.items() if v > 1}
    print(f"reshard under load: {len(everything)} jobs ({before} before the reshard), "
          f"{len(lost)} lost, {len(doubled)} ran twice")
    assert not lost, f"{len(lost)} of {len(everything)} jobs lost"
    assert not doubled, f"{len(doubled)} jobs ran more than once"
    assert pending(app) == 0

    # the store is on 64 shards: every record in its home, the layout settled
    assert rclient.hgetall(f"{prefix}:layout") == {"shards": "64", "bucket_ms": "0"}
    store = get_store(make_app(redis_url, uid, **{**CONF, "delayed_shards": 64}))
    for job_id in everything:
        rec = store.lookup.get(job_id)
        assert int(rec["shard"]) == shard_for(rec.get("sk") or job_id, 64), job_id
    released = [int(store.lookup.get(j)["released"]) for j in ordered]
    assert released == sorted(released), "jobs of one shard key were released out of due order"
    for s in scheds:
        assert "the store's layout is now 64 shards" in s.output(), s.output()[-2000:]
