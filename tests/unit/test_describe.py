"""A job record in words (``describe.py``): one label per record field, the arguments as the app shows them."""

from __future__ import annotations

import json

from celery_delayed import describe
from celery_delayed.vocab import Field


def test_every_record_field_has_a_label_in_words():
    fields = {v for k, v in vars(Field).items() if not k.startswith("_") and isinstance(v, str)}
    assert fields - set(describe.LABELS) == set()
    labels = list(describe.LABELS.values())
    assert len(labels) == len(set(labels)), "two fields read the same"
    for field, text in describe.LABELS.items():  # a label is words, never the short name Redis keeps
        assert text != field or field in ("due", "shard", "task", "reason", "finished"), (field, text)


def test_arguments_from_the_message_a_compact_record_or_a_dead_letter():
    msg = json.dumps({"headers": {"argsrepr": "('a', '***')", "kwargsrepr": "{'k': 1}"}, "body": "c2VjcmV0"})
    assert describe.arguments({}, msg) == ("('a', '***')", "{'k': 1}")
    assert describe.arguments({Field.C_ARGSREPR: json.dumps("(1, 2)")}, None) == ("(1, 2)", "{}")
    compact = {Field.C_ARGSREPR: json.dumps("(1,)"), Field.C_KWARGSREPR: json.dumps("{'x': 'y'}")}
    assert describe.arguments(compact, None) == ("(1,)", "{'x': 'y'}")
    assert describe.arguments({Field.ARGS: "(7,)", Field.KWARGS: "{}"}, None) == ("(7,)", "{}")
    assert describe.arguments({}, None) == ("", "")
    assert describe.arguments({}, "not json") == ("", "")


def test_summary_reads_in_words_and_details_keep_the_rest():
    rec = {"id": "j1", "shard": "2", Field.STATE: "DEAD", Field.TASK: "app.t", Field.QUEUE: "celery",
           Field.DUE: "1000", Field.ATTEMPTS: "3", Field.RETRIES: "2", Field.ERROR_TYPE: "KeyError",
           Field.ERROR_MESSAGE: "'x'", Field.ARGS: "(1,)", Field.KWARGS: "{}", Field.LIST_KEY: "celery",
           Field.DIED: "61000", Field.TRACEBACK: "Traceback ..."}
    rows = dict(describe.summary(rec, None, now_ms=61_000))
    assert rows == {"job id": "j1", "state": "DEAD", "task": "app.t", "arguments": "(1,)",
                    "keyword arguments": "{}", "queue": "celery", "due": "1970-01-01 00:00:01.000Z (60s ago)",
                    "attempts": "3 made, 2 retries scheduled", "error": "KeyError: 'x'"}
    assert describe.details(rec) == [
        (Field.LIST_KEY, "broker list", "celery"),
        (Field.DIED, "dead-lettered", "61000 (1970-01-01 00:01:01.000Z)"),
        ("shard", "shard", "2"),
    ]


def test_times_in_words():
    assert describe.ago(10_500, 0) == "in 10s" and describe.ago(0, 599_700) == "10m 0s ago"
    assert describe.ago(0, 250) == "250ms ago" and describe.ago(90_000_000, 0) == "in 25h 0m"
    assert describe.ago(200_000_000, 0) == "in 2d 7h"
    assert describe.when(None) == "-" and describe.when("x") == "x"


def test_a_jobs_tenant_and_the_limit_it_waits_under_are_in_the_summary():
    rec = {"id": "j1", Field.STATE: "SCHEDULED", Field.TASK: "t.sms", Field.DUE: "1000",
           Field.TENANT: "acme", Field.LIMIT_WAIT: "tenant:acme"}
    rows = dict(describe.summary(rec, None, 0))
    assert rows["tenant"] == "acme" and rows["waiting for a token of the rate limit"] == "tenant:acme"
    assert not {f for f, _, _ in describe.details(rec)} & {Field.TENANT, Field.LIMIT_WAIT}


def test_a_limit_in_words():
    from celery_delayed.store.shaping import Limit

    assert describe.limit(Limit("t.sms", 10 / 60, "app", 3)) == ("10/m", "app")
    assert describe.limit(Limit("queue:bulk", 50.0, "runtime", 0)) == ("50/s", "runtime")
    assert describe.limit(Limit("t.sms", None, "runtime", 4)) == ("none", "lifted")
