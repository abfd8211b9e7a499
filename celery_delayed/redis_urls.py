"""Redis URLs: which URLs name a Redis, the Sentinels of a ``sentinel://`` URL, and URLs fit to print.

The forms are redis-py's and kombu's: ``redis://``, ``rediss://``,
``unix://`` (kombu: ``socket://``), and kombu's Sentinel transport's
``sentinel://[user:password@]host:port[/db];sentinel://host:port;...``, one
part per Sentinel. :func:`redact` is how the package prints any URL (the
store's, the broker's, the database's).

This module imports only the standard library and ``celery_delayed.errors``,
so that the settings (``config.py``) and the store's clients (``store/client.py``) both use it.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigurationError

#: URL schemes that name a Redis server (or Redis Sentinels).
REDIS_SCHEMES = ("redis", "rediss", "unix", "socket", "sentinel")
#: A Sentinel's port when its part of a ``sentinel://`` URL leaves it out.
SENTINEL_PORT = 26379
#: Shown in place of a password.
HIDDEN = "***"

_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.\-]*):")
# A ';' that starts another URL (the next Sentinel): a ';' inside a password or a query stays in its part.
_NEXT_URL = re.compile(r";(?=\s*[A-Za-z][A-Za-z0-9+.\-]*://)")
# A query parameter that holds a secret (redis-py takes ?password=..., ?ssl_password=...).
_SECRET_PARAM = re.compile(r"(?i)([?&][^=&#]*(?:pass|pwd|secret|token)[^=&#]*=)[^&#]*")


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names a Redis server or Redis Sentinels (by its scheme, :data:`REDIS_SCHEMES`)."""
    m = _SCHEME.match(url)
    return m is not None and m.group(1).lower() in REDIS_SCHEMES


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names Redis Sentinels (``sentinel://host:port;sentinel://host:port...``)."""
    return url.startswith("sentinel://")


def sentinel_hosts(url: str) -> list[tuple[str, int]]:
    """The (host, port) of each Sentinel of a ``sentinel://`` URL (port 26379 when left out).

    Raises:
        ConfigurationError: a part is not ``sentinel://host[:port]`` (with an optional
            ``user:password@`` and ``/db``).
    """
    hosts = []
    for part in url.split(";"):
        try:
            p = urlsplit(part.strip())
            port = p.port or SENTINEL_PORT
        except ValueError as exc:  # its text may quote the bad port, which may be a password
            why = "its port must be a number from 0 to 65535" if "port" in str(exc).lower() else "its host is not valid"
            raise ConfigurationError(f"bad Sentinel URL {redact(part)!r} in delayed_redis_url: {why}") from None
        if p.scheme != "sentinel" or not p.hostname or not re.fullmatch(r"(/\d*)?", p.path):
            raise ConfigurationError(
                f"bad Sentinel URL {redact(part)!r} in delayed_redis_url: every part must be "
                "sentinel://host:port (or sentinel://:password@host:port/db), parts separated by ';' "
                "(e.g. sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26379)")
        hosts.append((p.hostname, port))
    return hosts


def same_redis(a: str, b: str) -> bool:
    """Whether two Redis URLs name the same server and database.

    Two ``sentinel://`` URLs do when they list the same Sentinels and
    database (the caller compares the master names, which are options).
    """
    if is_sentinel_url(a) or is_sentinel_url(b):
        if not (is_sentinel_url(a) and is_sentinel_url(b)):
            return False
        return set(sentinel_hosts(a)) == set(sentinel_hosts(b)) and _db(a.split(";")[0]) == _db(b.split(";")[0])
    pa, pb = urlsplit(a), urlsplit(b)
    if pa.scheme in ("unix", "socket") or pb.scheme in ("unix", "socket"):
        return pa.path == pb.path
    if pa.scheme not in ("redis", "rediss") or pb.scheme not in ("redis", "rediss"):
        return False

    def db(p: Any) -> str:
        return (p.path or "/0").lstrip("/") or "0"

    host = {"localhost": "127.0.0.1"}
    return (
        host.get(pa.hostname or "localhost", pa.hostname) == host.get(pb.hostname or "localhost", pb.hostname)
        and (pa.port or 6379) == (pb.port or 6379)
        and db(pa) == db(pb)
    )


def _db(url: str) -> str:
    return (urlsplit(url).path or "/0").lstrip("/") or "0"


def broker_url(conf: Any) -> str:
    """The (first) broker URL of a Celery app's ``conf``, or ''."""
    broker = conf.broker_url or ""
    if isinstance(broker, (list, tuple)):
        broker = broker[0] if broker else ""
    return str(broker)


def redact(url: str) -> str:
    """``url`` fit to print: every password in it replaced by ``***``, the rest as written.

    Any URL (Redis, Sentinels, the broker, a database): the password of
    ``user:password@``, in each part of a ``sentinel://a;sentinel://b``
    URL, and query parameters that hold a secret (``?password=``,
    ``?ssl_password=``, ``token``, ``secret``). A URL without its host
    (``redis://:password``) shows no text after the colon either.
    """
    return ";".join(_redact_one(part) for part in _NEXT_URL.split(url))


def _redact_one(url: str) -> str:
    head, sep, rest = url.partition("://")
    if sep:
        query = rest.find("?")
        at = rest.rfind("@", 0, len(rest) if query < 0 else query)  # the last '@': a password may hold '@' or '/'
        if at >= 0:
            user, colon, _ = rest[:at].partition(":")
            if colon:
                rest = f"{user}:{HIDDEN}{rest[at:]}"
        else:
            end = re.search(r"[/?#]|$", rest)
            netloc_end = end.start() if end else len(rest)
            host, colon, port = rest[:netloc_end].rpartition(":")
            if colon and port and not port.isdigit() and "]" not in port:  # not a port: a password without its host
                rest = f"{host}:{HIDDEN}{rest[netloc_end:]}"
    return _SECRET_PARAM.sub(rf"\g<1>{HIDDEN}", head + sep + rest)
