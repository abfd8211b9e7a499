"""A store remembers its shard count and bucket width; a mismatched app is refused."""

from __future__ import annotations

import pytest
from conftest import make_app

from celery_delayed import ConfigurationError, apply_later, get_store


def test_second_app_with_other_shards_is_refused_before_writing(redis_url, uid, rclient):
    first = make_app(redis_url, uid)
    apply_later(first, "t.x", when=60, strict=False)
    other = make_app(redis_url, uid, delayed_shards=32)
    before = sorted(rclient.scan_iter(f"t{uid}:*"))
    with pytest.raises(ConfigurationError, match=r"delayed_shards is 32.*created with 16"):
        apply_later(other, "t.x", when=60, strict=False)
    assert sorted(rclient.scan_iter(f"t{uid}:*")) == before
    with pytest.raises(ConfigurationError, match="delayed_shards"):
        get_store(other).release_due(0)


def test_other_bucket_width_is_refused(redis_url, uid):
    apply_later(make_app(redis_url, uid, delayed_bucket_ms=60_000), "t.x", when=60, strict=False)
    with pytest.raises(ConfigurationError, match=r"delayed_bucket_ms is 0.*created with 60000"):
        apply_later(make_app(redis_url, uid), "t.x", when=60, strict=False)


def test_same_layout_is_accepted_and_checked_once(redis_url, uid, rclient):
    a, b = make_app(redis_url, uid), make_app(redis_url, uid)
    apply_later(a, "t.x", when=60, strict=False)
    apply_later(b, "t.x", when=60, strict=False)
    assert rclient.hgetall(f"t{uid}:layout") == {"shards": "16", "bucket_ms": "0"}
    assert get_store(b)._layout_ok
