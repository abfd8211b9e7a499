"""Private databases for the durability tests: a PostgreSQL database per test (created and dropped), or SQLite."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from .apps import need, port_open

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@contextmanager
def postgres_database() -> Iterator[str]:
    """A new, empty PostgreSQL database on 127.0.0.1:5432; its SQLAlchemy URL. Dropped afterwards."""
    need("PostgreSQL on 127.0.0.1:5432", port_open("127.0.0.1", 5432))
    from sqlalchemy import create_engine, text

    name = f"delayed_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
