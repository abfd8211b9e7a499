"""The app's migrations make the same schema as ``delayed db init``, on PostgreSQL and SQLite.

One schema, two ways to create it: ``manage.py migrate`` (the app's
migrations) and ``celery -A proj delayed db init`` (SQLAlchemy's
``create_all``). Both databases are read back with SQLAlchemy's inspector
and compared: tables, columns (type, nullability, default), primary keys,
indexes, unique constraints, and the schema version recorded.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from conftest import database_alias
from django.core.management import call_command
from sqlalchemy import create_engine, inspect, text

from celery_delayed import apply_later
from celery_delayed.sql.rows import JobRows
from celery_delayed.sql.schema import SCHEMA_VERSION


def schema_of(url: str) -> dict[str, Any]:
    """The celery-delayed tables of a database as SQLAlchemy's inspector reads them, and the recorded version."""
    engine = create_engine(url)
    try:
        insp = inspect(engine)
        out: dict[str, Any] = {}
        for t in sorted(n for n in insp.get_table_names() if n.startswith("delayed_")):
            pk = insp.get_pk_constraint(t)
            out[t] = {
                "columns": [(c["name"], str(c["type"]), c["nullable"], c.get("default")) for c in insp.get_columns(t)],
                "pk": (pk.get("name"), tuple(pk["constrained_columns"])),
                "indexes": sorted((i["name"], tuple(i["column_names"]), bool(i["unique"]))
                                  for i in insp.get_indexes(t)),
                "unique": sorted((u["name"], tuple(u["column_names"])) for u in insp.get_unique_constraints(t)),
            }
        if "delayed_schema" in out:
            with engine.connect() as conn:
                out["version"] = conn.execute(text("SELECT name, version FROM delayed_schema")).all()
        return out
    finally:
        engine.dispose()


@contextmanager
def fresh_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """Another empty database of the same kind (its SQLAlchemy URL)."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'init.db'}"
        return
    from support.databases import postgres_database

    with postgres_database() as url:
        yield url


def migrate(url: str, *args: str) -> None:
    with database_alias(url) as alias:
        call_command("migrate", "celery_delayed", *args, database=alias, verbosity=0, interactive=False)


def test_migrate_and_db_init_give_the_same_schema(dj: str, database_url: str, admin_app: Celery,
                                                  tmp_path: Path) -> None:
    migrate(database_url)
    kind = "sqlite" if database_url.startswith("sqlite") else "postgresql"
    with fresh_database(kind, tmp_path) as other:
        assert JobRows(admin_app, other).init_schema() == SCHEMA_VERSION
        made_by_init = schema_of(other)
    made_by_migrate = schema_of(database_url)
    assert set(made_by_migrate) == {"delayed_jobs", "delayed_schema", "delayed_stores", "version"}
    assert made_by_migrate == made_by_init
    assert made_by_migrate["version"] == [("celery_delayed", SCHEMA_VERSION)]


def test_a_migrated_database_is_one_celery_delayed_writes_its_jobs_to(dj: str, database_url: str, redis_url: str,
                                                                      uid: str) -> None:
    from support import make_app

    migrate(database_url)
    JobRows(make_app(redis_url, uid), database_url).check_schema()  # no "run db init"
    app = make_app(redis_url, uid, delayed_database_url=database_url)

    @app.task(name="shop.remind", shared=False)
    def remind(order: int) -> int:
        return order

    h = apply_later(app, "shop.remind", (1,), when=60)
    from celery_delayed.sql.rows import get_rows

    rows = get_rows(app)
    assert rows is not None and rows.counts() == {"SCHEDULED": 1}
    assert h.job_state == "SCHEDULED"
    rows.engine.dispose()


def test_migrate_adopts_tables_db_init_made_and_upgrades_version_1(dj: str, admin_app: Celery,
                                                                   tmp_path: Path) -> None:
    current = f"sqlite:///{tmp_path / 'v2.db'}"
    JobRows(admin_app, current).init_schema()
    before = schema_of(current)
    migrate(current)  # the tables exist: nothing fails, nothing changes
    assert schema_of(current) == before

    old = f"sqlite:///{tmp_path / 'v1.db'}"
    JobRows(admin_app, old).init_schema()
    engine = create_engine(old)
    with engine.begin() as conn:  # what db init made before delayed_stores: schema version 1
        conn.execute(text("DROP TABLE delayed_stores"))
        conn.execute(text("UPDATE delayed_schema SET version = 1"))
    engine.dispose()
    with pytest.raises(Exception, match="schema version 1"):
        JobRows(admin_app, old).check_schema()
    migrate(old)
    assert schema_of(old) == before
    JobRows(admin_app, old).check_schema()


def test_migrate_backwards_drops_the_tables_and_db_init_after_migrate_changes_nothing(
        dj: str, admin_app: Celery, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'both.db'}"
    migrate(url)
    migrated = schema_of(url)
    assert JobRows(admin_app, url).init_schema() == SCHEMA_VERSION
    assert schema_of(url) == migrated
    migrate(url, "0001")
    assert "delayed_stores" not in schema_of(url)
    assert schema_of(url)["version"] == [("celery_delayed", 1)]
    migrate(url, "zero")
    assert schema_of(url) == {}
    migrate(url)
    assert schema_of(url) == migrated


def test_the_models_need_no_new_migration(dj: str) -> None:
    call_command("makemigrations", "celery_delayed", check=True, dry_run=True, verbosity=0)


def test_another_database_gets_no_tables_and_a_warning(dj: str) -> None:
    from celery_delayed.contrib.django.operations import TablesSQL

    class Editor:  # a schema editor on a database the source of truth does not support
        class connection:
            alias, vendor = "default", "mysql"

        def execute(self, sql: str, params: Any = None) -> None:
            raise AssertionError(f"ran {sql!r}")

    op = TablesSQL(["CREATE TABLE x (a INT)"], ["DROP TABLE x"], "Create x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        op.database_forwards("celery_delayed", Editor(), None, None)
    assert any("PostgreSQL and SQLite only" in str(w.message) and "mysql" in str(w.message) for w in caught)
