"""One table of settings: the config object and the validation agree with it.

The docs' settings page is generated from the same table (docs/_ext/delayed_docs.py).
"""

from __future__ import annotations

from dataclasses import fields

import pytest
from celery import Celery

from celery_delayed.config import SETTINGS, DelayedConfig, resolve
from celery_delayed.errors import ConfigurationError


def test_config_fields_are_the_settings_table():
    assert [f.name for f in fields(DelayedConfig)] == [s.key for s in SETTINGS]


def test_each_setting_is_validated():
    for s in SETTINGS:
        if s.kind is bool:
            bad: object = "yes"
        elif s.kind is str:
            bad = 5
        else:
            bad = "5"
        app = Celery(set_as_current=False, broker="redis://127.0.0.1:1/0")
        app.conf[s.name] = bad
        with pytest.raises(ConfigurationError, match=s.name):
            DelayedConfig.from_app(app)


def test_resolve_precedence():
    cfg = DelayedConfig.defaults(redis_url="redis://x")

    class Task:
        max_attempts = 7

    assert resolve(3, Task, "max_attempts", cfg) == 3
    assert resolve(None, Task, "max_attempts", cfg) == 7
    assert resolve(None, object(), "max_attempts", cfg) == cfg.max_attempts == 4
    assert resolve(None, None, "max_lateness", cfg, "max_lateness_s") is None


@pytest.mark.parametrize("url", ["redis://h:7000/3", "redis://h:7000?db=2", "rediss://u:p@h:7000/1"])
def test_a_cluster_store_url_with_another_database_is_refused(url):
    app = Celery("c", broker="amqp://", set_as_current=False)
    app.conf.update(delayed_redis_url=url, delayed_redis_cluster=True)
    with pytest.raises(ConfigurationError, match="database 0 only"):
        DelayedConfig.from_app(app)


@pytest.mark.parametrize("url", ["redis://h:7000/0", "redis://h:7000", "redis://h:7000/"])
def test_a_cluster_store_url_with_database_0_or_none_is_accepted(url):
    app = Celery("c", broker="amqp://", set_as_current=False)
    app.conf.update(delayed_redis_url=url, delayed_redis_cluster=True)
    assert DelayedConfig.from_app(app).redis_cluster is True


def test_redis_cluster_is_auto_by_default_and_takes_true_false_or_auto():
    app = Celery("c", broker="amqp://", set_as_current=False)
    app.conf.update(delayed_redis_url="redis://h:7000/3")  # "auto": a database is refused only on a cluster found
    assert DelayedConfig.from_app(app).redis_cluster == "auto"
    for value in (True, False, "auto"):
        app.conf.update(delayed_redis_url="redis://h:7000/0", delayed_redis_cluster=value)
        assert DelayedConfig.from_app(app).redis_cluster == value
    app.conf.update(delayed_redis_cluster="yes")
    with pytest.raises(ConfigurationError, match=r"must be True, False or 'auto', got str 'yes'"):
        DelayedConfig.from_app(app)


def test_auto_accepts_a_sentinel_url_which_true_refuses_and_a_cluster_takes_wait_replicas():
    app = Celery("c", broker="amqp://", set_as_current=False)
    app.conf.update(delayed_redis_url="sentinel://h:26379", delayed_redis_options={"master_name": "m"},
                    delayed_wait_replicas=1)
    assert DelayedConfig.from_app(app).redis_cluster == "auto"
    app.conf.update(delayed_redis_cluster=True)
    with pytest.raises(ConfigurationError, match="names Sentinels"):
        DelayedConfig.from_app(app)
    app.conf.update(delayed_redis_url="redis://h:7000/0", delayed_redis_options={})
    assert DelayedConfig.from_app(app).wait_replicas == 1  # WAIT per master (tests/cluster/test_cluster_wait.py)
