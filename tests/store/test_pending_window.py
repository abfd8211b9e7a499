"""The pending jobs' cursor pages (``Pending.window``, the dashboard's list): due order over shards and sets,
a cursor that names no Redis key, a count, and the arguments of each row as the app shows them."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from support import make_app

from celery_delayed import InvalidOption, apply_later, apply_later_many, cancel, get_store
from celery_delayed.store import NewJob, Pending


@pytest.fixture(params=[0, 60_000], ids=["flat", "buckets"])
def papp(request: pytest.FixtureRequest, redis_url: str, uid: str) -> Celery:
    return make_app(redis_url, uid, delayed_shards=4, delayed_bucket_ms=int(request.param))


def _all_pages(pending: Pending, limit: int, **kw: str) -> list[str]:
    seen: list[str] = []
    after = None
    for _ in range(100):
        rows, after = pending.window(after, limit, **kw)
        seen += [r["id"] for r in rows]
        if after is None:
            return seen
    raise AssertionError("the pages never end")


def test_a_hot_instant_pages_over_every_shard_once_each(papp):
    """130 jobs due at one millisecond, over four shards and two queues: every page starts where the last ended
    (with a task, each shard has a set per queue, both holding jobs due at the cursor's millisecond)."""
    at = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=1)
    ids = [h.id for h in apply_later_many(papp, "t.hot", [{"args": (i,), "when": at, "queue": f"q-{i % 2}"}
                                                          for i in range(130)], strict=False)]
    later = apply_later(papp, "t.cold", when=at + timedelta(seconds=1), strict=False).id
    pending = Pending(get_store(papp))
    seen = _all_pages(pending, 50)
    assert sorted(seen[:130]) == sorted(ids) and len(set(seen)) == 131 and seen[-1] == later
    assert _all_pages(pending, 7, task="t.hot") == [i for i in seen if i != later]
    assert pending.count() == 131 and pending.count(task="t.hot") == 130 and pending.count(task="nope") == 0


def test_a_cursor_whose_job_left_loses_no_job(papp):
    at = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=1)
    ids = [h.id for h in apply_later_many(papp, "t.hot", [{"args": (i,), "when": at} for i in range(60)],
                                          strict=False)]
    pending = Pending(get_store(papp))
    rows, after = pending.window(None, 20)
    assert after is not None and after[2] == rows[-1]["id"] and isinstance(after[1], int)
    cancel(papp, after[2])  # the cursor's job leaves its set between two pages
    seen = [r["id"] for r in rows] + _all_pages_from(pending, after)
    assert sorted(seen) == sorted(ids)  # none lost, none twice


def _all_pages_from(pending: Pending, after: tuple[int, int, str]) -> list[str]:
    seen: list[str] = []
    cursor: tuple[int, int, str] | None = after
    while cursor is not None:
        rows, cursor = pending.window(cursor, 20)
        seen += [r["id"] for r in rows]
    return seen


def test_a_cursor_names_no_key_and_a_shard_of_the_store(papp):
    store = get_store(papp)
    pending = Pending(store)
    apply_later(papp, "t.x", when=60, strict=False)
    with pytest.raises(InvalidOption, match="the cursor names shard 4; the store has shards 0 to 3"):
        pending.window((0, 4, "x"), 10)
    with pytest.raises(InvalidOption):
        pending.window((0, -1, "x"), 10)
    # an id that is the name of a key of another type is only ever a member to look up
    record = store.keys.shard(0).job("whatever")
    store.redis.client.hset(record, "st", "SCHEDULED")
    rows, _ = pending.window((0, 0, record), 10)
    assert len(rows) == 1


def test_rows_carry_the_arguments_as_the_app_shows_them(papp):
    store = get_store(papp)
    compact = apply_later(papp, "t.x", args=("a", 1), kwargs={"k": "v"}, when=60, strict=False,
                          argsrepr="('a', '***')")
    plain = apply_later(papp, "t.x", when=61, strict=False)
    msg = json.dumps({"headers": {"argsrepr": "(9,)", "kwargsrepr": "{'z': 0}"}, "body": ""})
    due = store.redis.now_ms() + 62_000
    store.jobs.schedule([NewJob("full-1", store.layout.shard_of("full-1"), str(due),
                                {"task": "t.full", "q": "q1", "msg": msg})])
    rows = {r["id"]: (r["args"], r["kwargs"]) for r in Pending(store).window(None, 10)[0]}
    assert rows == {compact.id: ("('a', '***')", "{'k': 'v'}"), plain.id: ("()", "{}"), "full-1": ("(9,)", "{'z': 0}")}


def test_routes_count_the_pending_jobs_per_task_and_queue(papp):
    """``routes()`` reads the pending index: (task, queue) -> scheduled jobs; a cancelled job leaves it."""
    hs = [apply_later(papp, "t.a", when=60, queue=q, strict=False) for q in ("x", "x", "y")]
    apply_later(papp, "t.b", when=60, queue="x", strict=False)
    pending = Pending(get_store(papp))
    assert pending.routes() == {("t.a", "x"): 2, ("t.a", "y"): 1, ("t.b", "x"): 1}
    cancel(papp, hs[2].id)
    assert pending.routes() == {("t.a", "x"): 2, ("t.b", "x"): 1}


def test_a_held_window_lists_only_what_a_pause_holds_back(papp):
    """Due jobs of a paused task wait in the held sets: ``held=True`` pages through them alone (a task or
    queue filters those rows), and counts them."""
    from celery_delayed import controls

    held = [apply_later(papp, "t.paused", (i,), when=0, strict=False).id for i in range(3)]
    waiting = apply_later(papp, "t.paused", when=3600, strict=False).id
    other = apply_later(papp, "t.other", when=0, strict=False).id
    controls.pause(papp, task="t.paused")
    store = get_store(papp)
    for s in store.layout.shard_range():
        store.release.release_due(s)
    pending = Pending(store)
    assert sorted(_all_pages(pending, 2, held=True)) == sorted(held)
    assert pending.count(held=True) == 3
    assert sorted(_all_pages(pending, 2, held=True, task="t.paused")) == sorted(held)
    assert _all_pages(pending, 2, held=True, task="t.other") == []
    assert waiting in _all_pages(pending, 50) and other not in _all_pages(pending, 50)  # released
