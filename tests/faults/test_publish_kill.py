"""Scenario 2: the publish path on RabbitMQ. Schedulers SIGKILL themselves after publishing a batch
and before acknowledging it (a test hook makes the window deterministic); their claims expire,
the jobs are claimed and published again: 0 lost, and the worker-side execution record drops the duplicates."""

from __future__ import annotations

import time

import pytest
from harness import FaultRun
from support import need, port_open

pytestmark = pytest.mark.e2e

JOBS = 2000
SPREAD_S = 5.0


@pytest.mark.timeout(180)
def test_publish_path_sigkill_between_publish_and_ack() -> None:
    need("RabbitMQ on 127.0.0.1:5672", port_open("127.0.0.1", 5672))
    conf = {"delayed_lease_ms": 1000, "delayed_claim_lease_ms": 1000, "delayed_batch_size": 50,
            "delayed_shards": 4}
    with FaultRun(seed=2, conf=conf, broker="amqp://guest:guest@127.0.0.1:5672//") as run:
        assert not run.store().broker.direct
        ids = run.schedule(JOBS, 1.0, SPREAD_S)
        # Each life of a scheduler publishes 2 batches, then dies before acking its 3rd.
        for _ in range(2):
            run.scheduler(extra_env={"FAULT_KILL_BEFORE_ACK": "3"})
        # A job that a worker starts is no longer CLAIMED, and claim_due does not publish it
        # again; so the worker starts late, while copies of unacked batches pile up.
        late = time.monotonic() + 4.0
        while time.monotonic() < late:
            run.supervise()
            time.sleep(0.1)
        run.wait_ready(run.worker(concurrency=8))
        deadline = time.monotonic() + SPREAD_S + 60
        while time.monotonic() < deadline and not run.wait_executed(ids, 0.5):
            run.supervise()  # a process manager restarts the dead schedulers
        assert run.wait_executed(ids, 1), f"{len(set(ids) - set(run.counts()))} jobs never ran"
        time.sleep(1.0)
        deaths = sum(1 for p in run.procs if p.kind == "scheduler" and p.proc.returncode == -9)
        out = run.outcome("publish path (RabbitMQ): SIGKILL between publish and ack", ids, deaths)
        out.report()
        assert deaths >= 5
        assert out.lost == 0 and out.duplicated == 0, out.line()
        assert out.delivered_twice > 0, "the window never opened: no job was published twice"
        assert run.store_problems() == []
        assert run.pending() == 0
        with run.app.connection_for_write() as conn:  # type: ignore[union-attr]
            conn.default_channel.queue_delete(run.queue)
