"""Helpers of the release-shaping end-to-end tests (rate limits and tenants, ``tests/e2e`` and ``tests/cluster``).

The fleet's promise is checked from the job records: ``released`` is the Redis
clock when a release script moved the job (on the publish path, when the
scheduler acknowledged the publish). Over sliding windows the fleet releases
at most the rate plus the burst every shard may hold (half a second of its
share, at least one token).
"""

from __future__ import annotations

import bisect
import collections
import math
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery import Celery

from celery_delayed import apply_later_many, get_store
from celery_delayed.store import shard_for

from .delivery import claims, received
from .processes import SchedulerProcess, WorkerProcess, ran, wait_for

#: The limited task (a DelayedTask) and a task no limit applies to, both from ``worker_apps/e2e_app.py``.
LIMITED = "e2e.mark"
FREE = "e2e.plain"
#: Slack on a rate: the Redis clock in ms, the scripts' rounding, a window's edges.
RATE_SLACK = 0.05


# -- helpers --------------------------------------------------------------------------------------------------------


def burst(rate: float, shards: int) -> float:
    """The most tokens the fleet holds when full: each shard's bucket holds 500 ms of its share, at least one."""
    return shards * max(1.0, rate / shards * 0.5)


def most_in_window(times_ms: Sequence[int], window_ms: int) -> int:
    """The most releases in any window of ``window_ms`` (each window starting at a release)."""
    ts = sorted(times_ms)
    return max((bisect.bisect_left(ts, t + window_ms) - i for i, t in enumerate(ts)), default=0)


def assert_within_rate(times_ms: Sequence[int], rate: float, shards: int, windows_s: Iterable[float] = (1.0, 3.0),
                       what: str = "") -> None:
    """In every window, at most the rate (with a little slack) plus the fleet's burst."""
    for w in windows_s:
        most = most_in_window(times_ms, int(w * 1000))
        allowed = rate * w * (1 + RATE_SLACK) + burst(rate, shards) + 1
        assert most <= allowed, f"{what}{most} releases within {w} s, at most {allowed:.1f} allowed at {rate}/s"


@dataclass
class Released:
    """What the job records say of a released job."""

    id: str
    shard: int
    due: int
    released: int
    tenant: str

    @property
    def late(self) -> int:
        return self.released - self.due


def fields(app: Celery, ids: Sequence[str], *names: str, shard_key: str | None = None) -> dict[str, list[Any]]:
    """``names`` of each job's record (all with ``shard_key``, or none), in one round trip; the layout read afresh."""
    store = get_store(app)
    store.layout.reload()
    pipe = store.redis.client.pipeline(transaction=False)
    for i in ids:
        pipe.hmget(store.keys.shard(store.layout.shard_of(i, shard_key)).job(i), *names)
    return dict(zip(ids, pipe.execute(), strict=True))


def released_jobs(app: Celery, ids: Sequence[str], shard_key: str | None = None) -> list[Released]:
    """Each job's due and release time from its record (every job must have been released).

    On the publish path ``released`` is written when the scheduler acknowledges
    the publish; a job a worker started before that keeps no ``released``
    (ack_claimed.lua leaves a started job alone): its start time then stands
    for it, which lies between the claim (where the token was spent) and the ack.
    """
    layout = get_store(app).layout
    out = []
    for i, (due, rel, started, tn) in fields(app, ids, "due", "released", "started", "tn",
                                             shard_key=shard_key).items():
        at = rel or started
        assert at is not None, f"job {i} has no release time: {get_store(app).lookup.get(i)}"
        out.append(Released(i, layout.shard_of(i, shard_key), int(due), int(at), tn or ""))
    return out


def released_so_far(app: Celery, ids: Sequence[str]) -> list[int]:
    """The release times of the jobs released by now (ms)."""
    return [int(r or s) for r, s in fields(app, ids, "released", "started").values() if r or s]


def redis_ms(client: Any) -> int:
    """The Redis server's clock, epoch ms (the clock of every release time)."""
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


def lease_owners(client: Any, prefix: str, shards: int) -> list[str]:
    """The owner token holding each shard's lease ('' when none); one GET per shard (a cluster's slots differ)."""
    return [(client.get(f"{prefix}:{{{s}}}:lease") or "").rpartition("|")[0] for s in range(shards)]


def pid_of(owner: str) -> int:
    """The process id inside an owner token (host:pid:random)."""
    return int(owner.split(":")[-2])


def wait_shared(client: Any, prefix: str, shards: int, scheds: Sequence[SchedulerProcess], timeout: float = 60) -> None:
    """Until every shard is held, and by exactly these schedulers (each one holding some)."""
    pids = {s.pid for s in scheds}

    def shared() -> bool:
        for s in scheds:
            if s.proc.poll() is not None:
                raise AssertionError(f"scheduler exited: {s.output()[-3000:]}")
        owners = lease_owners(client, prefix, shards)
        return all(owners) and {pid_of(o) for o in owners} == pids

    wait_for(shared, timeout, interval=0.1, what=f"{len(scheds)} scheduler(s) to share {shards} shards")


def runs(client: Any, prefix: str) -> collections.Counter[str]:
    return collections.Counter(ran(client, prefix))


def wait_ran_once(client: Any, prefix: str, ids: Sequence[str], timeout: float) -> None:
    """Until every job ran; then (a moment later, when a second run would show) each exactly once."""
    want = set(ids)
    wait_for(lambda: want <= set(runs(client, prefix)), timeout, interval=0.2,
             what=f"{len(want)} jobs to run (ran: {len(want & set(runs(client, prefix)))})")
    time.sleep(0.5)
    counts = runs(client, prefix)
    twice = {i: n for i, n in counts.items() if i in want and n > 1}
    assert not twice, f"{len(twice)} jobs ran more than once"


def assert_delivered_once(app: Celery, worker: WorkerProcess, task: str, ids: Sequence[str]) -> None:
    """Each job's message reached the worker once (direct path: enqueued once), or, on the publish path, at
    most once per claim (a claim that outlived a dead scheduler is published again: the worker drops the copy).

    Counted from the worker's "received" lines, before any execution record could turn a copy into a skip;
    the worker is stopped first, so its log is complete.
    """
    worker.stop()
    got = received(worker.output(), task)
    assert set(got) >= set(ids), f"{len(set(ids) - set(got))} jobs never reached the worker"
    if get_store(app).layout.release_path[0] == "direct":
        twice = [i for i in ids if got[i] != 1]
        assert not twice, f"{len(twice)} jobs were enqueued more than once"
    else:
        published = claims(app, ids)
        odd = [i for i in ids if got[i] > published[i]]
        assert not odd, f"{len(odd)} jobs reached the worker more often than they were claimed"


def due_at(seconds_from_now: float) -> float:
    """An absolute due time (epoch seconds) a moment ahead: every job of a call due at the same instant."""
    return time.time() + seconds_from_now


def balanced_ids(n: int, shards: int) -> list[str]:
    """``n`` fresh job ids, as many in each shard (``n`` a multiple of ``shards``)."""
    per: dict[int, list[str]] = collections.defaultdict(list)
    while min((len(per[s]) for s in range(shards)), default=0) < n // shards:
        i = str(uuid.uuid4())
        per[shard_for(i, shards)].append(i)
    return [i for s in range(shards) for i in per[s][:n // shards]]


def schedule(app: Celery, task: str, n: int, when_epoch: float, tenant: str | None = None,
             ids: Sequence[str] | None = None) -> list[str]:
    """``n`` jobs of ``task`` due at one instant (``ids``: their task ids, else fresh ones)."""
    when = datetime.fromtimestamp(when_epoch, tz=timezone.utc)
    calls: list[dict[str, Any]] = [{"args": (i,), "when": when} for i in range(n)]
    if ids is not None:
        for c, i in zip(calls, ids, strict=True):
            c["task_id"] = i
    return [h.id for h in apply_later_many(app, task, calls, strict=False, tenant=tenant)]


@dataclass
class Fleet:
    """A worker and some schedulers of one app (the processes are stopped by the ``workers`` fixture)."""

    app: Celery
    worker: WorkerProcess
    scheds: list[SchedulerProcess]

    @property
    def prefix(self) -> str:
        return str(self.app.conf.delayed_key_prefix)


def start_fleet(workers: list[Any], app: Celery, broker: str, client: Any, conf: dict[str, Any], schedulers: int,
                store: str | None = None) -> Fleet:
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(broker, prefix, queue, store=store, conf=conf, concurrency=8, pool="threads")
    workers.append(w)
    scheds = [SchedulerProcess(broker, prefix, queue, store=store, conf=conf) for _ in range(schedulers)]
    workers.extend(scheds)
    wait_shared(client, prefix, int(conf.get("delayed_shards", 16)), scheds)  # (16: the default)
    w.wait_ready(60)
    return Fleet(app, w, scheds)


def summary(jobs: Sequence[Released], rate: float) -> str:
    times = sorted(j.released for j in jobs)
    span = (times[-1] - times[0]) / 1000
    return f"{len(jobs)} jobs released over {span:.2f} s ({len(jobs) / rate:.2f} s at {rate}/s)"



def p99(values: Sequence[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, math.ceil(0.99 * len(v)) - 1)]


def check_tenants_fair(app: Celery, flood: Sequence[str], small: Sequence[str], batch: int, what: str,
                       max_late_ms: int = 500, contrast: bool = True) -> None:
    """The small tenant's jobs went in the first batch of their shard (fewer than ``batch`` jobs of the flood
    in that shard before each), within ``max_late_ms`` of their due time (p99); with ``contrast``, overtaking
    most of the flood (due with them: in due order they would have waited for their part of it), which went
    on much longer."""
    little = released_jobs(app, small)
    big = released_jobs(app, flood)
    assert {j.tenant for j in little} == {"small"} and {j.tenant for j in big} == {"big"}
    by_shard: dict[int, list[int]] = collections.defaultdict(list)
    for j in big:
        by_shard[j.shard].append(j.released)
    ahead = {j.id: sum(1 for t in by_shard[j.shard] if t < j.released) for j in little}
    late = [j.late for j in little]
    due, out = min(j.due for j in little), max(j.released for j in little)
    flood_end = max(j.released for j in big)
    after = sum(1 for j in big if j.released > out)
    print(f"\n{what}: the small tenant's {len(little)} jobs late by {sorted(late)} ms, behind at most "
          f"{max(ahead.values())} of the flood in their shard; {after} of the flood's {len(big)} jobs released "
          f"after them, the last {(flood_end - due) / 1000:.2f} s after they were due")
    assert max(ahead.values()) < batch, f"not in the first batch of their shard: {ahead}"
    assert p99(late) < max_late_ms, f"the small tenant's jobs were late by {sorted(late)} ms"
    if contrast:
        assert after >= len(big) // 2, "the small tenant's jobs did not overtake the flood"
        assert flood_end - due >= 2 * max(late), "the flood was too short to show anything"
