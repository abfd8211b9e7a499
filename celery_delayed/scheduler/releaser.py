"""Move one batch of due jobs of one shard onto the broker.

:class:`DirectReleaser` runs ``release_due.lua`` (the broker is Redis on the
store's server: exactly-once). :class:`PublishReleaser` claims with
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

from ..announce import Announcer
from ..errors import Unpublishable
from ..store import Batch, Store
from ..vocab import JobState
from .confirms import BatchConfirms

logger = logging.getLogger("celery_delayed.scheduler")

#: The reason of a nack (not counted toward dead-lettering: the broker could not take the message now).
NACKED = "the broker nacked the message"
_CONNECT_RETRY = {"max_retries": 1, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
_RETRY_POLICY = {"max_retries": 3, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}


class Releaser(Protocol):
    """Releases one batch of one shard."""

    def release(self, shard: int, owner: str, fence: str, limit: int) -> Batch: ...

    def close(self) -> None: ...


class DirectReleaser:
    """Releases with one Lua script: remove from the schedule and LPUSH, atomically."""

    def __init__(self, app: Celery, store: Store) -> None:
        self.store = store
        self.announce = Announcer(app)

    def release(self, shard: int, owner: str, fence: str, limit: int) -> Batch:
        batch = self.store.release.release_due(shard, owner, fence, limit=limit,
                                               lookahead_ms=self.store.config.lookahead_ms)
        self.announce.sent(batch.events)
        self.announce.not_sent(batch.not_sent)
        return batch

    def close(self) -> None:
        self.announce.close()


class PublishReleaser:
    """Claims due jobs, publishes them with kombu, then acknowledges the claims.

    On an AMQP broker the batch is published with publisher confirms (unless
    ``broker_transport_options`` sets ``confirm_publish`` False), waited for
    once per batch; only the messages the broker confirmed are acknowledged.
    An unconfirmed message stays claimed and is published again when its
    claim lease runs out: at-least-once. A message the broker refuses (a
    nack, or a channel error such as no such exchange or over its size
    limit) is put back at once, without holding up the rest of its batch,
    and dead-lettered with the broker's reason after
    ``delayed_publish_max_refusals`` refusals.
    """

    def __init__(self, app: Celery, store: Store) -> None:
        self.app = app
        self.store = store
        self.announce = Announcer(app)
        self.confirmed = 0  # messages the broker confirmed (AMQP)
        self.refused = 0  # messages the broker nacked (AMQP)
        self._conn: Any = None
        self._producer: Any = None
        self._confirms: BatchConfirms | None = None
        self._amqp = False
        opts = app.conf.broker_transport_options or {}
        self._want_confirms = opts.get("confirm_publish", True) is not False
        self._confirm_timeout_s = max(1.0, store.config.claim_lease_ms / 2000.0)
        # Test hook: called with the batch after it was published, before the ack.
        self.before_ack: Callable[[Batch], None] | None = None

    @property
    def confirms(self) -> bool:
        """True when batches are published with publisher confirms (connected to AMQP)."""
        return self._confirms is not None

    def _get_producer(self, force_confirms: bool = False) -> Any:
        if self._producer is not None and force_confirms and self._confirms is None and self._amqp:
            self.close()
        if self._producer is None:
            conn = self.app.connection_for_write()
            amqp = conn.transport.driver_type == "amqp"
            if amqp:
                # Our own copy of the options: py-amqp must not wait per message.
                conn.transport_options["confirm_publish"] = False
            self._conn = conn
            # kombu retries a connect for long by default; the loop backs off
            # itself and must stay responsive to a stop meanwhile.
            conn.ensure_connection(**_CONNECT_RETRY)
            self._producer = self.app.amqp.Producer(conn, auto_declare=False)
            self._amqp = amqp
            if amqp and (self._want_confirms or force_confirms):
                self._confirms = BatchConfirms(self._producer.channel)
        return self._producer

    def release(self, shard: int, owner: str, fence: str, limit: int) -> Batch:
        try:
            # Connect before claiming: while the broker is down the jobs stay
            # scheduled, and go out as soon as it is back, instead of waiting
            # in flight for their claim lease to run out.
            self._get_producer()
        except Exception:
            self.close()
            raise
        batch = self.store.release.claim_due(shard, owner, fence, limit=limit,
                                             lookahead_ms=self.store.config.lookahead_ms)
        self.announce.not_sent(batch.not_sent)
        if not batch.ids:
            return batch
        try:
            published, refused = self._publish_batch(batch)
        except Exception:
            # The claims stay in flight and are claimed again when they expire.
            self.close()
            raise
        if self.before_ack is not None:
            self.before_ack(batch)
        self.store.release.ack_claimed(shard, published)
        if refused:
            self._put_back(shard, refused)
        sent = set(published)
        self.announce.sent([e for jid, e in zip(batch.ids, batch.events, strict=True) if jid in sent])
        unconfirmed = len(batch.ids) - len(published) - len(refused)
        if unconfirmed:
            logger.warning("shard %d: %d of %d messages were not confirmed; they are published again after the "
                           "claim lease (%d ms)", shard, unconfirmed, len(batch.ids),
                           self.store.config.claim_lease_ms)
        return batch

    def _put_back(self, shard: int, refused: list[tuple[str, str, bool]]) -> None:
        """Jobs the broker refused: back to the due set at once, dead-lettered after too many refusals."""
        self.refused += len(refused)
        reasons = {job_id: why for job_id, why, _ in refused}
        for job_id, state, n in self.store.release.refuse_claimed(shard, refused):
            if state == JobState.DEAD:
                reason = reasons[job_id]
                logger.error("job %s: the broker refused its message %d times (%s): dead-lettered", job_id, n,
                             reason)
                self.announce.failed(job_id, Unpublishable(reason))
            elif state == JobState.SCHEDULED:
                logger.warning("job %s: the broker refused its message (%s); trying again (refusal %d of %d)",
                               job_id, reasons[job_id], n, self.store.config.publish_max_refusals)

    def _publish_batch(self, batch: Batch) -> tuple[list[str], list[tuple[str, str, bool]]]:
        """Publish every claimed message; return the ids the broker took, and (id, reason, counts) it refused.

        A connection lost mid-batch is replaced once and the whole batch
        published again (duplicates are allowed on this path; waiting out the
        claim lease is not needed for a blip). A channel error (AMQP closes
        the channel for a message it cannot take: no such exchange, too
        large) stops the batch: the messages not yet confirmed are then
        published one at a time, so the refused ones are found and the others
        go out.
        """
        for attempt in (1, 2):
            try:
                producer = self._get_producer()
                for jid, (msg, ex, rk, q) in zip(batch.ids, batch.messages, strict=True):
                    self._publish(producer, msg, ex, rk, q)
                    if self._confirms is not None:
                        self._confirms.published(jid)
                if self._confirms is None:
                    return list(batch.ids), []
                acked, nacked = self._confirms.wait(self._confirm_timeout_s)
                self.confirmed += len(acked)
                return acked, [(jid, NACKED, False) for jid in nacked]
            except Exception as exc:
                if self._channel_error(exc):
                    done = self._confirms.acked if self._confirms is not None else []
                    logger.warning("publishing a batch failed (%s): publishing its %d unconfirmed message(s) one "
                                   "at a time", exc, len(batch.ids) - len(done))
                    self.close()
                    ok, refused = self._publish_singly(batch, set(done))
                    return done + ok, refused
                if attempt == 2 or not self._connection_error(exc):
                    raise
                logger.warning("publishing a batch failed (%s); reconnecting to publish it again", exc)
                self.close()
        raise AssertionError("unreachable")

    def _publish_singly(self, batch: Batch, skip: set[str]) -> tuple[list[str], list[tuple[str, str, bool]]]:
        """Publish messages one at a time, each confirmed on its own; return (taken ids, refused)."""
        taken: list[str] = []
        refused: list[tuple[str, str, bool]] = []
        for jid, (msg, ex, rk, q) in zip(batch.ids, batch.messages, strict=True):
            if jid in skip:
                continue
            try:
                producer = self._get_producer(force_confirms=True)
                self._publish(producer, msg, ex, rk, q)
                if self._confirms is not None:
                    self._confirms.published(jid)
                    _, nacked = self._confirms.wait(self._confirm_timeout_s)
                    if nacked:
                        refused.append((jid, NACKED, False))
                        continue
                taken.append(jid)
            except Exception as exc:
                if self._connection_error(exc) and not self._channel_error(exc):
                    raise  # the loop backs off; the claims stay in flight
                refused.append((jid, f"{type(exc).__name__}: {exc}"[:500], True))
                self.close()
        self.confirmed += len(taken)
        return taken, refused

    def _connection_error(self, exc: BaseException) -> bool:
        conn = self._conn or self.app.connection_for_write()
        errors = tuple(conn.connection_errors) + tuple(conn.channel_errors)
        return isinstance(exc, errors)

    def _channel_error(self, exc: BaseException) -> bool:
        """An error that closed the channel but not the connection (AMQP's answer to one bad message)."""
        conn = self._conn or self.app.connection_for_write()
        return isinstance(exc, tuple(conn.channel_errors)) and not isinstance(exc, tuple(conn.connection_errors))

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
            # kombu's retry would publish again on a new channel, which breaks
            # the count of confirms; _publish_batch retries the batch instead.
            # Short: a stop waits for the batch in hand, and an unreachable
            # broker is the loop's to back off from (the claims stay in flight).
            retry=self._confirms is None,
            retry_policy=_RETRY_POLICY,
            expiration=expiration,
            **props,
        )

    def close(self) -> None:
        self.announce.close()
        if self._conn is not None:
            try:
                self._conn.release()
            except Exception:
                logger.debug("closing the publish connection failed", exc_info=True)
        self._conn = self._producer = self._confirms = None


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


def make_releaser(app: Celery, store: Store) -> Releaser:
    """The releaser for the store's release path (``store.broker.direct``)."""
    return DirectReleaser(app, store) if store.broker.direct else PublishReleaser(app, store)
