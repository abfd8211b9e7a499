"""A kombu Redis channel used after its connection closed raises a connection error, not AttributeError.

Upstream: kombu >=5.7.0,<5.8.0, its Redis transport (``Channel._get_pool`` ->
``Channel._connparams``, the unguarded line of celery/kombu#582), reached
through Celery 5.7's reconnect path (celery/celery#10242). Still present in
kombu 5.7.0 with Celery 5.7.0.

Delete when kombu's Redis channel fails with a connection error once its
transport is detached, or Celery no longer closes a connection after
``collect()`` detached it. Check a new kombu version's ``_connparams`` before
widening the range.

The crash: ``Unrecoverable error: AttributeError("'NoneType' object has no
attribute 'hostname'")`` in the worker's main process, after a Redis
SIGKILL or restart (7 of 8 runs here with prefork, 6 of 8 with threads).
Celery 5.7's reconnect path (``Consumer.on_connection_error_after_connected``)
calls ``connection.collect()`` then ``connection.close()``. ``collect()``
detaches the transport (``transport.client = None``) but keeps the default
channel; if that channel
survived the first close (a ``BRPOP`` was outstanding), the second close
restores its unacked messages through ``Channel._get_pool`` ->
``_connparams``, which reads ``self.connection.client.hostname`` with the
client gone. An ``AttributeError`` is not a connection error, so it escapes
``ignore_errors`` and the consumer dies.

The correction makes a channel whose transport was detached fail the way a
dead broker connection fails: ``_get_pool`` raises
``redis.exceptions.ConnectionError``, which kombu and Celery already handle
(the consumer reconnects). Nothing changes for a channel whose transport is
attached. :func:`celery_delayed.fixups.install_fixups` applies it in worker
processes (``worker_init``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger("celery_delayed.fixups")

_MARK = "_celery_delayed_detached_guard"


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


def install() -> bool:
    """Patch kombu's Redis channel classes in this process (idempotent); True when patched.

    The kombu versions it applies to are checked by :func:`celery_delayed.fixups.install_fixups`.
    """
    from kombu.transport import redis as kredis

    if kredis.redis is None:
        return False
    patched = False
    for cls in (kredis.Channel, getattr(kredis, "SentinelChannel", None)):
        if cls is None or "_get_pool" not in vars(cls) or getattr(vars(cls)["_get_pool"], _MARK, False):
            continue
        cls._get_pool = _guard(vars(cls)["_get_pool"])
        patched = True
    return patched


def installed() -> bool:
    """Whether this process's kombu Redis channels carry the guard."""
    from kombu.transport import redis as kredis

    return bool(getattr(vars(kredis.Channel).get("_get_pool"), _MARK, False))


def on_worker_setup(**_: Any) -> None:
    """``celeryd_after_setup`` receiver: say so in the worker's log (configured by then)."""
    if installed():
        logger.info("celery-delayed: guarded kombu's Redis channels against use after close (kombu 5.7 crash)")
