"""Settings the Django way: ``CELERY_DELAYED_*`` in settings.py, read through Celery's ``namespace="CELERY"``;
``manage.py check`` says what is wrong; ``apply_later_on_commit`` follows the ``using=`` connection."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from conftest import database_alias
from django.core.checks import run_checks
from django.core.management import call_command
from django.db import transaction
from django.test import override_settings
from support import make_app

from celery_delayed import DelayedTask, get_config, lookup
from celery_delayed.sql.rows import get_rows


def django_app(redis_url: str, uid: str, namespace: str | None = "CELERY") -> Celery:
    """An app configured as Celery's Django guide does: from django.conf:settings."""
    app = Celery(f"dj{uid}", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace=namespace)
    app.conf.broker_url = redis_url
    app.set_current()
    return app


def test_celery_delayed_settings_come_from_django_settings(dj: str, redis_url: str, uid: str) -> None:
    schedule = {"poll": {"task": "feeds.poll", "schedule": 30.0, "args": ["main"]}}
    with override_settings(CELERY_DELAYED_KEY_PREFIX=f"dj{uid}", CELERY_DELAYED_SHARDS=4,
                           CELERY_DELAYED_MAX_ATTEMPTS=7, CELERY_DELAYED_SCHEDULE=schedule,
                           CELERY_DELAYED_RECORD_TTL_S=3600):
        cfg = get_config(django_app(redis_url, uid))
    assert (cfg.key_prefix, cfg.shards, cfg.max_attempts, cfg.schedule, cfg.record_ttl_s) == (
        f"dj{uid}", 4, 7, schedule, 3600)


def test_check_names_a_misspelt_setting(dj: str, redis_url: str, uid: str) -> None:
    with override_settings(CELERY_DELAYED_SHRADS=4):
        django_app(redis_url, uid)
        messages = run_checks(tags=["celery_delayed"])
    [w] = [m for m in messages if m.id == "celery_delayed.W001"]
    assert "CELERY_DELAYED_SHRADS is not a celery-delayed setting" in w.msg
    assert w.hint == "did you mean CELERY_DELAYED_SHARDS?"


def test_check_says_a_bad_value_and_an_app_that_does_not_see_the_settings(dj: str, redis_url: str,
                                                                         uid: str) -> None:
    with override_settings(CELERY_DELAYED_SHARDS=0):
        django_app(redis_url, uid)
        [e] = [m for m in run_checks(tags=["celery_delayed"]) if m.id == "celery_delayed.E001"]
        assert "delayed_shards" in e.msg
        django_app(redis_url, uid, namespace=None)  # CELERY_DELAYED_SHARDS is then not delayed_shards
        [w] = [m for m in run_checks(tags=["celery_delayed"]) if m.id == "celery_delayed.W002"]
    assert "does not see CELERY_DELAYED_SHARDS" in w.msg and "namespace='CELERY'" in w.hint
    with override_settings(CELERY_DELAYED_SHARDS=8):
        django_app(redis_url, uid)
        assert run_checks(tags=["celery_delayed"]) == []
        call_command("check", verbosity=0)  # manage.py check passes


@pytest.fixture
def pg_alias(dj: str) -> Any:
    from support.databases import postgres_database

    with postgres_database() as url, database_alias(url) as alias:
        call_command("migrate", "celery_delayed", database=alias, verbosity=0)
        yield url, alias


def _task(app: Celery) -> Any:
    @app.task(base=DelayedTask, name="shop.remind", shared=False)
    def remind(order: int) -> int:
        return order

    return remind


def test_apply_later_on_commit_writes_the_row_in_the_using_connections_transaction(
        pg_alias: tuple[str, str], redis_url: str, uid: str) -> None:
    url, alias = pg_alias
    app = make_app(redis_url, uid, delayed_database_url=url)
    remind = _task(app)
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        rolled = remind.apply_later_on_commit(args=(1,), when=60, using=alias)
        raise RuntimeError("rolled back")
    with transaction.atomic(using=alias):
        kept = remind.apply_later_on_commit(args=(2,), when=60, using=alias)
        assert kept is not None and not kept.indexed  # a row in this transaction, not in Redis yet
    rows = get_rows(app)
    assert rows is not None and rows.counts() == {"SCHEDULED": 1}
    assert lookup(app, kept.id).job_state == "SCHEDULED"  # indexed at the commit
    assert rolled is not None and rows.get(rolled.id) is None
    rows.engine.dispose()


def test_apply_later_on_commit_without_a_database_waits_for_the_using_connections_commit(
        pg_alias: tuple[str, str], redis_url: str, uid: str) -> None:
    _, alias = pg_alias
    app = make_app(redis_url, uid)
    remind = _task(app)
    from celery_delayed.store import Pending, get_store

    pending = Pending(get_store(app))
    with transaction.atomic(using=alias):
        assert remind.apply_later_on_commit(args=(1,), when=60, using=alias) is None
        with transaction.atomic():  # the default database's commit is not the one it waits for
            pass
        assert pending.count() == 0
    assert pending.count() == 1
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        remind.apply_later_on_commit(args=(2,), when=60, using=alias)
        raise RuntimeError("rolled back")
    assert pending.count() == 1
