"""The engine for a ``delayed_database_url``, checked first by :func:`celery_delayed.database_urls.check_database_url`.

:func:`engine_for` makes the engine, where SQLAlchemy's own parser and the
driver's import have the last word, with the same kind of error as the check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..database_urls import EXAMPLES, check_database_url
from ..errors import ConfigurationError
from ..redis_urls import redact

if TYPE_CHECKING:
    from sqlalchemy import Engine

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
            f"delayed_database_url {shown!r} cannot be used: {exc}. Use {EXAMPLES}") from exc
    except ImportError as exc:  # the URL's driver is not installed
        raise ConfigurationError(
            f"delayed_database_url {shown!r} needs the database driver {exc.name or exc}, which is not installed: "
            "pip install 'celery-delayed[sql]' brings psycopg 3 (postgresql+psycopg://...)") from exc
