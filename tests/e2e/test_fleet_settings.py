"""A scheduler whose settings disagree with the store's (or the fleet's) refuses to start and takes no shard."""

from __future__ import annotations

import time

import pytest
from support import SchedulerProcess, make_app, ran, wait_for

from celery_delayed import apply_later_many, get_store
from celery_delayed.store import ShardStatus


@pytest.mark.e2e
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("conf", "needle"), [
    ({"delayed_shards": 8}, "delayed_shards is 8, but the store under prefix"),
    ({"delayed_lease_ms": 10_000}, "every scheduler of one store must use the same delayed_lease_ms"),
])
def test_a_misconfigured_scheduler_refuses_to_join(redis_url, uid, workers, rclient, conf, needle):
    app = make_app(redis_url, uid, delayed_shards=16)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    healthy = SchedulerProcess(redis_url, prefix, queue, conf={"delayed_shards": 16})
    workers.append(healthy)
    get_store(app).layout.check()  # the store is created with 16 shards
    wait_for(lambda: "holds 16 shard(s) of 16" in healthy.output(), 30, what="the healthy scheduler")

    wrong = SchedulerProcess(redis_url, prefix, queue, conf={"delayed_shards": 16, **conf})
    workers.append(wrong)
    wrong.proc.wait(30)
    out = wrong.output()
    assert wrong.proc.returncode == 1, out[-3000:]
    assert needle in out, out[-3000:]
    assert "Traceback" not in out
    assert "holds" not in out  # it never joined: no shard was ever its
    # The healthy one lost nothing and releases everything due.
    time.sleep(0.5)
    assert "lost" not in healthy.output()
    hs = apply_later_many(app, "e2e.mark", ({"args": (i,), "when": 0} for i in range(64)), strict=False)
    wait_for(lambda: rclient.llen(queue) == 64, 20, what="all 64 due jobs released")
    assert sum(r["pending"] for r in ShardStatus(get_store(app)).rows()) == 0
    assert len({h.shard for h in hs}) > 8 and ran(rclient, prefix) == []
