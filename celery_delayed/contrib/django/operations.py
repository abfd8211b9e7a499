"""The migration operation that creates celery-delayed's tables: plain SQL, on PostgreSQL and SQLite.

The tables of the relational source of truth are defined once, in
:mod:`celery_delayed.sql.schema` (SQLAlchemy Core); ``delayed db init``
creates them from there. The migrations hold the same DDL as SQL text (what
SQLAlchemy emits for both databases, written out once, frozen with the
migration as Django's migrations are), each statement idempotent
(``IF NOT EXISTS``), so that ``migrate`` also adopts tables that ``db init``
made before the app was installed. ``tests/django/test_migrations.py``
checks that both ways give the same schema.

Django's models cannot describe these tables (a two-column primary key before
Django 5.2), so the operation runs SQL and changes no model state. It honours
database routers (``allow_migrate`` for app label ``celery_delayed``). On a
database other than PostgreSQL or SQLite (which the source of truth does not
support) it creates nothing and warns: the admin works without the tables.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

from django.db import router
from django.db.migrations.operations.base import Operation

logger = logging.getLogger("celery_delayed.django")

#: The databases the relational source of truth supports (Django's ``connection.vendor``).
VENDORS = ("postgresql", "sqlite")


class TablesSQL(Operation):  # type: ignore[misc]  # Django is not type-checked here
    """Run ``forwards`` (``backwards`` when unapplied) on PostgreSQL or SQLite; elsewhere nothing, with a warning."""

    reversible = True
    reduces_to_sql = True

    def __init__(self, forwards: Sequence[str], backwards: Sequence[str], description: str) -> None:
        self.forwards = list(forwards)
        self.backwards = list(backwards)
        self.description = description

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (f"{__name__}.{type(self).__qualname__}", [],
                {"forwards": self.forwards, "backwards": self.backwards, "description": self.description})

    def state_forwards(self, app_label: str, state: Any) -> None:
        """No model state: the tables are not Django models."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        self._execute(app_label, schema_editor, self.forwards)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        self._execute(app_label, schema_editor, self.backwards)

    def describe(self) -> str:
        return self.description

    def _execute(self, app_label: str, schema_editor: Any, statements: Sequence[str]) -> None:
        connection = schema_editor.connection
        if not router.allow_migrate(connection.alias, app_label):
            return
        if connection.vendor not in VENDORS:
            message = (f"celery_delayed: {self.description}: skipped on database {connection.alias!r} "
                       f"({connection.vendor}): celery-delayed's tables (delayed_database_url) are made on "
                       "PostgreSQL and SQLite only. The admin works without them")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            logger.warning("%s", message)
            return
        for sql in statements:
            schema_editor.execute(sql, params=None)
