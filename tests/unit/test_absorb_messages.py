"""Which broker messages ``delayed absorb`` takes, and why it leaves the others (no server needed)."""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

from celery_delayed.adoption.messages import DUE, FROM_THE_STORE, NO_ETA, NOT_A_TASK, Envelope, EtaMessage, read

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)
UTC = timezone.utc


def env(**headers: object) -> Envelope:
    raw = {"body": base64.b64encode(b"[[1], {}, {}]").decode(), "content-type": "application/json",
           "content-encoding": "utf-8", "headers": {"id": "j1", "task": "t.x", **headers},
           "properties": {"body_encoding": "base64", "priority": 0}}
    return Envelope.from_redis(json.dumps(raw))


def test_a_message_with_a_future_eta_is_taken_with_its_eta():
    eta = NOW + timedelta(hours=1)
    found = read(env(eta=eta.isoformat()), NOW, 1.0, UTC)
    assert isinstance(found, EtaMessage)
    assert (found.id, found.task, found.eta) == ("j1", "t.x", eta)
    assert found.envelope.body == b"[[1], {}, {}]"


def test_the_rest_is_left_with_its_reason():
    assert read(env(), NOW, 1.0, UTC) == NO_ETA
    assert read(env(eta=None), NOW, 1.0, UTC) == NO_ETA
    assert read(env(eta="not a date"), NOW, 1.0, UTC) == NO_ETA
    assert read(env(eta=(NOW + timedelta(seconds=0.5)).isoformat()), NOW, 1.0, UTC) == DUE
    assert read(env(eta=(NOW - timedelta(days=1)).isoformat()), NOW, 0.0, UTC) == DUE
    assert read(env(id=None), NOW, 1.0, UTC) == NOT_A_TASK
    later = (NOW + timedelta(hours=1)).isoformat()
    assert read(env(eta=later, delayed_shard=3), NOW, 1.0, UTC) == FROM_THE_STORE


def test_a_naive_eta_is_read_in_the_apps_timezone_as_celery_reads_it():
    tz = ZoneInfo("Europe/Paris")
    found = read(env(eta="2026-12-07T14:00:00"), NOW, 1.0, tz)
    assert isinstance(found, EtaMessage)
    assert found.eta == datetime(2026, 12, 7, 13, 0, tzinfo=UTC)  # 14:00 in Paris is 13:00 UTC
