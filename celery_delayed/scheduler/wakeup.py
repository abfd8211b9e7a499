"""The wake-up listener: a thread subscribed to the store's wake channel.

``schedule.lua`` (and ``reschedule.lua``) publish ``"<shard>:<due_ms>"`` on
``{prefix}:wake`` when a job is due earlier than the shard's known next due
time, so a sleeping scheduler releases it on time without polling.
Schedulers also publish ``"members|<owner>"`` there when they join or leave,
so the others rebalance the shards at once instead of at their next
heartbeat.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

logger = logging.getLogger("celery_delayed.scheduler")

#: Payload prefix of a membership notice on the wake channel.
MEMBERS = "members|"


def redis_client(url: str, *, health_check_interval: int = 0) -> redis.Redis:
    """A Redis client for scheduler threads: fails fast instead of retrying for long.

    redis-py's default retries a failed command up to ten times with growing
    back-off; a scheduler does its own back-off, and must stay responsive to
    SIGTERM while Redis is down, so a command is retried once, quickly (to
    replace a connection that a Redis restart broke).
    """
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        health_check_interval=health_check_interval,
        socket_connect_timeout=2,
        socket_timeout=10,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1),
    )


class WakeListener:
    """Runs a thread that turns wake-channel messages into callbacks.

    Args:
        url: the store's Redis URL.
        channel: the wake channel (``Keys.wake``).
        on_due: called with (shard, due ms) for a job due earlier than known.
        on_members: called with the owner token of a scheduler that joined or left.
        on_subscribed: called after every (re)subscription, because wake-ups
            published while the listener was not subscribed are lost.
    """

    def __init__(
        self,
        url: str,
        channel: str,
        on_due: Callable[[int, float], None],
        on_members: Callable[[str], None],
        on_subscribed: Callable[[], None],
    ) -> None:
        self.url = url
        self.channel = channel
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
            client = redis_client(self.url, health_check_interval=30)
            pubsub: Any = client.pubsub()  # type: ignore[no-untyped-call]
            try:
                pubsub.subscribe(self.channel)
                while not self._stop.is_set():
                    # A 1 s read timeout is local only: no command is sent.
                    msg = pubsub.get_message(timeout=1.0)
                    if msg is None:
                        continue
                    if msg.get("type") == "subscribe":
                        self.subscribed.set()
                        backoff = 0.1
                        self.on_subscribed()
                    elif msg.get("type") == "message":
                        self._dispatch(str(msg["data"]))
            except Exception as exc:
                self.subscribed.clear()
                if self._stop.is_set():
                    break
                logger.warning("wake-up listener: %s; resubscribing in %.1fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                try:
                    pubsub.close()
                    client.close()
                except Exception:
                    logger.debug("closing the wake-up listener failed", exc_info=True)
        self.subscribed.clear()

    def _dispatch(self, data: str) -> None:
        if data.startswith(MEMBERS):
            self.on_members(data[len(MEMBERS):])
            return
        shard_s, _, due_s = data.partition(":")
        try:
            shard, due = int(shard_s), float(due_s)
        except ValueError:
            logger.debug("ignoring wake-up message %r", data)
            return
        self.on_due(shard, due)
