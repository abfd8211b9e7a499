"""Sentinel store URLs and delayed_wait_replicas: what the settings accept and refuse (no server needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery import Celery

from celery_delayed.config import DelayedConfig
from celery_delayed.doctor import PROBLEM, _broker_timeouts
from celery_delayed.errors import ConfigurationError
from celery_delayed.redis_urls import redact, same_redis, sentinel_hosts
from celery_delayed.store.client import make_client

URL = "sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26380;sentinel://10.0.0.3"


def _app(**conf: object) -> Celery:
    app = Celery("t", broker="memory://", set_as_current=False)
    app.conf.update(**conf)
    return app


def test_a_sentinel_url_with_its_master_name() -> None:
    cfg = DelayedConfig.from_app(_app(delayed_redis_url=URL, delayed_redis_options={"master_name": "m"}))
    assert cfg.redis_url == URL
    assert cfg.redis_options == {"master_name": "m"}
    assert sentinel_hosts(URL) == [("10.0.0.1", 26379), ("10.0.0.2", 26380), ("10.0.0.3", 26379)]


def test_a_sentinel_url_without_master_name_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"master_name"):
        DelayedConfig.from_app(_app(delayed_redis_url=URL))
    with pytest.raises(ConfigurationError, match=r"master_name"):
        DelayedConfig.from_app(_app(delayed_redis_url=URL, delayed_redis_options={"master_name": ""}))


@pytest.mark.parametrize("bad", [
    "sentinel://",
    "sentinel://h:26379;redis://h:6379",
    "sentinel://h:notaport",
    "sentinel://h:26379;;sentinel://g:26379",
    "sentinel://h:26379/zero",
])
def test_a_bad_sentinel_url_is_refused_with_what_to_write(bad: str) -> None:
    with pytest.raises(ConfigurationError, match=r"sentinel://host:port|bad Sentinel URL"):
        DelayedConfig.from_app(_app(delayed_redis_url=bad, delayed_redis_options={"master_name": "m"}))


def test_the_password_of_a_bad_url_is_not_in_the_message() -> None:
    with pytest.raises(ConfigurationError) as err:
        DelayedConfig.from_app(_app(delayed_redis_url="sentinel://:s3cret@h:26379;http://x",
                                    delayed_redis_options={"master_name": "m"}))
    assert "s3cret" not in str(err.value)
    assert redact("sentinel://:pw1@a:1;sentinel://u:pw2@b:2") == "sentinel://:***@a:1;sentinel://u:***@b:2"


def test_sentinel_options_with_a_plain_url_are_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"only a sentinel:// delayed_redis_url"):
        DelayedConfig.from_app(_app(delayed_redis_url="redis://h:6379/0", delayed_redis_options={"master_name": "m"}))


def test_redis_options_must_be_a_dict() -> None:
    with pytest.raises(ConfigurationError, match=r"delayed_redis_options must be a dict"):
        DelayedConfig.from_app(_app(delayed_redis_url=URL, delayed_redis_options="m"))


def test_the_store_on_the_brokers_sentinels_takes_the_brokers_options() -> None:
    app = _app(broker_url=URL, broker_transport_options={"master_name": "m", "visibility_timeout": 5,
                                                         "sentinel_kwargs": {"password": "x"}},
               broker_use_ssl={"ssl_cert_reqs": "required"})
    cfg = DelayedConfig.from_app(app)
    assert cfg.redis_url == URL
    assert cfg.redis_options == {"master_name": "m", "sentinel_kwargs": {"password": "x"}, "ssl": True,
                                 "ssl_cert_reqs": "required"}


def test_doctor_checks_the_visibility_timeout_of_a_sentinel_broker() -> None:
    app = _app(broker_url=URL, broker_transport_options={"master_name": "m", "visibility_timeout": 90_000},
               delayed_done_ttl_s=86_400)
    store = SimpleNamespace(app=app, config=DelayedConfig.from_app(app))  # the check reads the settings only
    [finding] = _broker_timeouts(store, 1.0)  # type: ignore[arg-type]
    assert (finding.level, finding.check) == (PROBLEM, "visibility_timeout"), finding


def test_same_redis_for_sentinel_urls() -> None:
    assert same_redis(URL, "sentinel://10.0.0.3:26379;sentinel://10.0.0.2:26380;sentinel://10.0.0.1")
    assert not same_redis(URL, URL.replace("26380", "26381"))
    assert not same_redis(URL, "redis://10.0.0.1:26379/0")
    assert not same_redis("sentinel://h:1/0", "sentinel://h:1/1")


def test_the_client_of_a_sentinel_url_asks_for_its_master() -> None:
    client = make_client("sentinel://u:pw@10.0.0.1:26379/2;sentinel://10.0.0.2",
                         options={"master_name": "m", "sentinel_kwargs": {"password": "sp"}, "ssl": True})
    pool = client.connection_pool
    assert pool.service_name == "m"  # type: ignore[attr-defined]
    manager = pool.sentinel_manager  # type: ignore[attr-defined]
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in manager.sentinels] == [("10.0.0.1", 26379), ("10.0.0.2", 26379)]
    assert manager.sentinels[0].connection_pool.connection_kwargs["password"] == "sp"
    kw = pool.connection_kwargs
    assert (kw["db"], kw["username"], kw["password"], kw["decode_responses"]) == (2, "u", "pw", True)
    assert "Sentinel" in pool.connection_class.__name__ and "SSL" in pool.connection_class.__name__


@pytest.mark.parametrize("value", [-1, 1.5, "1", True])
def test_wait_replicas_is_a_small_non_negative_int(value: object) -> None:
    with pytest.raises(ConfigurationError, match=r"delayed_wait_replicas"):
        DelayedConfig.from_app(_app(delayed_redis_url="redis://h/0", delayed_wait_replicas=value))
