"""``delayed limits [set | lift | reset]``, ``delayed tenants``, ``list --tenant``, and what ``status`` and ``show``
say about rate limits and tenants (in-process commands on a private redis-server)."""

from __future__ import annotations

import json

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from support import make_app

from celery_delayed import apply_later, apply_later_many, get_store

pytestmark = pytest.mark.timeout(60)


def invoke(app: Celery, *args: str) -> Result:
    from celery_delayed.cli import delayed

    ctx = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    return CliRunner().invoke(delayed, list(args), obj=ctx)


@pytest.fixture
def lapp(redis_url: str, uid: str) -> Celery:
    return make_app(redis_url, uid, delayed_shards=2, delayed_rate_limits={"e2e.mark": "10/m", "tenant:*": "2/s"})


def hold_back(app: Celery, n: int, task: str = "e2e.mark") -> list[str]:
    """``n`` due jobs of ``task``, released once by every shard as a scheduler would: its limit holds most back."""
    ids = [h.id for h in apply_later_many(app, task, [{"args": (i,), "when": 0} for i in range(n)], strict=False)]
    store = get_store(app)
    for s in store.layout.shard_range():
        store.release.release_due(s)
    return ids


def test_limits_lists_every_limit_with_its_rate_source_and_waiting_jobs(lapp: Celery):
    hold_back(lapp, 12)
    res = invoke(lapp, "limits")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["limit", "rate", "source", "waiting"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows["tenant:*"] == ["2/s", "app", "0"]
    rate, source, waiting = rows["e2e.mark"]
    assert (rate, source) == ("10/m", "app") and 8 <= int(waiting) < 12
    js = {row["key"]: row for row in map(json.loads, invoke(lapp, "limits", "--json").stdout.splitlines())}
    assert js["e2e.mark"]["per_second"] == pytest.approx(10 / 60) and js["e2e.mark"]["rate"] == "10/m"
    assert js["e2e.mark"]["waiting"] == int(waiting)


def test_set_lift_and_reset_change_the_limit_at_run_time(lapp: Celery):
    store = get_store(lapp)
    res = invoke(lapp, "limits", "set", "queue:bulk", "100/s")
    assert res.exit_code == 0 and res.stdout.startswith("queue:bulk: limited to 100/s"), res.output
    assert store.shaping.runtime_limits() == {"queue:bulk": 100.0}
    assert ["queue:bulk", "100/s", "runtime", "0"] in [ln.split() for ln in invoke(lapp, "limits").stdout.splitlines()]
    waiting = hold_back(lapp, 6)
    res = invoke(lapp, "limits", "lift", "e2e.mark")
    assert res.exit_code == 0 and res.stdout.strip() == \
        "e2e.mark: lifted (no limit until `delayed limits reset e2e.mark`)"
    rows = [ln.split() for ln in invoke(lapp, "limits").stdout.splitlines()]
    assert next(r[:3] for r in rows if r[0] == "e2e.mark") == ["e2e.mark", "none", "lifted"]
    for s in store.layout.shard_range():  # lifted: every waiting job goes on the next release
        store.release.release_due(s)
    assert store.shaping.waiting() == {} and len(waiting) == 6
    res = invoke(lapp, "limits", "reset", "e2e.mark")
    assert res.exit_code == 0 and res.stdout.strip() == "e2e.mark: back to the app's 10/m"
    assert invoke(lapp, "limits", "reset", "queue:bulk").stdout.strip() == \
        "queue:bulk: no limit (delayed_rate_limits sets none)"
    assert store.shaping.runtime_limits() == {}


@pytest.mark.parametrize(("args", "message"), [
    (["set", "qeue:bulk", "1/s"], "is not a key form it knows"),
    (["set", "queue:", "1/s"], "names no queue"),
    (["set", "e2e.mark", "fast"], "is not a rate"),
    (["set", "e2e.mark", "0/s"], "must be a positive rate"),
    (["lift", "queue:*"], "only tenants take '*'"),
])
def test_a_bad_key_or_rate_is_refused_with_a_clear_error(lapp: Celery, args: list[str], message: str):
    res = invoke(lapp, "limits", *args)
    assert res.exit_code == 1 and message in res.output, res.output
    assert get_store(lapp).shaping.runtime_limits() == {}
    assert invoke(lapp, "limits", "set", "e2e.mark").exit_code == 2  # no rate: a usage error


def test_tenants_lists_the_busiest_first_and_sums_the_rest(lapp: Celery):
    for i, name in enumerate(["acme", "globex", "initech", "umbrella"]):
        apply_later_many(lapp, "e2e.sleep", [{"when": 3600, "tenant": name} for _ in range(i + 1)], strict=False)
    apply_later(lapp, "e2e.sleep", when=3600, strict=False)  # no tenant
    res = invoke(lapp, "tenants", "--top", "2")
    assert res.exit_code == 0, res.output
    assert [ln.split() for ln in res.stdout.splitlines()] == [
        ["tenant", "scheduled"], ["umbrella", "4"], ["initech", "3"],
        ["(and", "2", "more", "tenant(s)", "with", "3", "job(s);", "--top", "shows", "more)"]]
    assert "(4 tenant(s), 10 scheduled job(s))" in res.stderr
    js = [json.loads(ln) for ln in invoke(lapp, "tenants", "--json").stdout.splitlines()]
    assert js == [{"tenant": "umbrella", "scheduled": 4}, {"tenant": "initech", "scheduled": 3},
                  {"tenant": "globex", "scheduled": 2}, {"tenant": "acme", "scheduled": 1}]
    assert invoke(lapp, "tenants", "--top", "0").exit_code == 2


def test_status_shows_what_each_limit_holds_back_and_the_busiest_tenants(lapp: Celery):
    hold_back(lapp, 10)
    apply_later_many(lapp, "e2e.sleep", [{"when": 3600, "tenant": t} for t in ("acme", "acme", "globex")],
                     strict=False)
    out = invoke(lapp, "status").stdout
    waiting = get_store(lapp).shaping.waiting()["e2e.mark"]
    assert f"rate limits: 2, holding back {waiting} due job(s) (delayed limits)" in out
    assert f"  e2e.mark: 10/m (app), {waiting} waiting" in out and "  tenant:*: 2/s (app), 0 waiting" in out
    assert "tenants: 2 with 3 scheduled job(s); busiest: acme (2), globex (1) (delayed tenants)" in out
    js = json.loads(invoke(lapp, "status", "--json").stdout)
    assert {r["key"]: r["waiting"] for r in js["limits"]} == {"e2e.mark": waiting, "tenant:*": 0}
    assert js["tenants"] == {"count": 2, "scheduled": 3, "busiest": [{"tenant": "acme", "scheduled": 2},
                                                                     {"tenant": "globex", "scheduled": 1}]}


def test_status_without_limits_or_tenants_says_nothing_of_them(redis_url: str, uid: str):
    app = make_app(redis_url, uid)
    apply_later(app, "e2e.mark", when=60, strict=False)
    out = invoke(app, "status").stdout
    assert "rate limits" not in out and "tenants:" not in out
    js = json.loads(invoke(app, "status", "--json").stdout)
    assert js["limits"] == [] and js["tenants"] == {"count": 0, "scheduled": 0, "busiest": []}
    assert invoke(app, "limits").stdout.startswith("no rate limit")
    assert invoke(app, "tenants").stdout.strip() == "no tenant has scheduled jobs"


def test_list_tenant_pages_one_tenants_jobs_in_due_order_and_show_names_the_tenant(lapp: Celery):
    acme = [h.id for h in apply_later_many(lapp, "e2e.sleep", [{"args": (i,), "when": 1000 + i, "tenant": "acme"}
                                                                for i in range(7)], strict=False)]
    apply_later_many(lapp, "e2e.sleep", [{"when": 999 + i, "tenant": "globex"} for i in range(3)], strict=False)
    apply_later(lapp, "e2e.sleep", when=500, strict=False)
    res = invoke(lapp, "list", "--tenant", "acme", "--limit", "5")
    assert res.exit_code == 0, res.output
    assert [ln.split()[0] for ln in res.stdout.splitlines()] == acme[:5]
    assert "next page: --offset 5" in res.stderr
    rows = [json.loads(ln) for ln in invoke(lapp, "list", "--tenant", "acme", "--offset", "5", "--json").stdout
            .splitlines()]
    assert [r["id"] for r in rows] == acme[5:] and {r["task"] for r in rows} == {"e2e.sleep"}
    assert invoke(lapp, "list", "--tenant", "nobody").stdout == ""
    assert invoke(lapp, "list", "--tenant", "acme", "--task", "e2e.sleep").exit_code == 2
    shown = invoke(lapp, "show", acme[0]).stdout
    assert [ln.split(None, 1) for ln in shown.splitlines() if ln.startswith("tenant")] == [["tenant", "acme"]]


def test_show_names_the_limit_a_held_back_job_waits_under(lapp: Celery):
    ids = hold_back(lapp, 6)
    store = get_store(lapp)
    waiting = [j for j in ids if store.lookup.get(j).get("lw")]
    assert waiting
    shown = invoke(lapp, "show", waiting[0]).stdout
    assert "waiting for a token of the rate limit  e2e.mark" in shown
