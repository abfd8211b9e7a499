"""Schema version 2: the store each prefix's rows belong to (``delayed_stores``), as ``db init`` makes it."""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations

from celery_delayed.contrib.django.operations import TablesSQL

STORES = """CREATE TABLE IF NOT EXISTS delayed_stores (
    prefix VARCHAR(128) NOT NULL,
    store_id VARCHAR(64) NOT NULL,
    redis TEXT NOT NULL,
    master VARCHAR(255),
    bound_ms BIGINT NOT NULL,
    PRIMARY KEY (prefix)
)"""


class Migration(migrations.Migration):  # type: ignore[misc]  # Django is not type-checked here
    dependencies: ClassVar[list[tuple[str, str]]] = [("celery_delayed", "0001_initial")]
    operations: ClassVar[list[Any]] = [
        TablesSQL(
            forwards=[STORES,
                      "UPDATE delayed_schema SET version = 2 WHERE name = 'celery_delayed' AND version < 2"],
            backwards=["DROP TABLE IF EXISTS delayed_stores",
                       "UPDATE delayed_schema SET version = 1 WHERE name = 'celery_delayed' AND version = 2"],
            description="Create delayed_stores (celery-delayed schema version 2)",
        ),
    ]
