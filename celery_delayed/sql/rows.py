"""The gateway to the relational source of truth: the only code that talks to the database.

One :class:`JobRows` per app (``get_rows``), on a SQLAlchemy engine made from
``delayed_database_url``. Database errors become
:class:`~celery_delayed.errors.DatabaseUnavailable` at this boundary (as Redis
errors become ``StoreUnavailable`` in the store's gateway).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from celery import Celery
from sqlalchemy import Connection, Engine, and_, delete, insert, or_, select, text, update
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, SQLAlchemyError

from ..config import get_config
from ..errors import ConfigurationError, DatabaseUnavailable, DuplicateJob
from ..redis_urls import redact
from ..store import NewJob, rehome, shard_for
from ..vocab import Field, JobState
from .schema import SCHEMA_VERSION, jobs, metadata, schema, stores
from .urls import engine_for

F = TypeVar("F", bound=Callable[..., Any])
_SCHEMA_NAME = "celery_delayed"


def key_hash(idempotency_key: str) -> str:
    """The idempotency key as the unique index holds it (sha256, hex)."""
    return hashlib.sha256(idempotency_key.encode("utf-8")).hexdigest()


def _translated(fn: F) -> F:
    """Database errors (down, refused, timed out) -> DatabaseUnavailable; constraint errors pass through."""

    @functools.wraps(fn)
    def wrapper(self: JobRows, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except IntegrityError:
            raise
        except (OperationalError, DBAPIError) as exc:
            raise DatabaseUnavailable(
                f"cannot use the celery-delayed database at {self.url_shown}: {exc.orig or exc}; nothing was "
                "written. Check that the database is running and delayed_database_url points at it"
            ) from exc
    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class Row:
    """One job as its row holds it."""

    id: str
    shard: int
    task: str
    state: str
    due_ms: int
    record: dict[str, str]
    idempotency_key: str | None
    generation: int
    created_ms: int
    attempts: int = 0
    finished_ms: int | None = None

    def home(self, shards: int) -> int:
        """The job's shard under a layout of ``shards`` (its row's ``shard`` may predate a reshard)."""
        return shard_for(self.record.get(Field.SHARD_KEY) or self.id, shards)

    def as_new_job(self, shards: int | None = None) -> NewJob:
        """The job as schedule.lua takes it, to index it in Redis again (in its home under ``shards``, if given)."""
        fields = {k: v for k, v in self.record.items() if k not in (Field.DUE, Field.CREATED, Field.STATE)}
        job = NewJob(self.id, self.shard, str(self.due_ms), fields)
        home = self.shard if shards is None else self.home(shards)
        return job if home == self.shard else rehome(job, home)


@dataclass(frozen=True)
class Binding:
    """The store a database's rows of one prefix belong to (``delayed_stores``)."""

    store_id: str
    redis: str  # its Redis URL, passwords hidden
    master: str | None  # its Sentinel master name
    bound_ms: int


def _row(r: Any) -> Row:
    return Row(r.id, r.shard, r.task, r.state, r.due_ms, json.loads(r.record), r.idempotency_key, r.generation,
               r.created_ms, r.attempts, r.finished_ms)


class JobRows:
    """The ``delayed_jobs`` rows of one store (one ``delayed_key_prefix``)."""

    def __init__(self, app: Celery, url: str, engine: Engine | None = None) -> None:
        self.app = app
        self.prefix = get_config(app).key_prefix
        self.url_shown = redact(url)
        self.engine = engine or engine_for(url)
        self._schema_ok = False
        #: When this process last found the rows bound to its store (monotonic; 0: not yet): ``binding.py``.
        self.bound_at = 0.0

    # -- schema ------------------------------------------------------------------------

    @_translated
    def init_schema(self) -> int:
        """Create the tables and indexes if missing and record the schema version; return it (idempotent)."""
        metadata.create_all(self.engine)
        with self.engine.begin() as conn:
            held = conn.execute(select(schema.c.version).where(schema.c.name == _SCHEMA_NAME)).scalar()
            if held is None:
                conn.execute(insert(schema).values(name=_SCHEMA_NAME, version=SCHEMA_VERSION))
            elif held < SCHEMA_VERSION:
                conn.execute(update(schema).where(schema.c.name == _SCHEMA_NAME).values(version=SCHEMA_VERSION))
            elif held > SCHEMA_VERSION:
                raise ConfigurationError(self._newer(held))
        self._schema_ok = True
        return SCHEMA_VERSION

    def _newer(self, held: int) -> str:
        return (f"the celery-delayed database at {self.url_shown} has schema version {held}, newer than this "
                f"celery-delayed's ({SCHEMA_VERSION}): upgrade celery-delayed on this host")

    @_translated
    def check_schema(self) -> None:
        """Refuse a database whose schema is missing or of another version (checked once).

        Raises:
            ConfigurationError: what is wrong and the command that fixes it.
        """
        if self._schema_ok:
            return
        try:
            with self.engine.connect() as conn:
                held = conn.execute(select(schema.c.version).where(schema.c.name == _SCHEMA_NAME)).scalar()
        except (OperationalError, DBAPIError) as exc:
            if "delayed_schema" not in str(exc):
                raise
            held = None
        if held is None:
            raise ConfigurationError(
                f"the celery-delayed tables are missing in {self.url_shown}: run `celery -A <app> delayed db init`")
        if held < SCHEMA_VERSION:
            raise ConfigurationError(
                f"the celery-delayed database at {self.url_shown} has schema version {held}, this celery-delayed "
                f"needs {SCHEMA_VERSION}: run `celery -A <app> delayed db init` to upgrade it")
        if held > SCHEMA_VERSION:
            raise ConfigurationError(self._newer(held))
        self._schema_ok = True

    @_translated
    def refresh_statistics(self) -> bool:
        """PostgreSQL: ``ANALYZE`` the jobs table when its planner statistics are missing or stale.

        The reconciler's reads (rows by state, ids that exist, rows created
        since) are index lookups only if the planner knows the table is large.
        A server with autovacuum off (or behind, after a bulk load) plans them
        from no statistics at all: on 1,000,000 rows one ``id IN (...)`` batch
        of 500 took a second (a scan of every row of the prefix) instead of a
        millisecond. So a pass starts with this check: ANALYZE when the table
        was never analyzed, or when more than a fifth of it changed since.
        Returns whether it ran ANALYZE (never on other databases).
        """
        if self.engine.dialect.name != "postgresql":
            return False
        q = text("SELECT n_live_tup, n_mod_since_analyze, last_analyze, last_autoanalyze "
                 "FROM pg_stat_user_tables WHERE relid = to_regclass(:t)")
        with self.engine.connect() as conn:
            row = conn.execute(q, {"t": jobs.name}).first()
        if row is None:
            return False
        live, changed, analyzed, auto = row
        if (analyzed is not None or auto is not None) and changed <= max(1000, live // 5):
            return False
        with self.engine.begin() as conn:
            conn.execute(text(f"ANALYZE {jobs.name}"))
        return True

    # -- the store these rows belong to --------------------------------------------------------

    @_translated
    def binding(self) -> Binding | None:
        """The store this prefix's rows belong to, or None (not bound yet)."""
        with self.engine.connect() as conn:
            r = conn.execute(select(stores).where(stores.c.prefix == self.prefix)).first()
        return None if r is None else Binding(r.store_id, r.redis, r.master, r.bound_ms)

    @_translated
    def bind(self, binding: Binding, replacing: str | None = None) -> Binding:
        """Bind this prefix's rows to a store; return the binding the database holds afterwards.

        ``replacing`` None: only when none is held (another process's
        binding, made first, wins and is returned). Otherwise: only while the
        binding held is that store id's (a rebind, or the same store's new
        address).
        """
        values = {"store_id": binding.store_id, "redis": binding.redis, "master": binding.master,
                  "bound_ms": binding.bound_ms}
        with self.engine.begin() as conn:
            if replacing is None:
                try:
                    with conn.begin_nested():
                        conn.execute(insert(stores).values(prefix=self.prefix, **values))
                except IntegrityError:
                    pass
            else:
                conn.execute(update(stores).where(stores.c.prefix == self.prefix, stores.c.store_id == replacing)
                             .values(**values))
        held = self.binding()
        assert held is not None
        return held

    # -- writing jobs -----------------------------------------------------------------------

    def values(self, job: NewJob, now_ms: int, generation: int = 0) -> dict[str, Any]:
        """The row of a prepared job (its due time resolved to epoch ms)."""
        due = int(job.due[1:]) + now_ms if job.due.startswith("+") else int(job.due)
        ik = job.fields.get(Field.IDEMPOTENCY_KEY) or None
        fields = job.full_fields(due)  # a compact job with its message rendered: the row rebuilds it alone
        record = {k: v for k, v in fields.items() if v}
        return {
            "prefix": self.prefix, "id": job.id, "shard": job.shard, "task": fields.get(Field.TASK, ""),
            "queue": fields.get(Field.QUEUE, ""), "state": JobState.SCHEDULED.value, "due_ms": due,
            "record": json.dumps(record, separators=(",", ":")), "idempotency_key": ik,
            "key_hash": key_hash(ik) if ik else None, "generation": generation, "attempts": 0,
            "created_ms": now_ms, "updated_ms": now_ms, "finished_ms": None,
        }

    def row_from_record(self, job_id: str, shard: int, rec: Mapping[str, str], now_ms: int) -> dict[str, Any]:
        """The row of a job known only from its Redis record (the reconciler adopts it)."""
        ik = rec.get(Field.IDEMPOTENCY_KEY) or None
        return {
            "prefix": self.prefix, "id": job_id, "shard": shard, "task": rec.get(Field.TASK, ""),
            "queue": rec.get(Field.QUEUE, ""), "state": rec.get(Field.STATE, JobState.SCHEDULED),
            "due_ms": int(float(rec.get(Field.DUE, now_ms))),
            "record": json.dumps({k: v for k, v in rec.items() if v}, separators=(",", ":")),
            "idempotency_key": ik, "key_hash": key_hash(ik) if ik else None,
            "generation": int(rec.get(Field.GENERATION, 0) or 0), "attempts": int(rec.get(Field.ATTEMPT, 0) or 0),
            "created_ms": int(float(rec.get(Field.CREATED, now_ms))), "updated_ms": now_ms, "finished_ms": None,
        }

    @_translated
    def insert(self, rows: Sequence[Mapping[str, Any]], connection: Connection | Any = None) -> None:
        """Insert rows: in ``connection``'s transaction when given (a ``Connection`` or ``Session``; the
        caller commits), else committed here.

        Raises:
            DuplicateJob: a job id or an idempotency key's generation is taken.
            DatabaseUnavailable: the database cannot be used; nothing was written.
        """
        if not rows:
            return
        try:
            if connection is not None:
                connection.execute(insert(jobs), list(rows))
                return
            with self.engine.begin() as conn:
                conn.execute(insert(jobs), list(rows))
        except IntegrityError as exc:
            raise DuplicateJob(str(rows[0]["id"]) if len(rows) == 1 else f"one of {len(rows)} jobs",
                               "in the database") from exc

    @_translated
    def replace_cancelled(self, values: Mapping[str, Any], connection: Any = None) -> bool:
        """Turn a key's cancelled job's row into its next generation (``values``: the new row).

        A job id is one row: the next generation of an idempotency key's job
        keeps the id and replaces the row, only while it holds the previous
        generation (the caller saw it cancelled, in the row or in Redis).
        Returns False when another producer replaced it first.
        """
        c = jobs.c
        q = (update(jobs).where(c.prefix == self.prefix, c.id == values["id"],
                                c.generation == int(values["generation"]) - 1)
             .values(**{k: v for k, v in values.items() if k not in ("prefix", "id")}))
        if connection is not None:
            return bool(connection.execute(q).rowcount)
        with self.engine.begin() as conn:
            return bool(conn.execute(q).rowcount)

    def insert_django(self, rows: Sequence[Mapping[str, Any]], connection: Any) -> None:
        """Insert rows through a Django connection, in its current transaction (the caller commits).

        Raises:
            DuplicateJob: a job id or an idempotency key's generation is taken.
        """
        from django.db import IntegrityError as DjangoIntegrityError

        cols = [c.name for c in jobs.columns]
        sql = f"INSERT INTO {jobs.name} ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))})"
        try:
            with connection.cursor() as cursor:
                cursor.executemany(sql, [[r.get(c) for c in cols] for r in rows])
        except DjangoIntegrityError as exc:
            raise DuplicateJob(str(rows[0]["id"]) if len(rows) == 1 else f"one of {len(rows)} jobs",
                               "in the database") from exc

    @_translated
    def latest_for_keys(self, hashes: Iterable[str]) -> dict[str, Row]:
        """The latest generation's row of each idempotency key hash that has one."""
        hashes = list(set(hashes))
        out: dict[str, Row] = {}
        if not hashes:
            return out
        with self.engine.connect() as conn:
            for i in range(0, len(hashes), 500):
                chunk = hashes[i:i + 500]
                q = select(jobs).where(jobs.c.prefix == self.prefix, jobs.c.key_hash.in_(chunk))
                for r in conn.execute(q):
                    held = out.get(r.key_hash)
                    if held is None or r.generation > held.generation:
                        out[r.key_hash] = _row(r)
        return out

    # -- reading ---------------------------------------------------------------------------------

    @_translated
    def get(self, job_id: str) -> Row | None:
        """The row of one job, or None."""
        with self.engine.connect() as conn:
            r = conn.execute(select(jobs).where(jobs.c.prefix == self.prefix, jobs.c.id == job_id)).first()
        return None if r is None else _row(r)

    @_translated
    def page(self, states: Sequence[str], after_id: str = "", limit: int = 1000) -> list[Row]:
        """Rows in ``states`` with ids after ``after_id``, in id order (keyset pagination)."""
        q = (select(jobs).where(jobs.c.prefix == self.prefix, jobs.c.state.in_(list(states)), jobs.c.id > after_id)
             .order_by(jobs.c.id).limit(limit))
        with self.engine.connect() as conn:
            return [_row(r) for r in conn.execute(q)]

    @_translated
    def created_since(self, since_ms: int, after: tuple[int, str] = (0, ""), limit: int = 1000) -> list[Row]:
        """Rows created at or after ``since_ms`` still SCHEDULED, in (created, id) order after ``after``."""
        c = jobs.c
        after_ms, after_id = after
        # ``created_ms >= max(since, after)`` is what starts each page's index range where the last one
        # ended: the OR alone is not a range, and every page scanned the index from ``since_ms`` again.
        q = (select(jobs).where(c.prefix == self.prefix, c.created_ms >= max(since_ms, after_ms),
                                c.state == JobState.SCHEDULED,
                                or_(c.created_ms > after_ms, and_(c.created_ms == after_ms, c.id > after_id)))
             .order_by(c.created_ms, c.id).limit(limit))
        with self.engine.connect() as conn:
            return [_row(r) for r in conn.execute(q)]

    @_translated
    def existing(self, ids: Sequence[str]) -> set[str]:
        """Which of ``ids`` have a row."""
        out: set[str] = set()
        with self.engine.connect() as conn:
            for i in range(0, len(ids), 500):
                q = select(jobs.c.id).where(jobs.c.prefix == self.prefix, jobs.c.id.in_(list(ids[i:i + 500])))
                out.update(conn.execute(q).scalars())
        return out

    @_translated
    def counts(self) -> dict[str, int]:
        """Rows per state."""
        from sqlalchemy import func

        q = select(jobs.c.state, func.count()).where(jobs.c.prefix == self.prefix).group_by(jobs.c.state)
        with self.engine.connect() as conn:
            return {str(s): int(n) for s, n in conn.execute(q)}

    # -- mirroring Redis ------------------------------------------------------------------------

    @_translated
    def apply(self, changes: Sequence[Mapping[str, Any]]) -> int:
        """Apply state changes mirrored from Redis (each: id and the columns to set); return rows touched."""
        if not changes:
            return 0
        now = int(time.time() * 1000)
        n = 0
        with self.engine.begin() as conn:
            for ch in changes:
                values = {k: v for k, v in ch.items() if k != "id"} | {"updated_ms": now}
                res = conn.execute(update(jobs).where(jobs.c.prefix == self.prefix, jobs.c.id == ch["id"])
                                   .values(**values))
                n += res.rowcount or 0
        return n

    @_translated
    def adopt(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert rows for jobs found in Redis without one (skipping any that appeared meanwhile)."""
        n = 0
        with self.engine.begin() as conn:
            for row in rows:
                try:
                    with conn.begin_nested():
                        conn.execute(insert(jobs).values(**row))
                    n += 1
                except IntegrityError:
                    continue
        return n

    @_translated
    def set_shard(self, ids: Sequence[str], shard: int) -> int:
        """Record that the jobs of ``ids`` live in ``shard`` now (a reshard moved them); return how many rows."""
        if not ids:
            return 0
        with self.engine.begin() as conn:
            res = conn.execute(update(jobs).where(jobs.c.prefix == self.prefix, jobs.c.id.in_(list(ids)),
                                                  jobs.c.shard != shard).values(shard=shard))
        return int(res.rowcount or 0)

    def delete(self, ids: Sequence[str]) -> int:
        """Delete rows (jobs whose caller's transaction never committed its row: not called for those)."""
        if not ids:
            return 0
        with self.engine.begin() as conn:
            res = conn.execute(delete(jobs).where(jobs.c.prefix == self.prefix, jobs.c.id.in_(list(ids))))
        return res.rowcount or 0

    def dispose(self) -> None:
        """Close the engine's connections."""
        with contextlib.suppress(SQLAlchemyError):
            self.engine.dispose()


_ROWS_ATTR = "_celery_delayed_rows"


def get_rows(app: Celery) -> JobRows | None:
    """The app's job rows (None without ``delayed_database_url``), made on first use."""
    url = get_config(app).database_url
    if not url:
        return None
    rows: JobRows | None = app.__dict__.get(_ROWS_ATTR)
    if rows is None:
        rows = app.__dict__[_ROWS_ATTR] = JobRows(app, url)
    return rows
