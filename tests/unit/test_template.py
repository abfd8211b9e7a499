"""The envelope-template fast path renders byte for byte what ``build_message`` builds."""

from __future__ import annotations

import base64
import functools
import json
import uuid
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st
from support import make_app

from celery_delayed import apply_later, apply_later_many, get_store
from celery_delayed.producer.message import build_message, validate_envelope
from celery_delayed.producer.prepare import prepare
from celery_delayed.producer.template import fast_repr, template_for
from celery_delayed.store.compact import fast_uuid4
from celery_delayed.vocab import job_headers

NAME = "tmpl.task"


def _app(redis_url: str, uid: str, **conf: Any) -> Celery:
    app = make_app(redis_url, uid, **conf)

    @app.task(name=NAME, shared=False)
    def task(*args: Any, **kwargs: Any) -> None:  # never runs
        pass

    return app


def _same(app: Celery, args: Any, kwargs: Any, options: dict[str, Any], headers: dict[str, Any] | None = None,
          root: str | None = None, parent: str | None = None) -> None:
    headers = headers or {}
    tmpl = template_for(app, NAME, options, headers, app.tasks[NAME], 1 << 20, app.conf.delayed_key_prefix)
    assert tmpl is not None
    for eta in (None, "2031-02-03T04:05:06.000007+00:00"):
        opts = dict(options, headers={**headers, **job_headers(7, app.conf.delayed_key_prefix, eta)}, root_id=root,
                    parent_id=parent)
        ref = build_message(app, NAME, args, kwargs, "the-id", opts, app.tasks[NAME])
        tag = json.loads(ref.body)["properties"]["delivery_tag"]
        rendered = tmpl.render("the-id", 7, args, kwargs, root, parent, tag, eta)
        assert rendered == ref.body
    validate_envelope(rendered)  # a worker can read it
    assert tmpl.route == ref.route


@pytest.mark.parametrize("options", [
    {},
    {"priority": 5},
    {"queue": "other", "routing_key": "other"},
    {"time_limit": 30, "soft_time_limit": 20, "ignore_result": True},
    {"expires": datetime(2030, 1, 1, tzinfo=timezone.utc)},
    {"shadow": "shown-name", "group_id": "g1", "group_index": 2},
])
def test_render_equals_build_message(redis_url: str, uid: str, options: dict[str, Any]) -> None:
    app = _app(redis_url, uid, task_create_missing_queues=True)
    _same(app, (1, "a", None), {"k": "v"}, options)
    _same(app, [], {}, options, {"x-custom": "h"}, root="r-1", parent="p-1")
    _same(app, ("it's", "é", b"\x00".decode()), {"nested": [1, {"a": 2.5}]}, options)


@functools.cache
def _hyp_app(redis_url: str) -> Celery:
    return _app(redis_url, "hyp" + uuid.uuid4().hex[:6])  # one app for every example


@settings(max_examples=150, deadline=None)
@given(args=st.lists(st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=30), st.none(),
                               st.booleans()), max_size=6),
       kwargs=st.dictionaries(st.text(min_size=1, max_size=8), st.one_of(st.integers(), st.text(max_size=20)),
                              max_size=4))
def test_render_equals_build_message_for_any_json_args(redis_url: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    app = _hyp_app(redis_url)
    _same(app, tuple(args), kwargs, {})


def test_no_template_where_the_message_depends_on_more(redis_url: str, uid: str) -> None:
    app = _app(redis_url, uid)
    task = app.tasks[NAME]
    prefix = app.conf.delayed_key_prefix
    assert template_for(app, NAME, {"expires": 60}, {}, task, 1 << 20, prefix) is None  # relative to the clock
    assert template_for(app, NAME, {"link": object()}, {}, task, 1 << 20, prefix) is None
    assert template_for(app, NAME, {}, {"h": ["unhashable"]}, task, 1 << 20, prefix) is None
    pickled = _app(redis_url, uid + "p", task_serializer="pickle", accept_content=["json", "pickle"])
    assert template_for(pickled, NAME, {}, {}, pickled.tasks[NAME], 1 << 20, pickled.conf.delayed_key_prefix) is None
    events = _app(redis_url, uid + "e", task_send_sent_event=True)
    assert template_for(events, NAME, {}, {}, events.tasks[NAME], 1 << 20, events.conf.delayed_key_prefix) is None

    def by_args(name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any) -> Any:
        return {"queue": "celery"}

    routed = _app(redis_url, uid + "r", task_routes=(by_args,))
    assert template_for(routed, NAME, {}, {}, routed.tasks[NAME], 1 << 20, routed.conf.delayed_key_prefix) is None


def test_prepare_uses_the_template_and_stores_the_same_fields(redis_url: str, uid: str) -> None:
    app = _app(redis_url, uid)
    eta = "2030-01-01T00:00:00.000001+00:00"
    fast = prepare(app, get_store(app), NAME, (1,), {"a": "b"}, 60, task_type=app.tasks[NAME], task_id="fixed-id",
                   eta=eta).job
    assert fast.common is not None  # took the fast path
    env = json.loads(fast.full_fields()["msg"])
    assert env["headers"]["id"] == env["properties"]["correlation_id"] == env["headers"]["root_id"] == "fixed-id"
    assert env["headers"]["delayed_shard"] == fast.shard
    assert env["headers"]["delayed_eta"] == eta
    assert fast.full_fields()["lk"] == app.conf.task_default_queue
    slow = prepare(app, get_store(app), NAME, (1,), {"a": "b"}, 60, task_type=app.tasks[NAME], task_id="fixed-id",
                   options={"link_error": None, "chain": None}, eta=eta).job
    for k in ("task", "q", "ex", "rk", "lk"):
        assert (fast.full_fields().get(k) or "") == (slow.fields.get(k) or "")
    a, b = json.loads(fast.full_fields()["msg"]), json.loads(slow.full_fields()["msg"])
    for env in (a, b):
        env["properties"].pop("delivery_tag")
        # a compact job's body is padded with spaces (store/compact.py): the same JSON
        env["body"] = json.loads(base64.b64decode(env["body"]))
    assert a == b


def test_apply_later_and_many_store_renderable_jobs(redis_url: str, uid: str, rclient: Any) -> None:
    app = _app(redis_url, uid)
    h = apply_later(app, NAME, (1,), None, 3600)
    hs = apply_later_many(app, NAME, [{"args": (i,), "when": 3600} for i in range(50)])
    store = get_store(app)
    for x in [h, *hs]:
        rec = store.lookup.get(x.id, x.shard)  # a compact record, read with its template's routing fields
        assert rec["st"] == "SCHEDULED" and rec["task"] == NAME and rec["lk"] == f"q{uid}"
        assert json.loads(store.lookup.message(x.id, x.shard) or "")["headers"]["id"] == x.id


def test_fast_uuid4_is_a_version_4_uuid() -> None:
    for _ in range(200):
        u = uuid.UUID(fast_uuid4())
        assert u.version == 4 and u.variant == uuid.RFC_4122


def test_fast_repr_only_for_what_saferepr_writes_alike() -> None:
    assert fast_repr((1, "a", None, True, 2.5), 1024) == "(1, 'a', None, True, 2.5)"
    assert fast_repr({"a": 1}, 1024) == "{'a': 1}"
    assert fast_repr(("it's",), 1024) is None
    assert fast_repr(("é",), 1024) is None
    assert fast_repr(([1],), 1024) is None
    assert fast_repr(("x" * 2000,), 1024) is None


def test_handles_keep_asyncresult_behaviour(redis_url: str, uid: str) -> None:
    app = _app(redis_url, uid)
    h = apply_later(app, NAME, (1,), None, 3600)
    assert h.backend is app.backend and h.parent is None and h.id and h.app is app
    seen: list[Any] = []
    h.then(seen.append)  # the promise is made on first use
    assert h.on_ready is h.on_ready
    h.on_ready(h)
    assert seen == [h]
