"""The relational source of truth: its tables, and the version that says whether they are current.

With ``delayed_database_url`` set, every job is a row of ``delayed_jobs``
first; Redis is the time index that releases it. ``celery -A proj delayed db
init`` creates the tables (idempotent) and records :data:`SCHEMA_VERSION` in
``delayed_schema``; a later celery-delayed refuses to run on an older schema
and says what to do.

``delayed_jobs``
    ===================  ========================================================
    prefix, id           the store's ``delayed_key_prefix`` and the job id (key)
    shard                the job's shard
    task, queue          task name, queue
    state                :class:`~celery_delayed.vocab.JobState` (mirrored from
                         Redis by the scheduler, see ``scheduler/mirror.py``)
    due_ms               due time, epoch ms
    record               JSON of the job's Redis record fields, the message
                         included: enough to rebuild the job in Redis
    idempotency_key      the key, when one was given
    key_hash             sha256 of the key (the unique index: keys can be long)
    generation           the key's generation (a cancel frees a key)
    attempts             executions begun
    created_ms,          when the row was written, last changed, finished
    updated_ms,
    finished_ms
    ===================  ========================================================

``delayed_stores``
    ===================  ========================================================
    prefix               the store's ``delayed_key_prefix`` (key)
    store_id             the id of the store (one Redis) whose jobs these rows are:
                         a random id kept in that store's layout record
    redis                the store's Redis URL (passwords hidden) when it was bound
    master               its Sentinel master name, with a ``sentinel://`` URL
    bound_ms             when it was bound
    ===================  ========================================================

    A database holds the rows of one store per prefix: a second store (another
    Redis) given the same database and prefix is refused
    (:mod:`celery_delayed.sql.binding`).

The Django app's migrations (``celery_delayed/contrib/django/migrations``)
create the same tables as SQL text: a change here needs a new migration there
too (``tests/django_app/test_django_migrations.py`` compares the two schemas).

Indexes: ``(prefix, state, id)`` for the reconciler's keyset scans,
``(prefix, created_ms)`` for the outbox sweep, and a unique
``(prefix, key_hash, generation)``: an idempotency key is used once per
generation, even across a Redis loss.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

#: The schema this celery-delayed writes; ``db init`` records it (2: ``delayed_stores`` added).
SCHEMA_VERSION = 2

metadata = MetaData()

jobs = Table(
    "delayed_jobs",
    metadata,
    Column("prefix", String(128), primary_key=True),
    Column("id", String(512), primary_key=True),
    Column("shard", Integer, nullable=False),
    Column("task", String(255), nullable=False),
    Column("queue", String(255), nullable=False, default=""),
    Column("state", String(16), nullable=False),
    Column("due_ms", BigInteger, nullable=False),
    Column("record", Text, nullable=False),
    Column("idempotency_key", Text, nullable=True),
    Column("key_hash", String(64), nullable=True),
    Column("generation", Integer, nullable=False, default=0),
    Column("attempts", Integer, nullable=False, default=0),
    Column("created_ms", BigInteger, nullable=False),
    Column("updated_ms", BigInteger, nullable=False),
    Column("finished_ms", BigInteger, nullable=True),
)
Index("ix_delayed_jobs_state", jobs.c.prefix, jobs.c.state, jobs.c.id)
Index("ix_delayed_jobs_created", jobs.c.prefix, jobs.c.created_ms)
Index("ux_delayed_jobs_key", jobs.c.prefix, jobs.c.key_hash, jobs.c.generation, unique=True)

schema = Table(
    "delayed_schema",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("version", Integer, nullable=False),
)

stores = Table(
    "delayed_stores",
    metadata,
    Column("prefix", String(128), primary_key=True),
    Column("store_id", String(64), nullable=False),
    Column("redis", Text, nullable=False),
    Column("master", String(255), nullable=True),
    Column("bound_ms", BigInteger, nullable=False),
)
