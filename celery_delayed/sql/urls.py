"""What a ``delayed_database_url`` may be: PostgreSQL or SQLite, as a SQLAlchemy URL, a database every process shares.

:func:`check_database_url` runs when the settings are read (every process,
so it imports nothing: SQLAlchemy is an optional extra, and a worker that
never writes a row should not pay for importing it); :func:`engine_for`
makes the engine, where SQLAlchemy's own parser and the driver's import
have the last word, with the same kind of error.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..errors import ConfigurationError
from ..redis_urls import redact

if TYPE_CHECKING:
    from sqlalchemy import Engine

#: The databases celery-delayed is tested on (the dialect part of the URL's scheme).
SUPPORTED = ("postgresql", "sqlite")

_SCHEME = re.compile(r"^(?P<dialect>[A-Za-z][A-Za-z0-9_]*)(?:\+(?P<driver>[A-Za-z0-9_]+))?://")

_EXAMPLES = "postgresql+psycopg://user:password@host:5432/dbname or sqlite:////absolute/path/delayed.db"


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
            f"delayed_database_url must be a SQLAlchemy database URL such as {_EXAMPLES}; got {shown!r}")
    dialect = m.group("dialect").lower()
    if dialect == "postgres":
        raise ConfigurationError(
            f"delayed_database_url {shown!r} starts with postgres://, which SQLAlchemy does not read: "
            "write postgresql+psycopg://...")
    if dialect not in SUPPORTED:
        raise ConfigurationError(
            f"delayed_database_url {shown!r} is a {dialect} URL: only PostgreSQL and SQLite are supported "
            f"({_EXAMPLES})")
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


def engine_for(url: str) -> Engine:
    """A SQLAlchemy engine for ``url`` (checked by :func:`check_database_url` first).

    Raises:
        ConfigurationError: SQLAlchemy or the URL's driver is not installed,
            or SQLAlchemy cannot read the URL.
    """
    check_database_url(url)
    shown = redact(url)
    try:
        from sqlalchemy import create_engine
        from sqlalchemy.exc import ArgumentError
    except ImportError as exc:
        raise ConfigurationError(
            "delayed_database_url is set, but SQLAlchemy is not installed: pip install 'celery-delayed[sql]'"
        ) from exc
    try:
        return create_engine(url, pool_pre_ping=True, future=True)
    except ArgumentError as exc:  # an unknown driver (postgresql+foo://), or a URL SQLAlchemy cannot read
        raise ConfigurationError(
            f"delayed_database_url {shown!r} cannot be used: {exc}. Use {_EXAMPLES}") from exc
    except ImportError as exc:  # the URL's driver is not installed
        raise ConfigurationError(
            f"delayed_database_url {shown!r} needs the database driver {exc.name or exc}, which is not installed: "
            "pip install 'celery-delayed[sql]' brings psycopg 3 (postgresql+psycopg://...)") from exc
