"""The wake-up listener: a thread subscribed to the store's wake channel.

``schedule.lua`` (and the other scripts that index a job) publish
``"<shard>:<due_ms>"`` on ``{prefix}:wake`` when a job is due earlier than the
shard's known next due time, so a sleeping scheduler releases it on time
without polling. Schedulers also publish ``"members|<owner>"`` there when they
join or leave, so the others take or give up shards at once instead of at their
next heartbeat. The subscription itself is the store's
(:meth:`Store.subscribe_wake <celery_delayed.store.Store.subscribe_wake>`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..store import Store, WakeSubscription
from ..threads import BackgroundThread

logger = logging.getLogger("celery_delayed.scheduler")


class WakeListener(BackgroundThread):
    """A daemon thread that turns wake-channel messages into callbacks (:meth:`start` it, :meth:`stop` it).

    Args:
        store: the store whose wake channel to follow.
        on_due: called with (shard, due ms) for a job due earlier than known.
        on_members: called with the owner token of a scheduler that joined or left.
        on_subscribed: called after every (re)subscription, because wake-ups
            published while the listener was not subscribed are lost.
    """

    backoff_s = 0.1  # before subscribing again: doubled after each failure, at most max_backoff_s
    max_backoff_s = 5.0
    stop_timeout_s = 3.0  # it notices a stop within about a second (the read timeout)

    def __init__(
        self,
        store: Store,
        on_due: Callable[[int, float], None],
        on_members: Callable[[str], None],
        on_subscribed: Callable[[], None],
    ) -> None:
        super().__init__(name="delayed-wake")
        self.store = store
        self.on_due = on_due
        self.on_members = on_members
        self.on_subscribed = on_subscribed
        self.subscribed = threading.Event()
        self._sub: WakeSubscription | None = None
        self._retries = 0  # failures since the last subscription went through (not since the last read)

    def body(self) -> float:
        """Subscribe if not subscribed; read one message (waiting up to a second) and call its callback."""
        if self._sub is None:
            self._sub = self.store.fleet.subscribe_wake()
        # A 1 s read timeout is local only: no command is sent.
        event = self._sub.get(timeout=1.0)
        if event is not None:
            kind, data = event
            if kind == "subscribed":
                self.subscribed.set()
                self._retries = 0
                self.on_subscribed()
            elif kind == "members":
                self.on_members(data)
            else:
                self._dispatch_due(data)
        return 0.0  # the read itself waited

    def on_error(self, exc: Exception) -> float:
        """Drop the subscription and subscribe again after a back-off."""
        self.subscribed.clear()
        self._close()
        if self.stopping:
            return 0.0
        self._retries += 1
        delay = self.backoff(self._retries)
        logger.warning("wake-up listener: %s; resubscribing in %.1fs", exc, delay)
        return delay

    def on_exit(self) -> None:
        """Close the subscription."""
        self._close()
        self.subscribed.clear()

    def _close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                sub.close()
            except Exception:
                logger.debug("closing the wake-up listener failed", exc_info=True)

    def _dispatch_due(self, data: str) -> None:
        shard_s, _, due_s = data.partition(":")
        try:
            shard, due = int(shard_s), float(due_s)
        except ValueError:
            logger.debug("ignoring wake-up message %r", data)
            return
        self.on_due(shard, due)
