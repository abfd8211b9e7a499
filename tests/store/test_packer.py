"""The store's command packer: hiredis given the arguments directly, the same bytes as redis-py's."""

from __future__ import annotations

import importlib.util

import pytest
from redis._parsers import Encoder
from redis.connection import PythonRespSerializer
from redis.exceptions import DataError

from celery_delayed.store.client import make_client
from celery_delayed.store.packer import DirectPacker, direct_packer
from tests.support.apps import need

need("hiredis (the test extra)", importlib.util.find_spec("hiredis") is not None)

#: redis-py's own packing (its pure-Python serializer: the bytes every serializer of it sends)
REDIS_PY = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)


@pytest.mark.parametrize("args", [
    ("EVALSHA", "ca1c044181f29a9a57a6edd7c431098ffb157e3f", 3, "p:{1}:job:a", "p:{1}:released", "", "h|1|t|n", 30000),
    ("SET", "k", "é ü ✓ 日本", "PX", 5),
    ("ZADD", b"raw", 1.5, "m", 1e20, "n", -0.1, "o", 123456789.123, "p"),
    ("HSET", "k", "f", "x" * 20_000),  # over redis-py's chunk size
    ("SCRIPT LOAD", "return 1"),  # a name with a space: redis-py splits it
    (b"CONFIG GET", "maxmemory"),
])
def test_it_packs_what_redis_py_packs(args):
    assert b"".join(DirectPacker().pack(*args)) == b"".join(REDIS_PY.pack(*args))


@pytest.mark.parametrize("bad", [None, True, {"a": 1}])
def test_what_hiredis_does_not_take_goes_to_redis_py(bad):
    with pytest.raises(DataError):
        DirectPacker().pack("SET", "k", bad)


def test_a_memoryview_packs_to_the_bytes_redis_py_sends():  # hiredis takes it itself
    view = memoryview(b"abc")
    assert b"".join(bytes(c) for c in DirectPacker().pack("SET", "k", view)) == b"".join(
        bytes(c) for c in REDIS_PY.pack("SET", "k", view))


def test_only_for_utf8_with_strict_errors():
    assert isinstance(direct_packer({}), DirectPacker)
    assert isinstance(direct_packer({"encoding": "UTF8"}), DirectPacker)
    assert direct_packer({"encoding": "latin-1"}) is None
    assert direct_packer({"encoding_errors": "replace"}) is None


def test_the_store_client_uses_it_and_round_trips(redis_url, uid):
    client = make_client(redis_url)
    try:
        conn = client.connection_pool.make_connection()
        assert isinstance(conn._command_packer, DirectPacker)
        conn.disconnect()
        key = f"{uid}:packed"
        assert client.set(key, "é", px=5000)
        assert client.get(key) == "é"
        assert client.script_load("return 1")  # "SCRIPT LOAD": the fallback splits it
        pipe = client.pipeline(transaction=False)
        pipe.zadd(key + "z", {"m": 1.5})
        pipe.zscore(key + "z", "m")
        assert pipe.execute() == [1, 1.5]
        with pytest.raises(DataError):
            client.set(key, None)  # type: ignore[arg-type]
        client.delete(key, key + "z")
    finally:
        client.close()


def test_options_may_choose_their_own(redis_url):
    client = make_client(redis_url, options={"encoding": "latin-1"})
    try:
        conn = client.connection_pool.make_connection()
        assert not isinstance(conn._command_packer, DirectPacker)
        conn.disconnect()
    finally:
        client.close()
