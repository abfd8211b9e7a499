"""What a ``delayed_database_url`` may be: PostgreSQL or SQLite, as a SQLAlchemy URL, a database every process shares.

:func:`check_database_url` runs when the settings are read (every process,
so it imports nothing: SQLAlchemy is an optional extra, and a worker that
never writes a row should not pay for importing it). The engine itself is
made by :func:`celery_delayed.sql.urls.engine_for`.
"""

from __future__ import annotations

import re

from .errors import ConfigurationError
from .redis_urls import redact

#: The databases celery-delayed is tested on (the dialect part of the URL's scheme).
SUPPORTED = ("postgresql", "sqlite")

_SCHEME = re.compile(r"^(?P<dialect>[A-Za-z][A-Za-z0-9_]*)(?:\+(?P<driver>[A-Za-z0-9_]+))?://")

EXAMPLES = "postgresql+psycopg://user:password@host:5432/dbname or sqlite:////absolute/path/delayed.db"


def check_database_url(url: str) -> str:
    """Return ``url`` if it names a PostgreSQL or SQLite database that processes can share.

    Raises:
        ConfigurationError: not a SQLAlchemy URL, another database, or an
            in-memory SQLite database (each process would have its own,
            empty one); the message names ``delayed_database_url``.
    """
    shown = redact(url)
    m = _SCHEME.match(url)
    if m is None:
        raise ConfigurationError(
            f"delayed_database_url must be a SQLAlchemy database URL such as {EXAMPLES}; got {shown!r}")
    dialect = m.group("dialect").lower()
    if dialect == "postgres":
        raise ConfigurationError(
            f"delayed_database_url {shown!r} starts with postgres://, which SQLAlchemy does not read: "
            "write postgresql+psycopg://...")
    if dialect not in SUPPORTED:
        raise ConfigurationError(
            f"delayed_database_url {shown!r} is a {dialect} URL: only PostgreSQL and SQLite are supported "
            f"({EXAMPLES})")
    if dialect == "sqlite" and _in_memory(url[m.end():]):
        raise ConfigurationError(
            f"delayed_database_url {shown!r} is an in-memory SQLite database: every process (producer, scheduler, "
            "`delayed db init`) would get its own, empty one. Give a file that they all reach: "
            "sqlite:////absolute/path/delayed.db")
    return url


def _in_memory(rest: str) -> bool:
    """Whether the part of a ``sqlite://`` URL after ``//`` names an in-memory database."""
    path, _, query = rest.partition("?")
    db = path[1:] if path.startswith("/") else path  # sqlite:///x -> "x"; sqlite:// -> ""
    params = dict(p.partition("=")[::2] for p in query.split("&") if p)
    return db in ("", ":memory:") or db.startswith("file::memory:") or params.get("mode") == "memory"
