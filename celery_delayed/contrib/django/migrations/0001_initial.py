"""Schema version 1: the jobs' rows (``delayed_jobs``) and the schema's version (``delayed_schema``).

The same tables and indexes as ``celery -A proj delayed db init`` (:mod:`celery_delayed.sql.schema`);
idempotent, so that tables ``db init`` made already are adopted. The admin's models are not tables.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.db import migrations, models

from celery_delayed.contrib.django.operations import TablesSQL

JOBS = """CREATE TABLE IF NOT EXISTS delayed_jobs (
    prefix VARCHAR(128) NOT NULL,
    id VARCHAR(512) NOT NULL,
    shard INTEGER NOT NULL,
    task VARCHAR(255) NOT NULL,
    queue VARCHAR(255) NOT NULL,
    state VARCHAR(16) NOT NULL,
    due_ms BIGINT NOT NULL,
    record TEXT NOT NULL,
    idempotency_key TEXT,
    key_hash VARCHAR(64),
    generation INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    created_ms BIGINT NOT NULL,
    updated_ms BIGINT NOT NULL,
    finished_ms BIGINT,
    PRIMARY KEY (prefix, id)
)"""

SCHEMA = """CREATE TABLE IF NOT EXISTS delayed_schema (
    name VARCHAR(64) NOT NULL,
    version INTEGER NOT NULL,
    PRIMARY KEY (name)
)"""

# A database that db init made already keeps its version (never lowered).
VERSION_1 = """INSERT INTO delayed_schema (name, version)
SELECT 'celery_delayed', 1 WHERE NOT EXISTS (SELECT 1 FROM delayed_schema WHERE name = 'celery_delayed')"""


def _unmanaged(name: str, verbose: str, verbose_plural: str, permissions: tuple[str, ...]) -> Any:
    return migrations.CreateModel(
        name=name,
        fields=[("id", models.CharField(max_length=512, primary_key=True, serialize=False, verbose_name="id"))],
        options={"verbose_name": verbose, "verbose_name_plural": verbose_plural, "managed": False,
                 "default_permissions": permissions},
    )


class Migration(migrations.Migration):  # type: ignore[misc]  # Django is not type-checked here
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    operations: ClassVar[list[Any]] = [
        TablesSQL(
            forwards=[
                JOBS,
                "CREATE UNIQUE INDEX IF NOT EXISTS ux_delayed_jobs_key ON delayed_jobs (prefix, key_hash, generation)",
                "CREATE INDEX IF NOT EXISTS ix_delayed_jobs_state ON delayed_jobs (prefix, state, id)",
                "CREATE INDEX IF NOT EXISTS ix_delayed_jobs_created ON delayed_jobs (prefix, created_ms)",
                SCHEMA,
                VERSION_1,
            ],
            backwards=["DROP TABLE IF EXISTS delayed_jobs", "DROP TABLE IF EXISTS delayed_schema"],
            description="Create delayed_jobs and delayed_schema (celery-delayed schema version 1)",
        ),
        _unmanaged("PendingJob", "pending job", "pending jobs", ("view", "change")),
        _unmanaged("DeadLetter", "dead letter", "dead letters", ("view", "change", "delete")),
        _unmanaged("Schedule", "recurring schedule", "recurring schedules", ("view", "add", "change", "delete")),
    ]
