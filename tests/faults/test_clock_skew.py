"""Scenario 6: app servers and schedulers whose clocks are off by +/-30 s release nothing early.

Two schedulers run with ``time.time()`` shifted by +30 s and -30 s (skewed.py);
the test process schedules with its own clock shifted as well (``time.time``
and ``time.time_ns``, as skewed.py does), three ways: relative delays (added
to the Redis clock by the script), absolute datetimes (an instant the app was
asked for, e.g. "at 12:00:05": its due time is that instant, whatever the
app's clock says) and a relative ``expires`` (seconds from the call). Due-ness
is decided by the Redis server's clock: every job is released no earlier than
its look-ahead window (``delayed_lookahead_ms`` before its due time, with
Celery's eta set to the due time by the Redis clock) and starts at or after its
due time, and is not held back by the slow clock either.
"""

from __future__ import annotations

import re
import sys
import time
from datetime import datetime, timezone

import pytest
from harness import HERE, FaultRun
from support import make_app

from celery_delayed import apply_later, apply_later_many, get_store

pytestmark = pytest.mark.e2e

SKEW_S = 30.0
JOBS = 300


@pytest.mark.timeout(120)
def test_skewed_clocks_release_nothing_early(monkeypatch: pytest.MonkeyPatch) -> None:
    with FaultRun(seed=8, conf={"delayed_lease_ms": 2000, "delayed_shards": 8}) as run:
        launcher = [sys.executable, str(HERE / "skewed.py")]
        for skew in (+SKEW_S, -SKEW_S):
            run.scheduler(launcher=launcher, extra_env={"SKEW_S": str(skew)})
        run.wait_ready(run.worker(concurrency=8))
        real, real_ns = time.time, time.time_ns
        ids: list[str] = []
        asked_ms: dict[str, int] = {}  # absolute datetimes: the instant asked for
        for skew in (+SKEW_S, -SKEW_S):
            monkeypatch.setattr(time, "time", lambda s=skew: real() + s)
            monkeypatch.setattr(time, "time_ns", lambda s=skew: real_ns() + int(s * 1e9))
            calls = [{"args": (i,), "when": 1.0 + 3.0 * i / JOBS} for i in range(JOBS // 4)]
            ids += [h.id for h in apply_later_many(run.app, "fault.run", calls, strict=False)]
            instants = [datetime.fromtimestamp(real() + 1.0 + 3.0 * i / JOBS, tz=timezone.utc)
                        for i in range(JOBS // 4)]
            hs = apply_later_many(run.app, "fault.run", [{"args": (i,), "when": at} for i, at in enumerate(instants)],
                                  strict=False)
            for h, at in zip(hs, instants, strict=True):
                asked_ms[h.id] = int(at.timestamp() * 1000)
            ids += [h.id for h in hs]
        monkeypatch.setattr(time, "time", real)
        monkeypatch.setattr(time, "time_ns", real_ns)
        assert run.wait_executed(ids, 60)
        store = run.store()
        window = store.config.lookahead_ms
        early, late_ms = 0, []
        for i in ids:
            rec = store.lookup.get(i)
            due, released = int(rec["due"]), int(rec["released"])
            early += released < due - window
            late_ms.append(released - due)
        started = {i: t for i, _, _, t in run.runs("start")}
        early_start = sum(1 for i in ids if started[i] * 1000 < int(store.lookup.get(i)["due"]))
        late_ms.sort()
        out = run.outcome("clock skew +/-30 s (schedulers and app)", ids, 2)
        out.notes.update(released_early=early, started_early=early_start,
                         p50_late_ms=late_ms[len(late_ms) // 2], max_late_ms=late_ms[-1])
        out.report()
        assert early == 0 and early_start == 0, out.line()
        # An absolute datetime is that instant, exactly: the app's clock was not consulted.
        assert len(asked_ms) == JOBS // 2
        assert {i: int(store.lookup.get(i)["due"]) for i in asked_ms} == asked_ms
        assert late_ms[-1] < 2000, "a skewed scheduler held jobs back"
        assert out.lost == 0 and out.duplicated == 0
        # Both skewed schedulers took part, and their clocks really were off: their log
        # timestamps (time.time()) are SKEW_S away from this process's real clock.
        for p in run.procs:
            if p.kind != "scheduler":
                continue
            log = p.output()
            assert "holds" in log, log[-2000:]
            stamp = re.search(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+", log, re.MULTILINE)
            assert stamp is not None
            shown = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            skew = float(p.spec[1]["SKEW_S"])
            assert abs(shown - (p.started_at + skew)) < 10, (shown, p.started_at, skew)


@pytest.mark.parametrize("skew", [+SKEW_S, -SKEW_S])
def test_relative_expires_is_counted_from_the_redis_clock(redis_url: str, uid: str, skew: float,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``expires=20`` (seconds from the call) on an app server whose clock is off by 30 s:
    released at once, the job is sent, and it expires 20 s after the call by the Redis clock."""
    app = make_app(redis_url, uid)
    store = get_store(app)
    real, real_ns = time.time, time.time_ns
    called_ms = store.redis.now_ms()
    monkeypatch.setattr(time, "time", lambda: real() + skew)
    monkeypatch.setattr(time, "time_ns", lambda: real_ns() + int(skew * 1e9))
    h = apply_later(app, "fault.run", when=0, expires=20, strict=False)
    monkeypatch.setattr(time, "time", real)
    monkeypatch.setattr(time, "time_ns", real_ns)
    exp = int(store.lookup.get(h.id)["exp"])
    batch = store.release.release_due(h.shard)  # at once, by the Redis clock: 20 s before it expires
    assert batch.ids == [h.id]
    assert store.lookup.get(h.id)["st"] == "QUEUED", store.lookup.get(h.id).get("reason")
    assert abs(exp - (called_ms + 20_000)) < 2_000, f"expires {exp - called_ms} ms after the call"
