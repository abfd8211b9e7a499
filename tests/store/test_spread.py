"""``spread=``: each job placed at a deterministic offset within a window after its due time."""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from support import make_app

from celery_delayed import DelayedTask, InvalidOption, apply_later, apply_later_many, get_store
from celery_delayed.producer.spread import offset_ms

pytestmark = pytest.mark.timeout(60)

HOUR_MS = 3_600_000


@pytest.fixture
def tapp(redis_url: str, uid: str) -> Celery:
    app = make_app(redis_url, uid, delayed_shards=4)

    @app.task(base=DelayedTask, name="spread.remind", shared=False)
    def remind(user: Any) -> None:
        return None

    @app.task(base=DelayedTask, name="spread.digest", shared=False, delayed_spread=60)
    def digest(user: Any) -> None:
        return None

    return app


def record(app: Celery, job_id: str) -> dict[str, str]:
    store = get_store(app)
    key = store.keys.shard(store.lookup.locate(job_id)).job(job_id)
    return {str(k): str(v) for k, v in store.redis.client.hgetall(key).items()}


def eta_header(app: Celery, job_id: str) -> str:
    store = get_store(app)
    env = json.loads(store.lookup.message(job_id, store.lookup.locate(job_id)) or "{}")
    return str(env["headers"]["delayed_eta"])


def test_the_offset_is_the_ids_own_and_spreads_evenly_over_the_window():
    assert offset_ms("a-job", 60_000) == offset_ms("a-job", 60_000)
    offsets = [offset_ms(f"job-{i}", 10_000) for i in range(20_000)]
    assert min(offsets) >= 0 and max(offsets) < 10_000
    per_second = Counter(o // 1000 for o in offsets)
    assert len(per_second) == 10 and min(per_second.values()) > 1800 and max(per_second.values()) < 2200
    assert offset_ms("a-job", 0) == 0


def test_a_flood_due_at_one_moment_becomes_a_ramp_with_each_offset_in_the_record(tapp: Celery):
    midnight = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=2)
    at = int(midnight.timestamp() * 1000)
    handles = apply_later_many(tapp, "spread.remind", ({"args": (u,), "when": midnight} for u in range(2000)),
                               spread=600)
    dues = [h.due_ms for h in handles]
    assert min(dues) >= at and max(dues) < at + 600_000
    assert len({(d - at) // 60_000 for d in dues}) == 10  # every minute of the ten gets its share
    for h in handles[:50]:
        rec = record(tapp, h.id)
        assert int(rec["due"]) == at + int(rec["spr"]) == h.due_ms
        assert int(rec["spr"]) == offset_ms(h.id, 600_000)
        # the task sees the moment it was placed at as its eta
        assert datetime.fromisoformat(eta_header(tapp, h.id)).timestamp() * 1000 == pytest.approx(h.due_ms, abs=1)


def test_one_call_an_idempotency_key_and_a_relative_when(tapp: Celery):
    task = tapp.tasks["spread.remind"]
    h = task.apply_later(args=(1,), when=timedelta(hours=1), spread=timedelta(minutes=5))
    rec = record(tapp, h.id)
    offset = int(rec["spr"])
    assert offset == offset_ms(h.id, 300_000)
    assert int(rec["due"]) - int(rec["created"]) == pytest.approx(HOUR_MS + offset, abs=50)
    # The same key is the same job, at the same offset, however often it is asked for.
    k1 = task.apply_later(args=(2,), when=3600, spread=300, idempotency_key="user-2-reminder")
    k2 = task.apply_later(args=(2,), when=3600, spread=300, idempotency_key="user-2-reminder")
    assert k1.id == k2.id and not k2.created
    assert int(record(tapp, k1.id)["spr"]) == offset_ms(k1.id, 300_000)
    # Options take the regular path: spread there too.
    o = task.apply_later(args=(3,), when=3600, spread=300, queue="other", priority=3)
    assert int(record(tapp, o.id)["spr"]) == offset_ms(o.id, 300_000)


def test_a_time_already_past_is_spread_from_now(tapp: Celery):
    before = time.time() * 1000
    handles = apply_later_many(tapp, "spread.remind", [{"args": (u,), "when": 0} for u in range(200)], spread=30)
    assert all(before <= h.due_ms < before + 30_000 + 1000 for h in handles)
    past = datetime.now(timezone.utc) - timedelta(days=1)
    h = apply_later(tapp, "spread.remind", (1,), when=past, spread=30)
    assert before <= h.due_ms < time.time() * 1000 + 30_000


def test_the_tasks_delayed_spread_is_the_default_and_a_call_overrides_it(tapp: Celery):
    digest = tapp.tasks["spread.digest"]
    h = digest.apply_later(args=(1,), when=3600)
    assert int(record(tapp, h.id)["spr"]) == offset_ms(h.id, 60_000)
    many = digest.apply_later_many([{"args": (u,), "when": 3600} for u in range(5)])
    assert all(int(record(tapp, m.id)["spr"]) == offset_ms(m.id, 60_000) for m in many)
    none = digest.apply_later(args=(1,), when=3600, spread=0)
    assert "spr" not in record(tapp, none.id) or record(tapp, none.id)["spr"] == ""
    own = digest.apply_later_many([{"args": (1,), "when": 3600, "spread": 10}])[0]
    assert int(record(tapp, own.id)["spr"]) == offset_ms(own.id, 10_000)
    plain = tapp.tasks["spread.remind"].apply_later(args=(1,), when=3600)
    assert "spr" not in record(tapp, plain.id)


@pytest.mark.parametrize("spread", [-1, float("nan"), float("inf"), "60", True, 10**12])
def test_a_bad_spread_is_refused_and_stores_nothing(tapp: Celery, spread: Any):
    with pytest.raises(InvalidOption, match="spread"):
        apply_later(tapp, "spread.remind", (1,), when=60, spread=spread)
    with pytest.raises(InvalidOption, match="spread"):
        apply_later_many(tapp, "spread.remind", [{"args": (1,), "when": 60}], spread=spread)
    store = get_store(tapp)
    assert all(not page for s in range(store.config.shards) for page in store.lookup.scheduled_pages(s))


def test_a_debounced_or_throttled_job_takes_no_spread(tapp: Celery):
    with pytest.raises(InvalidOption, match="spread does not apply"):
        apply_later(tapp, "spread.remind", (1,), when=60, debounce_key="k", spread=10)
    with pytest.raises(InvalidOption, match="spread does not apply"):
        apply_later(tapp, "spread.remind", (1,), when=60, throttle_key="k", window=10, spread=10)


def test_with_a_database_the_row_keeps_the_offset(redis_url: str, uid: str, database_url: str):
    from celery_delayed.sql.rows import get_rows

    app = make_app(redis_url, uid, delayed_database_url=database_url)
    rows = get_rows(app)
    assert rows is not None
    rows.init_schema()
    try:
        h = apply_later(app, "spread.any", (1,), when=3600, spread=120, strict=False)
        row = rows.get(h.id)
        assert row is not None
        assert int(row.record["spr"]) == offset_ms(h.id, 120_000)
        assert row.due_ms == h.due_ms
    finally:
        rows.dispose()
