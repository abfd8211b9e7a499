"""Messages a worker held when its Redis broker connection was lost go back to their queues promptly.

Upstream: kombu >=5.3.0,<5.8.0, its Redis transport's ``QoS.restore_unacked``
(through the channel's own connection; a restore that failed is not tried
again). The same code from 5.3.0 (the oldest kombu Celery 5.3 takes) to
5.7.0; still present in 5.7.0.

Delete when kombu restores a channel's unacknowledged messages once the
broker answers again after a failed restore (or kombu's Redis transport
restores them in some other way before its visibility timeout). Check a new
kombu version's ``restore_unacked`` before widening the range.

kombu's Redis transport keeps each delivered, unacknowledged message in its
unacked hash, and restores a channel's messages when the channel closes
(``QoS.restore_unacked``), through the channel's own connection. When the
channel closes *because* the broker went away (Redis restarted, failed over,
dropped the connection), that restore fails and the messages stay in the
unacked hash until kombu's visibility timeout (an hour by default) brings
them back; meanwhile Celery has dropped the requests it held (its consumer
clears them on a connection loss). Every prefetched message is exposed; with
look-ahead release (``delayed_lookahead_ms``) a worker also holds jobs ahead
of their due time, so more are.

:func:`install` (worker main process, ``worker_init``) wraps
``QoS.restore_unacked``: when it fails with a connection error, the delivery
tags it could not restore are kept, and a thread restores them with kombu's
own ``restore_by_tag`` (atomic: a message restored or acknowledged meanwhile
is left alone) on a new connection of the worker's app, as soon as the broker
answers again. A restored message is redelivered; one whose job already
started is dropped at start by the execution record.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

logger = logging.getLogger("celery_delayed.fixups")

_MARK = "_celery_delayed_keeps_orphans"
#: Give up after this long (kombu's visibility timeout brings them back by then anyway).
GIVE_UP_S = 3600.0

_lock = threading.Lock()
_pending: dict[str, None] = {}  # delivery tags to restore, in order
_app: Any = None
_thread: threading.Thread | None = None


def _connection_error(exc: BaseException) -> bool:
    import redis
    from kombu.exceptions import OperationalError

    return isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OperationalError,
                            ConnectionError, OSError))


def _wrap(restore_unacked: Any) -> Any:
    @functools.wraps(restore_unacked)
    def wrapper(self: Any, client: Any = None) -> Any:
        tags = list(getattr(self, "_delivered", {}) or ())
        try:
            return restore_unacked(self, client)
        except BaseException as exc:
            if tags and _connection_error(exc):
                keep(tags)
            raise

    setattr(wrapper, _MARK, True)
    return wrapper


def keep(tags: list[str]) -> None:
    """Restore these delivery tags once the broker answers (a thread does it)."""
    global _thread
    with _lock:
        for t in tags:
            _pending[str(t)] = None
        if _app is None or (_thread is not None and _thread.is_alive()):
            return
        _thread = threading.Thread(target=_restore_loop, name="celery-delayed-restore", daemon=True)
        _thread.start()
    logger.warning("broker connection lost with %d unacknowledged message(s): restoring them to their "
                   "queues when the broker is back", len(tags))


def _restore_loop() -> None:
    deadline = time.monotonic() + GIVE_UP_S
    pause = 0.5
    while time.monotonic() < deadline:
        with _lock:
            tags = list(_pending)
        if not tags:
            return
        try:
            restored = restore(tags)
        except Exception as exc:  # still down: try again
            logger.debug("restoring held messages failed (%s); retrying in %.1fs", exc, pause)
            time.sleep(pause)
            pause = min(pause * 2, 10.0)
            continue
        with _lock:
            for t in tags:
                _pending.pop(t, None)
        logger.info("restored %d message(s) this worker held when its broker connection was lost "
                    "(%d already acknowledged or restored)", restored, len(tags) - restored)
    logger.warning("gave up restoring %d held message(s): kombu's visibility timeout restores them", len(_pending))


def restore(tags: list[str]) -> int:
    """Restore these delivery tags with kombu's ``restore_by_tag`` on a new connection; return how many were held."""
    assert _app is not None
    with _app.connection_for_write() as conn:
        channel = conn.default_channel
        qos = channel.qos
        client = channel.client
        held = sum(1 for t in tags if client.hexists(qos.unacked_key, t))
        for t in tags:
            qos.restore_by_tag(t, client=client)
    return held


def install(app: Any) -> bool:
    """Wrap kombu's Redis ``QoS.restore_unacked`` in this process when ``app``'s broker is Redis (idempotent).

    Returns True when it applies. The kombu versions it applies to are checked by
    :func:`celery_delayed.fixups.install_fixups`.
    """
    global _app
    if not _redis_broker(app):
        return False
    from kombu.transport import redis as kredis

    if kredis.redis is None:
        return False
    _app = app
    qos = kredis.QoS
    if not getattr(vars(qos).get("restore_unacked"), _MARK, False):
        qos.restore_unacked = _wrap(vars(qos)["restore_unacked"])
    return True


def _redis_broker(app: Any) -> bool:
    conn = app.connection_for_write()
    try:
        return bool(conn.transport.driver_type == "redis")
    finally:
        conn.release()
