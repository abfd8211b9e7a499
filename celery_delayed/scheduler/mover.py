"""Move one batch of due jobs of one shard onto the broker.

:class:`DirectMover` runs ``release_due.lua`` (the broker is Redis on the
store's server: exactly-once). :class:`PublishMover` claims with
``claim_due.lua``, publishes with kombu (publisher confirms where the
transport has them) and acknowledges with ``ack_claimed.lua``: at-least-once.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, Protocol

from celery import Celery
from kombu import Exchange, Queue

from ..store import Batch, Store

logger = logging.getLogger("celery_delayed.scheduler")

_RETRY_POLICY = {"max_retries": 3, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}


class Mover(Protocol):
    """Releases one batch of one shard."""

    def move(self, shard: int, owner: str, fence: str, limit: int) -> Batch: ...

    def close(self) -> None: ...


class _Events:
    """Sends ``task-sent`` events for released jobs when the app enables them."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.enabled = bool(app.conf.task_send_sent_event)
        self._dispatcher: Any = None

    def send(self, batch: Batch) -> None:
        if not self.enabled or not any(batch.events):
            return
        try:
            if self._dispatcher is None:
                conn = self.app.connection_for_write()
                self._dispatcher = self.app.events.Dispatcher(conn, enabled=True)
            for fields in batch.events:
                if fields:
                    self._dispatcher.send("task-sent", **fields)
        except Exception:  # events are best effort: the jobs were released already
            logger.exception("could not send task-sent events")
            self.close()

    def close(self) -> None:
        if self._dispatcher is not None:
            try:
                self._dispatcher.close()
                self._dispatcher.connection.release()
            except Exception:
                logger.debug("closing the event dispatcher failed", exc_info=True)
            self._dispatcher = None


class DirectMover:
    """Releases with one Lua script: remove from the schedule and LPUSH, atomically."""

    def __init__(self, app: Celery, store: Store) -> None:
        self.store = store
        self.events = _Events(app)

    def move(self, shard: int, owner: str, fence: str, limit: int) -> Batch:
        batch = self.store.release_due(shard, owner, fence, limit=limit)
        self.events.send(batch)
        return batch

    def close(self) -> None:
        self.events.close()


class PublishMover:
    """Claims due jobs, publishes each with kombu, then acknowledges the claims."""

    def __init__(self, app: Celery, store: Store) -> None:
        self.app = app
        self.store = store
        self.events = _Events(app)
        self._conn: Any = None
        self._producer: Any = None
        # Test hook: called with the batch after it was published, before the ack.
        self.before_ack: Callable[[Batch], None] | None = None

    def _get_producer(self) -> Any:
        if self._producer is None:
            conn = self.app.connection_for_write()
            if conn.transport.driver_type == "amqp":
                conn.transport_options.setdefault("confirm_publish", True)
            self._conn = conn
            self._producer = self.app.amqp.Producer(conn, auto_declare=False)
        return self._producer

    def move(self, shard: int, owner: str, fence: str, limit: int) -> Batch:
        batch = self.store.claim_due(shard, owner, fence, limit=limit)
        if not batch.ids:
            return batch
        try:
            producer = self._get_producer()
            for msg, ex, rk, q in batch.messages:
                self._publish(producer, msg, ex, rk, q)
        except Exception:
            # The claims stay in flight and are claimed again when they expire.
            self.close()
            raise
        if self.before_ack is not None:
            self.before_ack(batch)
        self.store.ack_claimed(shard, batch.ids)
        self.events.send(batch)
        return batch

    def _publish(self, producer: Any, msg: str, ex: str, rk: str, q: str) -> None:
        env = json.loads(msg)
        props = dict(env["properties"])
        body = base64.b64decode(env["body"]) if props.pop("body_encoding", None) == "base64" else env["body"]
        for name in ("delivery_info", "delivery_tag"):
            props.pop(name, None)
        headers = env["headers"]
        expiration = _remaining_s(headers.get("expires"))
        declare = []
        queue = self.app.amqp.queues.get(q) if q else None
        if isinstance(queue, Queue):
            declare.append(queue)
        exchange: Any = ex
        if ex and queue is not None and queue.exchange is not None and queue.exchange.name == ex:
            exchange = queue.exchange
        elif ex:
            exchange = Exchange(ex)
        producer.publish(
            body,
            exchange=exchange,
            routing_key=rk,
            content_type=env["content-type"],
            content_encoding=env["content-encoding"],
            headers=headers,
            declare=declare,
            retry=True,
            # Short: a stop waits for the batch in hand, and an unreachable
            # broker is the loop's to back off from (the claims stay in flight).
            retry_policy=_RETRY_POLICY,
            expiration=expiration,
            **props,
        )

    def close(self) -> None:
        self.events.close()
        if self._conn is not None:
            try:
                self._conn.release()
            except Exception:
                logger.debug("closing the publish connection failed", exc_info=True)
        self._conn = self._producer = None


def _remaining_s(expires: Any) -> float | None:
    """Seconds left until an ISO ``expires`` header (at least 0), or None."""
    if not expires:
        return None
    try:
        when = datetime.fromisoformat(str(expires))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def make_mover(app: Celery, store: Store) -> Mover:
    """The mover for the store's release path (``store.direct``)."""
    return DirectMover(app, store) if store.direct else PublishMover(app, store)
