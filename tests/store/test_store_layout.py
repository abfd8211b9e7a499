"""Store-wide safety checks: the layout (shards, bucket width) and envelope validation."""

from __future__ import annotations

import pytest
from support import make_app

from celery_delayed import ConfigurationError, apply_later, get_store


def test_second_app_with_other_shards_is_refused_before_writing(redis_url, uid, rclient):
    first = make_app(redis_url, uid)
    apply_later(first, "t.x", when=60, strict=False)
    other = make_app(redis_url, uid, delayed_shards=32)
    before = sorted(rclient.scan_iter(f"t{uid}:*"))
    with pytest.raises(ConfigurationError, match=r"delayed_shards is 32.*store under prefix .* has 16"):
        apply_later(other, "t.x", when=60, strict=False)
    assert sorted(rclient.scan_iter(f"t{uid}:*")) == before
    with pytest.raises(ConfigurationError, match="delayed_shards"):
        get_store(other).release.release_due(0)


def test_other_bucket_width_is_refused(redis_url, uid):
    apply_later(make_app(redis_url, uid, delayed_bucket_ms=60_000), "t.x", when=60, strict=False)
    with pytest.raises(ConfigurationError, match=r"delayed_bucket_ms is 0.*has 60000"):
        apply_later(make_app(redis_url, uid), "t.x", when=60, strict=False)


def test_same_layout_is_accepted_and_checked_once(redis_url, uid, rclient):
    a, b = make_app(redis_url, uid), make_app(redis_url, uid)
    apply_later(a, "t.x", when=60, strict=False)
    apply_later(b, "t.x", when=60, strict=False)
    assert rclient.hgetall(f"t{uid}:layout") == {"shards": "16", "bucket_ms": "0"}
    assert get_store(b).layout._checked


def test_envelope_is_validated_before_it_is_stored():
    from celery_delayed.errors import SerializationError
    from celery_delayed.producer.message import validate_envelope

    good = (
        '{"body": "W1tdLCB7fSwge31d", "content-encoding": "utf-8", "content-type": "application/json", '
        '"headers": {"id": "x", "task": "t"}, "properties": {"correlation_id": "x", "delivery_mode": 2, '
        '"delivery_info": {}, "priority": 0, "body_encoding": "base64", "delivery_tag": "d"}}'
    )
    validate_envelope(good, {"application/json"})
    for bad in (good.replace('"task": "t"', '"task": ""'), good.replace("W1tdLCB7fSwge31d", "!!"),
                good.replace('"delivery_tag": "d"', '"tag": "d"'), good[:-1]):
        with pytest.raises(SerializationError, match="would not decode on a worker"):
            validate_envelope(bad, {"application/json"})
    with pytest.raises(SerializationError, match="ContentDisallowed"):
        validate_envelope(good, {"application/x-python-serialize"})
