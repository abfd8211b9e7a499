"""A slot of the store's Redis Cluster migrates to another master under load (resharding; issue 13).

While a slot migrates (``CLUSTER SETSLOT <slot> IMPORTING`` on the target,
``MIGRATING`` on the source, keys moved by ``MIGRATE`` in batches, then
``SETSLOT <slot> NODE``), a command on a key already moved gets an ``ASK``
redirection, which redis-py follows. A script names several keys, some of
which do not exist (a new job's record): Redis answers it ``TRYAGAIN`` on
either side until the slot is handed over. The command did not run, so
the store's cluster client tries it again for a few seconds
(``StoreCluster``); past that, the caller gets ``StoreUnavailable`` saying
nothing was written, and calls again. Either way no job is lost or doubled.
"""

from __future__ import annotations

import collections
import shutil
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from redis.cluster import RedisCluster
from support import SchedulerProcess, WorkerProcess, make_app, need, wait_for

from celery_delayed import apply_later, apply_later_many, cancel, get_store
from celery_delayed.errors import DuplicateJob, StoreUnavailable
from celery_delayed.testing import RedisClusterServers

pytestmark = pytest.mark.e2e


@pytest.fixture
def private_cluster() -> Iterator[RedisClusterServers]:
    """A cluster of this test's own: its slots are moved."""
    need("redis-server and redis-cli (Redis Cluster)",
         shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None)
    with RedisClusterServers(masters=3) as cluster:
        yield cluster


class SlotMigration:
    """Moves one slot from its master to another, the way ``redis-cli --cluster reshard`` does."""

    def __init__(self, cluster: RedisClusterServers, slot: int) -> None:
        self.slot = slot
        self.nodes = {n.port: redis.Redis(port=n.port, decode_responses=True) for n in cluster.nodes}
        self.ids = {p: str(c.execute_command("CLUSTER", "MYID")) for p, c in self.nodes.items()}
        owner = next(r for r in self.nodes[cluster.nodes[0].port].execute_command("CLUSTER", "SLOTS")
                     if int(r[0]) <= slot <= int(r[1]))
        self.src = int(owner[2][1])
        self.dst = next(p for p in self.nodes if p != self.src)
        self.batches = self.moved = 0

    def begin(self) -> None:
        self.nodes[self.dst].execute_command("CLUSTER", "SETSLOT", self.slot, "IMPORTING", self.ids[self.src])
        self.nodes[self.src].execute_command("CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.ids[self.dst])

    def keys_left(self) -> int:
        return int(self.nodes[self.src].execute_command("CLUSTER", "COUNTKEYSINSLOT", self.slot))

    def move_batch(self, size: int) -> int:
        """MIGRATE up to ``size`` keys of the slot to the target; return how many."""
        keys = self.nodes[self.src].execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, size)
        if keys:
            self.nodes[self.src].execute_command("MIGRATE", "127.0.0.1", self.dst, "", 0, 5000, "KEYS", *keys)
            self.batches += 1
            self.moved += len(keys)
        return len(keys)

    def finish(self) -> None:
        """Hand the slot over: the target first, then the source, then the others (as redis-cli does)."""
        order = [self.dst, self.src, *(p for p in self.nodes if p not in (self.dst, self.src))]
        for port in order:
            self.nodes[port].execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", self.ids[self.dst])

    def close(self) -> None:
        for c in self.nodes.values():
            c.close()


def runs(client: RedisCluster, prefix: str) -> collections.Counter[str]:
    return collections.Counter(str(x).split("|")[0] for x in client.lrange(f"{prefix}:ran", 0, -1))


def keys_of_shard(store, shard: int, n: int) -> list[str]:
    keys = (f"k{i}" for i in range(50 * n * store.config.shards))
    return [k for k in keys if store.layout.shard_of("", k) == shard][:n]


@pytest.mark.timeout(180)
def test_a_slot_migrates_while_jobs_are_scheduled_released_and_run(redis_url, uid, workers, private_cluster):
    url = private_cluster.url
    conf = {"delayed_redis_cluster": True, "delayed_lease_ms": 2000, "delayed_shards": 4}
    app = make_app(redis_url, uid, delayed_redis_url=url, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    store = get_store(app)
    cclient = RedisCluster.from_url(url, decode_responses=True)
    slot = cclient.keyslot(store.keys.shard(0).due)
    assert cclient.keyslot(f"{prefix}:ran") != slot
    move = SlotMigration(private_cluster, slot)
    hot = keys_of_shard(store, 0, 20)
    # The slot holds shard 0: jobs coming due over the migration, and far ones (records to move).
    due = [h.id for h in apply_later_many(app, "e2e.plain", [
        {"args": (i,), "when": 2.0 + 8.0 * i / 600, "shard_key": hot[i % len(hot)]} for i in range(600)],
        strict=False)]
    others = [h.id for h in apply_later_many(app, "e2e.plain", [
        {"args": (i,), "when": 2.0 + 8.0 * i / 200} for i in range(200)], strict=False)]
    far = [h.id for h in apply_later_many(app, "e2e.mark", [
        {"when": 3600, "shard_key": hot[i % len(hot)]} for i in range(400)], strict=False)]
    w = WorkerProcess(redis_url, prefix, queue, store=url, conf=conf, concurrency=4, pool="threads")
    workers.append(w)
    sched = SchedulerProcess(redis_url, prefix, queue, store=url, conf=conf)
    workers.append(sched)
    w.wait_ready()

    # Producers keep scheduling into the migrating slot; a refusal past the client's patience is
    # StoreUnavailable ("nothing was written"): call again with the same task_id.
    produced: list[str] = []
    refusals = collections.Counter[str]()
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set():
            task_id = str(uuid.uuid4())
            while True:
                try:
                    apply_later(app, "e2e.plain", args=(i,), when=1.0, task_id=task_id,
                                shard_key=hot[i % len(hot)], strict=False)
                    break
                except DuplicateJob:  # written by a try whose reply was lost: fine
                    refusals["duplicate"] += 1
                    break
                except StoreUnavailable:
                    refusals["unavailable"] += 1
                    time.sleep(0.1)
            produced.append(task_id)
            i += 1
            time.sleep(0.01)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    time.sleep(2.5)  # jobs of the slot coming due: the scheduler releases, the worker runs them
    started = time.monotonic()
    move.begin()
    while move.move_batch(20):
        time.sleep(0.045)  # about 3 s: longer than a scheduler thread's patience, shorter than a producer's
    move.finish()
    window_s = time.monotonic() - started
    time.sleep(1.0)
    stop.set()
    producer.join(30)
    retried = store.redis.client.migration_retries  # type: ignore[attr-defined]
    assert move.keys_left() == 0
    assert RedisCluster.from_url(url).get_node_from_key(store.keys.shard(0).due).port == move.dst
    want = set(due) | set(others) | set(produced)
    wait_for(lambda: set(runs(cclient, prefix)) >= want, 90, interval=0.3, what=f"{len(want)} jobs to run")
    time.sleep(1.0)
    w.stop()
    counts = runs(cclient, prefix)
    lost = want - set(counts)
    twice = [i for i in want if counts[i] > 1]
    trouble = [line for line in sched.output().splitlines() if "unavailable" in line]
    print(f"\nslot {slot} (shard 0) moved from :{move.src} to :{move.dst}: {move.moved} keys in {move.batches} "
          f"batches over {window_s:.2f}s; {len(produced)} jobs scheduled meanwhile ({dict(refusals)} refusals "
          f"past the client's patience, {retried} tries again within it); {len(want)} jobs: {len(lost)} lost, "
          f"{len(twice)} ran twice; scheduler outage lines: {len(trouble)}")
    assert move.moved >= 1000, "the slot should hold the records of shard 0's jobs"
    assert retried > 0, "the producers never met the migration"
    assert not lost
    assert not twice
    assert set(counts) == want
    # The far jobs moved with their slot: they are there, and cancelled on the new master.
    for i in far[:50]:
        assert cancel(app, i) == "SCHEDULED"
    assert {store.lookup.get(i)["st"] for i in far[:50]} == {"CANCELLED"}
    assert {store.lookup.get(i)["st"] for i in far[50:]} == {"SCHEDULED"}
    move.close()
    cclient.close()


@pytest.mark.timeout(90)
def test_a_migration_longer_than_the_patience_is_unavailable_and_the_same_call_succeeds_after(
        redis_url, uid, private_cluster):
    """Half a slot moved and the migration stalled: reads follow ASK; a script is refused with a typed
    error (nothing written) once the client's patience is over; after the hand-over the same call works."""
    url = private_cluster.url
    app = make_app(redis_url, uid, delayed_redis_url=url, delayed_redis_cluster=True, delayed_shards=4)
    store = get_store(app)
    cclient = RedisCluster.from_url(url, decode_responses=True)
    move = SlotMigration(private_cluster, cclient.keyslot(store.keys.shard(0).due))
    hot = keys_of_shard(store, 0, 10)
    jobs = [apply_later(app, "e2e.mark", when=3600, shard_key=hot[i % 10], strict=False) for i in range(100)]
    move.begin()
    move.move_batch(60)
    store.redis.client.patience_s = 1.0  # type: ignore[attr-defined]
    # Reads of one key each: on the source, or ASKed to the target.
    assert {store.lookup.get(h.id)["st"] for h in jobs} == {"SCHEDULED"}
    began = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"while a slot of it migrates.*nothing was written"):
        apply_later(app, "e2e.mark", when=60, task_id=f"again-{uid}", shard_key=hot[0], strict=False)
    assert 1.0 <= time.monotonic() - began < 5.0
    with pytest.raises(StoreUnavailable, match="nothing was written"):
        cancel(app, jobs[0].id)
    assert store.lookup.get(jobs[0].id)["st"] == "SCHEDULED"
    while move.move_batch(50):
        pass
    move.finish()
    h = apply_later(app, "e2e.mark", when=60, task_id=f"again-{uid}", shard_key=hot[0], strict=False)
    assert h.id == f"again-{uid}" and store.lookup.get(h.id)["st"] == "SCHEDULED"
    assert cancel(app, jobs[0].id) == "SCHEDULED"
    # Written once: a second call finds it.
    with pytest.raises(DuplicateJob):
        apply_later(app, "e2e.mark", when=60, task_id=f"again-{uid}", shard_key=hot[0], strict=False)
    move.close()
    cclient.close()
