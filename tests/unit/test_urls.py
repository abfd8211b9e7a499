"""Redis URLs (``redis_urls.py``): what a Redis URL is, Sentinel hosts, and no password in what is printed."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.sentinel import MasterNotFoundError

import celery_delayed.redis_urls as urls_module
from celery_delayed.config import DelayedConfig
from celery_delayed.errors import ConfigurationError
from celery_delayed.redis_urls import (
    broker_url,
    is_redis_url,
    is_sentinel_url,
    redact,
    same_redis,
    sentinel_hosts,
)
from celery_delayed.store.client import translate

# (url, the secrets it holds, what must stay readable)
WITH_PASSWORDS = [
    ("redis://user:pw1@h:6379/0", ["pw1"], ["redis://user:", "@h:6379/0"]),
    ("redis://:pw1@h/0", ["pw1"], ["@h/0"]),
    ("rediss://user:pw1@cache.example.com:6380/2", ["pw1"], ["rediss://user:", "@cache.example.com:6380/2"]),
    ("unix://:pw1@/var/run/redis.sock?db=1", ["pw1"], ["@/var/run/redis.sock?db=1"]),
    ("socket://u:pw1@/tmp/redis.sock", ["pw1"], ["@/tmp/redis.sock"]),
    ("sentinel://:pw1@h1:26379;sentinel://:pw2@h2:26379;sentinel://:pw3@h3:26379", ["pw1", "pw2", "pw3"],
     ["@h1:26379;sentinel://", "@h2:26379;sentinel://", "@h3:26379"]),
    ("sentinel://u:pw1@10.0.0.1:26379/2; sentinel://u:pw2@10.0.0.2", ["pw1", "pw2"],
     ["@10.0.0.1:26379/2; sentinel://u:", "@10.0.0.2"]),
    ("redis://h:6379/0?password=pw1&db=1", ["pw1"], ["h:6379/0?password=", "&db=1"]),
    ("unix:///tmp/redis.sock?db=2&password=pw1", ["pw1"], ["unix:///tmp/redis.sock?db=2&password="]),
    ("rediss://h:6380/0?ssl_password=pw1&ssl_cert_reqs=required", ["pw1"], ["h:6380/0", "ssl_cert_reqs=required"]),
    ("sentinel://:pw1@h1:26379?password=pw2;sentinel://h2:26380", ["pw1", "pw2"], ["@h1:26379", "h2:26380"]),
    # reserved characters a password may hold unencoded: '@', '/', ';', '#'
    ("redis://:p@ss/w0rd@h:6379/0", ["p@ss/w0rd", "ss/w0rd"], ["@h:6379/0"]),
    ("redis://:pa;ss@h:6379/0", ["pa;ss", "ss@"], ["@h:6379/0"]),
    ("redis://:pa#ss@h:6379/0", ["pa#ss"], ["@h:6379/0"]),
    ("redis://u:p%40ss@h:6379/0", ["p%40ss"], ["@h:6379/0"]),
    # the broker's and the database's URLs, printed in errors too
    ("amqp://guest:pw1@rabbit:5672//", ["pw1"], ["amqp://guest:", "@rabbit:5672//"]),
    ("postgresql+psycopg://app:pw1@db:5432/jobs?sslmode=require", ["pw1"], ["@db:5432/jobs?sslmode=require"]),
    ("http://guest:pw1@127.0.0.1:15672", ["pw1"], ["@127.0.0.1:15672"]),
    # a password typed without its host: nothing after the colon is shown
    ("sentinel://:pw1", ["pw1"], ["sentinel://:"]),
    ("sentinel://h1:26379;sentinel://:pw1", ["pw1"], ["sentinel://h1:26379;"]),
]

WITHOUT_PASSWORDS = [
    "redis://h:6379/0",
    "redis://localhost",
    "rediss://user@h:6380/1",
    "redis://[::1]:6379/0",
    "unix:///tmp/redis.sock?db=2",
    "unix:///tmp/odd@name.sock",
    "redis://h:6379/0?client_name=me@example",
    "sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26380;sentinel://10.0.0.3",
    "sqlite:///jobs.db",
    "memory://",
    "",
]


@pytest.mark.parametrize(("url", "secrets", "shown"), WITH_PASSWORDS, ids=[u for u, _, _ in WITH_PASSWORDS])
def test_redact_hides_every_password_and_keeps_the_hosts(url: str, secrets: list[str], shown: list[str]) -> None:
    out = redact(url)
    for secret in secrets:
        assert secret not in out, out
    for text in shown:
        assert text in out, out
    assert "***" in out


@pytest.mark.parametrize("url", WITHOUT_PASSWORDS)
def test_redact_leaves_a_url_without_a_password_as_written(url: str) -> None:
    assert redact(url) == url


def test_redact_replaces_only_the_password() -> None:
    assert redact("redis://user:pw@h:6379/0") == "redis://user:***@h:6379/0"
    assert redact("unix://:pw@/tmp/r.sock") == "unix://:***@/tmp/r.sock"
    assert redact("sentinel://:a@h1:1;sentinel://u:b@h2:2/3") == "sentinel://:***@h1:1;sentinel://u:***@h2:2/3"
    assert redact("redis://h/0?db=1&Password=x&ssl=true") == "redis://h/0?db=1&Password=***&ssl=true"


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://h/0", True), ("rediss://h/0", True), ("unix:///s.sock", True), ("socket:///s.sock", True),
    ("sentinel://h:26379", True), ("REDIS://h/0", True), ("amqp://h//", False), ("memory://", False),
    ("http://localhost", False), ("h:6379", False), ("", False), ("redis://[::1", True),
])
def test_is_redis_url(url: str, expected: bool) -> None:
    assert is_redis_url(url) is expected


def test_is_sentinel_url() -> None:
    assert is_sentinel_url("sentinel://h:26379;sentinel://g:26379")
    assert not is_sentinel_url("redis://h:26379")


@pytest.mark.parametrize(("url", "hosts"), [
    ("sentinel://h", [("h", 26379)]),
    ("sentinel://:pw@h:26380/1", [("h", 26380)]),
    ("sentinel://u:pw@10.0.0.1:26379/2; sentinel://10.0.0.2:26380 ;sentinel://[::1]:26381",
     [("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 26381)]),
])
def test_sentinel_hosts(url: str, hosts: list[tuple[str, int]]) -> None:
    assert sentinel_hosts(url) == hosts


@pytest.mark.parametrize(("url", "why"), [
    ("sentinel://", "every part must be"),
    ("sentinel://h:26379;redis://h:6379", "every part must be"),
    ("sentinel://h:26379;;sentinel://g:26379", "every part must be"),
    ("sentinel://h:26379/zero", "every part must be"),
    ("sentinel://h:notaport", "its port must be a number"),
    ("sentinel://h:99999", "its port must be a number"),
    ("sentinel://[::1:26379", "its host is not valid"),
])
def test_sentinel_hosts_refuses_a_bad_part(url: str, why: str) -> None:
    with pytest.raises(ConfigurationError, match=f"bad Sentinel URL .* in delayed_redis_url: {why}"):
        sentinel_hosts(url)


def test_same_redis() -> None:
    assert same_redis("redis://localhost:6379/0", "redis://127.0.0.1")
    assert same_redis("redis://:pw@h:6379/0", "rediss://h:6379/")
    assert not same_redis("redis://h:6379/0", "redis://h:6379/1")
    assert not same_redis("redis://h:6379/0", "redis://h:6380/0")
    assert same_redis("unix:///tmp/r.sock", "socket:///tmp/r.sock")
    assert not same_redis("redis://h/0", "amqp://h//")
    assert not same_redis("sentinel://h:26379", "redis://h:26379/0")


def test_broker_url_is_the_first_broker() -> None:
    assert broker_url(SimpleNamespace(broker_url=None)) == ""
    assert broker_url(SimpleNamespace(broker_url="redis://a/0")) == "redis://a/0"
    assert broker_url(SimpleNamespace(broker_url=["redis://a/0", "redis://b/0"])) == "redis://a/0"
    assert broker_url(SimpleNamespace(broker_url=())) == ""


def test_the_module_imports_only_the_standard_library_and_the_errors() -> None:
    tree = ast.parse(Path(urls_module.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [("." * node.level) + (node.module or "")]
        else:
            continue
        for name in names:
            assert name in (".errors", "__future__") or name.split(".")[0] in sys.stdlib_module_names, name


# -- what the package raises: no password from any part -------------------------------------------

MULTI = "sentinel://u:pw1@10.0.0.1:26379/0;sentinel://u:pw2@10.0.0.2:26380;sentinel://:pw3@10.0.0.3"
SECRETS = ("pw1", "pw2", "pw3")


def _app(**conf: Any) -> Celery:
    app = Celery("t", broker="memory://", set_as_current=False)
    app.conf.update(**conf)
    return app


@pytest.mark.parametrize(("conf", "match"), [
    ({"delayed_redis_url": MULTI}, "master_name"),
    ({"delayed_redis_url": MULTI, "delayed_redis_options": {"master_name": "m"}, "delayed_redis_cluster": True},
     "names Sentinels"),
    ({"delayed_redis_url": "redis://:pw1/pw2@h:7000/3", "delayed_redis_cluster": True}, "database 0 only"),
    ({"delayed_redis_url": MULTI + ";http://:pw4@10.0.0.4", "delayed_redis_options": {"master_name": "m"}},
     "bad Sentinel URL"),
    ({"delayed_redis_url": MULTI + ";sentinel://:pw4", "delayed_redis_options": {"master_name": "m"}},
     "its port must be a number"),
    ({"delayed_redis_url": MULTI.replace("sentinel", "http"), "delayed_redis_options": {"master_name": "m"}},
     "must be a redis://"),
    ({"broker_url": "amqp://u:pw1@rabbit//;amqp://u:pw2@rabbit2//"}, "the broker is not Redis"),
    ({"delayed_redis_url": "redis://u:pw1@h/0?password=pw2", "delayed_redis_options": {"master_name": "m"}},
     "only a sentinel://"),
], ids=["no-master-name", "cluster", "cluster-database", "bad-part", "part-without-host", "not-redis",
        "broker-not-redis", "sentinel-options"])
def test_a_bad_configuration_shows_no_password_from_any_part(conf: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match) as err:
        DelayedConfig.from_app(_app(**conf))
    message = str(err.value)
    for secret in (*SECRETS, "pw4"):
        assert secret not in message, message


@pytest.mark.parametrize("exc", [
    MasterNotFoundError("No master found for 'm' : {Sentinel<service=m>: Error 111 - 10.0.0.1:26379:refused}"),
    RedisConnectionError("Error 111 connecting to 10.0.0.1:26379. Connection refused."),
])
def test_a_store_error_on_sentinels_shows_no_password_from_any_part(exc: Exception) -> None:
    err = translate(exc, MULTI)
    assert err is not None
    message = str(err)
    assert "10.0.0.2:26380" in message
    for secret in SECRETS:
        assert secret not in message, message
