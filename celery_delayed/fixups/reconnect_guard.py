"""A guarded workaround for a kombu 5.7 crash that stops a worker after its Redis broker restarts.

The crash: ``Unrecoverable error: AttributeError("'NoneType' object has no
attribute 'hostname'")`` in the worker's main process, after a Redis
SIGKILL or restart (7 of 8 runs here with prefork, 6 of 8 with threads).
Celery 5.7's reconnect path (``Consumer.on_connection_error_after_connected``,
added by celery PR #10242) calls ``connection.collect()`` then
``connection.close()``. ``collect()`` detaches the transport
(``transport.client = None``) but keeps the default channel; if that channel
survived the first close (a ``BRPOP`` was outstanding), the second close
restores its unacked messages through ``Channel._get_pool`` ->
``_connparams``, which reads ``self.connection.client.hostname`` with the
client gone. An ``AttributeError`` is not a connection error, so it escapes
``ignore_errors`` and the consumer dies (the same line as celery/kombu#582;
still unguarded in kombu ``main`` as of 2026-08).

The workaround makes a channel whose transport was detached fail the way a
dead broker connection fails: ``_get_pool`` raises
``redis.exceptions.ConnectionError``, which kombu and Celery already handle
(the consumer reconnects). Nothing changes for a channel whose transport is
attached. It is applied only to kombu 5.7.x, and only in worker processes
(``worker_init``, connected by :func:`celery_delayed.plugin.register_with_celery`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger("celery_delayed.worker")

#: kombu versions that need the guard and were tested with it: [low, high).
AFFECTED = ((5, 7, 0), (5, 8, 0))
_MARK = "_celery_delayed_detached_guard"


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def _guard(get_pool: Any) -> Any:
    @functools.wraps(get_pool)
    def _get_pool(self: Any, *args: Any, **kwargs: Any) -> Any:
        transport = self.connection
        if transport is None or getattr(transport, "client", None) is None:
            import redis

            logger.warning("a kombu Redis channel was used after its connection closed: raising "
                           "ConnectionError instead of AttributeError (celery-delayed's kombu 5.7 workaround)")
            raise redis.exceptions.ConnectionError("kombu channel used after its broker connection was closed")
        return get_pool(self, *args, **kwargs)

    setattr(_get_pool, _MARK, True)
    return _get_pool


def guard_detached_channels() -> bool:
    """Patch kombu's Redis channel classes in this process (idempotent); True when patched."""
    import kombu
    from kombu.transport import redis as kredis

    low, high = AFFECTED
    if kredis.redis is None or not low <= _version(kombu.__version__) < high:
        return False
    patched = False
    for cls in (kredis.Channel, getattr(kredis, "SentinelChannel", None)):
        if cls is None or "_get_pool" not in vars(cls) or getattr(vars(cls)["_get_pool"], _MARK, False):
            continue
        cls._get_pool = _guard(vars(cls)["_get_pool"])
        patched = True
    return patched


def guarded() -> bool:
    """Whether this process's kombu Redis channels carry the guard."""
    from kombu.transport import redis as kredis

    return bool(getattr(vars(kredis.Channel).get("_get_pool"), _MARK, False))


def on_worker_init(**_: Any) -> None:
    """``worker_init`` receiver: apply the guard in the worker's main process (before it connects)."""
    guard_detached_channels()


def on_worker_setup(**_: Any) -> None:
    """``celeryd_after_setup`` receiver: say so in the worker's log (configured by then)."""
    if guarded():
        logger.info("celery-delayed: guarded kombu's Redis channels against use after close (kombu 5.7 crash)")
