"""delayed_database_url: PostgreSQL or SQLite, a database every process shares, or a ConfigurationError naming it."""

from __future__ import annotations

import importlib.util

import pytest
from celery import Celery

from celery_delayed.config import DelayedConfig
from celery_delayed.errors import ConfigurationError
from celery_delayed.sql.rows import get_rows


def _app(url: str) -> Celery:
    app = Celery("d", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.update(delayed_database_url=url)
    return app


@pytest.mark.parametrize(("url", "says"), [
    ("not a url", "must be a SQLAlchemy database URL"),
    ("localhost/delayed", "must be a SQLAlchemy database URL"),
    ("mysql://user:secret@localhost/db", "only PostgreSQL and SQLite are supported"),
    ("mysql+pymysql://user@localhost/db", "only PostgreSQL and SQLite are supported"),
    ("oracle://user@localhost/db", "only PostgreSQL and SQLite are supported"),
    ("mssql+pyodbc://user@dsn", "only PostgreSQL and SQLite are supported"),
    ("postgres://user@localhost/db", "write postgresql\\+psycopg://"),
    ("sqlite:///:memory:", "in-memory SQLite database"),
    ("sqlite://", "in-memory SQLite database"),
    ("sqlite:///file::memory:?cache=shared&uri=true", "in-memory SQLite database"),
    ("sqlite:///file:jobs?mode=memory&cache=shared&uri=true", "in-memory SQLite database"),
])
def test_a_url_that_cannot_serve_is_refused_when_the_settings_are_read(url: str, says: str) -> None:
    """These gave SQLAlchemy's ArgumentError, a ModuleNotFoundError for a driver, or (in memory) a database
    of each process's own, at the first apply_later; now the settings are refused, naming the setting."""
    with pytest.raises(ConfigurationError, match=f"delayed_database_url.*{says}") as info:
        DelayedConfig.from_app(_app(url))
    assert "secret" not in str(info.value)  # a password is never printed


@pytest.mark.parametrize("url", [
    "postgresql+psycopg://postgres@127.0.0.1:5432/jobs",
    "postgresql://postgres:pw@db.internal/jobs?sslmode=require",
    "sqlite:////var/lib/app/delayed.db",
    "sqlite:///relative.db",
    "sqlite:///file:jobs.db?mode=rwc&uri=true",
])
def test_postgresql_and_sqlite_files_are_accepted(url: str) -> None:
    assert DelayedConfig.from_app(_app(url)).database_url == url


def test_a_driver_sqlalchemy_does_not_know_is_refused_at_the_engine() -> None:
    with pytest.raises(ConfigurationError, match=r"delayed_database_url 'postgresql\+nosuchdriver://h/db' cannot be"):
        get_rows(_app("postgresql+nosuchdriver://h/db"))


def test_a_driver_that_is_not_installed_is_refused_at_the_engine() -> None:
    assert importlib.util.find_spec("pg8000") is None  # not a dependency: SQLAlchemy knows it, it is not installed
    with pytest.raises(ConfigurationError, match="needs the database driver pg8000, which is not installed"):
        get_rows(_app("postgresql+pg8000://h/db"))


def test_the_commands_say_what_is_wrong_in_one_line(redis_url: str, uid: str) -> None:
    """``delayed db init`` printed a 30-line traceback for "not a url"; ``delayed status`` looked healthy on a
    MySQL URL. Both stop with the setting's error, without a traceback."""
    from support import run_celery

    init = run_celery(redis_url, f"t{uid}", f"q{uid}", "delayed", "db", "init",
                      conf={"delayed_database_url": "not a url"})
    assert init.returncode == 1 and "Traceback" not in init.stderr, init.stderr
    assert "delayed_database_url must be a SQLAlchemy database URL" in init.stderr
    status = run_celery(redis_url, f"t{uid}", f"q{uid}", "delayed", "status",
                        conf={"delayed_database_url": "mysql://u@localhost/db"})
    assert status.returncode == 1 and "Traceback" not in status.stderr, status.stderr
    assert "only PostgreSQL and SQLite are supported" in status.stderr
