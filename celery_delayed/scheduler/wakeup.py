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

logger = logging.getLogger("celery_delayed.scheduler")


class WakeListener:
    """Runs a thread that turns wake-channel messages into callbacks.

    Args:
        store: the store whose wake channel to follow.
        on_due: called with (shard, due ms) for a job due earlier than known.
        on_members: called with the owner token of a scheduler that joined or left.
        on_subscribed: called after every (re)subscription, because wake-ups
            published while the listener was not subscribed are lost.
    """

    def __init__(
        self,
        store: Store,
        on_due: Callable[[int, float], None],
        on_members: Callable[[str], None],
        on_subscribed: Callable[[], None],
    ) -> None:
        self.store = store
        self.on_due = on_due
        self.on_members = on_members
        self.on_subscribed = on_subscribed
        self.subscribed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the listener thread (a daemon: it never holds the process up)."""
        self._thread = threading.Thread(target=self._run, name="delayed-wake", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        """Stop the thread; it notices within about a second."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            sub: WakeSubscription | None = None
            try:
                sub = self.store.fleet.subscribe_wake()
                while not self._stop.is_set():
                    # A 1 s read timeout is local only: no command is sent.
                    event = sub.get(timeout=1.0)
                    if event is None:
                        continue
                    kind, data = event
                    if kind == "subscribed":
                        self.subscribed.set()
                        backoff = 0.1
                        self.on_subscribed()
                    elif kind == "members":
                        self.on_members(data)
                    else:
                        self._dispatch_due(data)
            except Exception as exc:
                self.subscribed.clear()
                if self._stop.is_set():
                    break
                logger.warning("wake-up listener: %s; resubscribing in %.1fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if sub is not None:
                    try:
                        sub.close()
                    except Exception:
                        logger.debug("closing the wake-up listener failed", exc_info=True)
        self.subscribed.clear()

    def _dispatch_due(self, data: str) -> None:
        shard_s, _, due_s = data.partition(":")
        try:
            shard, due = int(shard_s), float(due_s)
        except ValueError:
            logger.debug("ignoring wake-up message %r", data)
            return
        self.on_due(shard, due)
