"""The metrics of release shaping: jobs each rate limit holds back, its rate, and scheduled jobs per tenant with
bounded labels (the busiest tenants by name, the rest under tenant="other")."""

from __future__ import annotations

import re

import pytest
from celery import Celery
from support import make_app

from celery_delayed import apply_later, apply_later_many, get_store
from celery_delayed.metrics import FAMILIES, TOP_TENANTS, render
from celery_delayed.store.shaping import busiest

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def mapp(redis_url: str, uid: str) -> Celery:
    return make_app(redis_url, uid, delayed_shards=2, delayed_rate_limits={"m.sms": "10/m", "queue:bulk": "5/s"})


def series(text: str, family: str) -> dict[str, float]:
    """label value -> sample of one single-label family in Prometheus' text format."""
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^celery_delayed_{family}{{[a-z]+="([^"]*)"}} (\S+)$', text, re.M)}


def test_each_limit_has_its_waiting_jobs_and_its_rate_in_force(mapp: Celery):
    store = get_store(mapp)
    apply_later_many(mapp, "m.sms", [{"args": (i,), "when": 0} for i in range(9)], strict=False)
    for s in store.layout.shard_range():
        store.release.release_due(s)
    waiting = store.shaping.waiting()["m.sms"]
    assert waiting >= 5
    text = render(mapp)[0].decode()
    assert series(text, "rate_limited_jobs") == {"m.sms": waiting, "queue:bulk": 0}
    assert series(text, "rate_limit_per_second") == pytest.approx({"m.sms": 10 / 60, "queue:bulk": 5.0})
    store.shaping.set_limit("queue:bulk", "50/s")
    store.shaping.set_limit("m.sms", 0)  # lifted: no rate, its waiting jobs still counted until released
    text = render(mapp)[0].decode()
    assert series(text, "rate_limit_per_second") == {"queue:bulk": 50.0}
    assert series(text, "rate_limited_jobs")["m.sms"] == waiting


def test_tenants_beyond_the_busiest_are_summed_under_other(mapp: Celery):
    n = TOP_TENANTS + 3
    for i in range(n):  # tenant t00 has 1 job, t01 2, ...: the three smallest fall under "other"
        apply_later_many(mapp, "m.mail", [{"when": 3600, "tenant": f"t{i:02d}"} for _ in range(i + 1)], strict=False)
    apply_later(mapp, "m.mail", when=3600, strict=False)  # no tenant: not counted
    got = series(render(mapp)[0].decode(), "tenant_scheduled_jobs")
    assert len(got) == TOP_TENANTS + 1
    assert got["other"] == 1 + 2 + 3
    assert got["t22"] == 23 and "t02" not in got and "t03" in got
    apply_later(mapp, "m.mail", when=3600, tenant="other", strict=False)  # a tenant named "other": with the rest
    got = series(render(mapp)[0].decode(), "tenant_scheduled_jobs")
    assert got["other"] == 7 and len(got) == TOP_TENANTS + 1


def test_no_limit_and_no_tenant_serve_empty_families(redis_url: str, uid: str):
    app = make_app(redis_url, uid)
    apply_later(app, "m.mail", when=60, strict=False)
    text = render(app)[0].decode()
    for family in ("rate_limited_jobs", "rate_limit_per_second", "tenant_scheduled_jobs"):
        assert f"# TYPE celery_delayed_{family} gauge" in text and series(text, family) == {}


def test_the_tenant_family_says_how_its_labels_are_bounded():
    meaning = {name: text for name, _, _, text in FAMILIES}["tenant_scheduled_jobs"]
    assert f"the {TOP_TENANTS} tenants with the most" in meaning and 'tenant="other"' in meaning


def test_busiest_ranks_by_count_then_name_and_sums_the_rest():
    counts = {"b": 3, "a": 3, "c": 1, "d": 2}
    assert busiest(counts, 2) == ([("a", 3), ("b", 3)], 2, 3)
    assert busiest(counts, 10) == ([("a", 3), ("b", 3), ("d", 2), ("c", 1)], 0, 0)
    assert busiest({}, 5) == ([], 0, 0)


def test_tenants_waiting_under_tenant_star_are_summed_in_its_series(redis_url: str, uid: str):
    app = make_app(redis_url, uid, delayed_shards=1, delayed_rate_limits={"tenant:*": "1/m", "tenant:vip": "1/m"})
    store = get_store(app)
    for name in ("a", "b", "c", "vip"):
        apply_later_many(app, "m.mail", [{"when": 0, "tenant": name} for _ in range(4)], strict=False)
    store.release.release_due(0)
    per_tenant = store.shaping.waiting()
    assert {"tenant:a", "tenant:b", "tenant:c", "tenant:vip"} <= set(per_tenant)  # the CLI lists each
    text = render(app)[0].decode()
    assert series(text, "rate_limited_jobs") == {
        "tenant:*": sum(per_tenant[f"tenant:{t}"] for t in "abc"), "tenant:vip": per_tenant["tenant:vip"]}
    assert series(text, "rate_limit_per_second") == pytest.approx({"tenant:*": 1 / 60, "tenant:vip": 1 / 60})
