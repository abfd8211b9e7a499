"""Release shaping in the release scripts: rate limits (token buckets per shard) and fairness between tenants.

Each test drives ``release_due`` / ``claim_due`` with its own clock (``now_ms``),
the way a scheduler calls them: again at ``hold_ms`` when jobs wait for a token.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from support import make_app

from celery_delayed import ConfigurationError, DelayedTask, InvalidOption, apply_later, apply_later_many, get_store
from celery_delayed.store import Store

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def tapp(redis_url: str, uid: str) -> Celery:
    app = make_app(redis_url, uid, delayed_shards=1, delayed_rate_limits={"shape.sms": "10/s"})

    @app.task(base=DelayedTask, name="shape.sms", shared=False)
    def sms(n: Any) -> None:
        return None

    @app.task(base=DelayedTask, name="shape.mail", shared=False)
    def mail(n: Any) -> None:
        return None

    return app


def ago(seconds: float) -> datetime:
    return datetime.now(timezone.utc) - timedelta(seconds=seconds)


def rec(store: Store, job_id: str) -> dict[str, str]:
    return store.lookup.records(0, [job_id])[job_id]


def now_ms() -> int:
    return int(time.time() * 1000)


def drain(store: Store, start: int, *, claim: bool = False, limit: int = 500, lookahead_ms: int = 0,
          until: int | None = None) -> list[tuple[int, str]]:
    """Release like a scheduler from ``start`` (ms) on: again at once when more is due, at ``hold_ms`` when jobs
    wait for a token; (time, id) per job released, until nothing is left (or past ``until``)."""
    out: list[tuple[int, str]] = []
    t = start
    for _ in range(10_000):
        if claim:
            b = store.release.claim_due(0, now_ms=t, limit=limit, lookahead_ms=lookahead_ms)
            store.release.ack_claimed(0, b.ids, now_ms=t)
        else:
            b = store.release.release_due(0, now_ms=t, limit=limit, lookahead_ms=lookahead_ms)
        out += [(t, i) for i in b.ids]
        if b.count + b.skipped >= limit:
            continue
        if b.hold_ms is None or (until is not None and b.hold_ms > until):
            return out
        assert b.hold_ms >= t, "a wait for a token must lie ahead"
        t = max(t, b.hold_ms)
    raise AssertionError("the release never finished")


@pytest.mark.parametrize("claim", [False, True], ids=["direct", "publish"])
def test_a_limit_releases_its_jobs_at_its_rate_in_due_order(tapp: Celery, claim: bool):
    store = get_store(tapp)
    results = [apply_later(tapp, "shape.sms", (i,), when=ago((100 - i) / 1000)) for i in range(50)]
    t0 = now_ms()
    released = drain(store, t0 + 1000, claim=claim)
    assert [i for _, i in released] == [r.id for r in results], "due order"
    span = released[-1][0] - released[0][0]
    # 50 jobs at 10/s: a burst of at most half a second's share (5), then one per 100 ms
    assert 4400 <= span <= 5000, span
    for a, b in zip(released, released[10:], strict=False):
        assert b[0] - a[0] >= 500, "never more than 10 within a second plus the burst"


def test_a_held_back_job_stays_pending_and_counts_as_waiting(tapp: Celery):
    store = get_store(tapp)
    results = [apply_later(tapp, "shape.sms", (i,), when=ago(1)) for i in range(20)]
    t0 = now_ms()
    b = store.release.release_due(0, now_ms=t0)
    assert b.count == 5 and b.hold_ms is not None and t0 < b.hold_ms <= t0 + 100
    assert store.shaping.waiting() == {"shape.sms": 15}
    held = next(r for r in reversed(results) if rec(store, r.id).get("lw"))  # (jobs due in one ms tie)
    assert rec(store, held.id)["st"] == "SCHEDULED"
    assert rec(store, held.id).get("lw") == "shape.sms"
    [row] = store.shaping.limits()
    assert (row.key, row.per_second, row.source, row.waiting) == ("shape.sms", 10.0, "app", 15)
    # a cancel takes it out of the wait set
    assert held.cancel()
    assert store.shaping.waiting() == {"shape.sms": 14}
    released = drain(store, t0 + 100)
    assert len(released) == 14 and held.id not in {i for _, i in released}
    assert store.shaping.waiting() == {}


def test_jobs_without_a_limit_are_not_queued_behind_limited_ones(tapp: Celery):
    store = get_store(tapp)
    limited = [apply_later(tapp, "shape.sms", (i,), when=ago(2)) for i in range(30)]
    free = [apply_later(tapp, "shape.mail", (i,), when=ago(1)) for i in range(5)]
    t0 = now_ms()
    b = store.release.release_due(0, now_ms=t0)
    assert {r.id for r in free} <= set(b.ids)
    assert len(set(b.ids) & {r.id for r in limited}) == 5


def test_a_limit_changed_at_run_time_applies_on_the_next_release(tapp: Celery):
    store = get_store(tapp)
    for i in range(40):
        apply_later(tapp, "shape.sms", (i,), when=ago(1))
    t0 = now_ms()
    assert store.release.release_due(0, now_ms=t0).count == 5
    store.shaping.set_limit("shape.sms", "1/s")
    assert [(r.key, r.per_second, r.source) for r in store.shaping.limits()] == [("shape.sms", 1.0, "runtime")]
    b = store.release.release_due(0, now_ms=t0 + 100)  # no token left at t0, a tenth of one since
    assert b.count == 0 and b.hold_ms is not None and b.hold_ms >= t0 + 500
    store.shaping.set_limit("shape.sms", 0)  # lifted: every waiting job goes
    b = store.release.release_due(0, now_ms=t0 + 600)
    assert b.count == 35 and store.shaping.waiting() == {}
    store.shaping.set_limit("shape.sms", None)  # back to the app's 10/s
    assert store.shaping.runtime_limits() == {}
    assert [(r.key, r.source) for r in store.shaping.limits()] == [("shape.sms", "app")]
    with pytest.raises(ConfigurationError, match="not a rate"):
        store.shaping.set_limit("shape.sms", "fast")
    with pytest.raises(ConfigurationError, match="key form"):
        store.shaping.set_limit("qeue:x", "1/s")


def test_a_limited_job_is_not_released_a_look_ahead_early(tapp: Celery):
    store = get_store(tapp)
    t0 = now_ms()
    limited = apply_later(tapp, "shape.sms", (1,), when=1.0)
    free = apply_later(tapp, "shape.mail", (1,), when=1.0)
    b = store.release.release_due(0, now_ms=t0, lookahead_ms=2000)
    assert b.ids == [free.id]
    assert b.hold_ms is not None and b.hold_ms >= limited.due_ms - 5  # type: ignore[operator]
    assert rec(store, limited.id)["st"] == "SCHEDULED"
    b = store.release.release_due(0, now_ms=b.hold_ms, lookahead_ms=2000)
    assert b.ids == [limited.id]


def test_queue_and_tenant_limits(redis_url: str, uid: str):
    app = make_app(redis_url, uid, delayed_shards=1,
                   delayed_rate_limits={f"queue:q{uid}": "100/s", "tenant:*": "4/s", "tenant:big": "20/s"})

    @app.task(base=DelayedTask, name="shape.t", shared=False)
    def t(n: Any) -> None:
        return None

    store = get_store(app)
    apply_later_many(app, "shape.t", [{"args": (i,), "when": ago(1)} for i in range(40)], tenant="small")
    apply_later_many(app, "shape.t", [{"args": (i,), "when": ago(1)} for i in range(40)], tenant="big")
    t0 = now_ms()
    b = store.release.release_due(0, now_ms=t0)
    tenants = [rec(store, i)["tn"] for i in b.ids]
    assert tenants.count("small") == 2 and tenants.count("big") == 10
    waiting = store.shaping.waiting()
    assert waiting == {"tenant:small": 38, "tenant:big": 30}
    keys = {r.key: (r.per_second, r.waiting) for r in store.shaping.limits()}
    assert keys["tenant:small"] == (4.0, 38) and keys["tenant:big"] == (20.0, 30)
    assert keys[f"queue:q{uid}"] == (100.0, 0)


def test_bad_limits_are_configuration_errors(redis_url: str, uid: str):
    for bad, match in (({"queue:": "1/s"}, "names no queue"), ({"x.y": "1/d"}, "not a rate"),
                       ({"x.y": 0}, "positive"), ({"tenants:a": "1/s"}, "key form"), ({"queue:*": "1/s"}, "only")):
        app = make_app(redis_url, uid, delayed_rate_limits=bad)
        with pytest.raises(ConfigurationError, match=match):
            get_store(app)


# -- tenants ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("claim", [False, True], ids=["direct", "publish"])
def test_a_small_tenant_is_not_queued_behind_a_big_tenants_flood(redis_url: str, uid: str, claim: bool):
    app = make_app(redis_url, uid, delayed_shards=1)

    @app.task(base=DelayedTask, name="shape.remind", shared=False)
    def remind(n: Any) -> None:
        return None

    store = get_store(app)
    apply_later_many(app, "shape.remind", [{"args": (i,), "when": ago(5)} for i in range(3000)], tenant="big")
    small = [apply_later(app, "shape.remind", (i,), when=ago(1), tenant="small") for i in range(10)]
    plain = [apply_later(app, "shape.remind", (i,), when=ago(0.5)) for i in range(3)]
    t0 = now_ms()  # (after the calls: all of them due, however long they took)
    assert store.shaping.tenants() == {"big": 3000, "small": 10}
    if claim:
        b = store.release.claim_due(0, now_ms=t0, limit=100)
    else:
        b = store.release.release_due(0, now_ms=t0, limit=100)
    assert b.count == 100
    assert {r.id for r in small} <= set(b.ids), "the small tenant's jobs went in the first batch"
    assert not {r.id for r in plain} & set(b.ids), "jobs with no tenant share the rest in due order"
    assert store.shaping.tenants() == {"big": 2910}
    assert store.shaping.tenant_job_ids("big", 0, 0, 5)
    released = drain(store, t0, claim=claim, limit=100)
    assert len(released) + 100 == 3013
    assert store.shaping.tenants() == {}


def test_a_tenants_lane_follows_cancel_and_reschedule(redis_url: str, uid: str):
    app = make_app(redis_url, uid, delayed_shards=1)

    @app.task(base=DelayedTask, name="shape.r", shared=False)
    def r(n: Any) -> None:
        return None

    store = get_store(app)
    a = apply_later(app, "shape.r", (1,), when=3600, tenant="acme")
    b = apply_later(app, "shape.r", (2,), when=3600, tenant="acme")
    assert store.shaping.tenants() == {"acme": 2}
    assert a.cancel()
    assert store.shaping.tenants() == {"acme": 1}
    b.reschedule(when=ago(1))
    t0 = now_ms()
    batch = store.release.release_due(0, now_ms=t0)
    assert batch.ids == [b.id]
    assert store.shaping.tenants() == {}


def test_a_bad_tenant_is_refused(tapp: Celery):
    for bad in ("", "*", 3, "x" * 201):
        with pytest.raises(InvalidOption, match="tenant"):
            apply_later(tapp, "shape.mail", (1,), when=10, tenant=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidOption, match="tenant"):
        apply_later_many(tapp, "shape.mail", [{"args": (1,)}, {"args": (2,), "tenant": ""}])
    assert get_store(tapp).shaping.tenants() == {}


@pytest.mark.parametrize("bucket_ms", [0, 1000], ids=["one-due-set", "time-buckets"])
def test_tenants_lanes_release_each_job_once_through_cancels_and_reschedules(redis_url: str, uid: str,
                                                                             bucket_ms: int):
    app = make_app(redis_url, uid, delayed_shards=1, delayed_bucket_ms=bucket_ms)

    @app.task(base=DelayedTask, name="shape.l", shared=False)
    def lane(n: Any) -> None:
        return None

    store = get_store(app)
    jobs = {t: [h for h in apply_later_many(app, "shape.l", [{"args": (i,), "when": ago(3 - i / 100)}
                                                             for i in range(150)], tenant=t)]
            for t in ("a", "b", "c")}
    plain = apply_later_many(app, "shape.l", [{"args": (i,), "when": ago(2)} for i in range(50)])
    cancelled = {h.id for h in jobs["a"][::7]} | {h.id for h in jobs["b"][:20]}
    for h in [*jobs["a"][::7], *jobs["b"][:20]]:
        assert h.cancel()
    later = jobs["c"][:10]
    for h in later:  # out of the window: their lane entries must follow
        h.reschedule(when=3600)
    t0 = now_ms()
    released = [i for _, i in drain(store, t0, limit=40)]
    assert len(released) == len(set(released)), "each job once"
    want = {h.id for hs in jobs.values() for h in hs} | {h.id for h in plain}
    want -= cancelled | {h.id for h in later}
    assert set(released) == want
    assert store.shaping.tenants() == {"c": 10}
