"""Absorbing from kombu's Redis transport: the queues' lists and the unacked hash.

A queue is one Redis list per priority step (:class:`~celery_delayed.store.broker_layout.BrokerLayout`
knows the names, read from kombu). Consumers pop from the list's tail, so the
list is read from the tail in pages, without taking anything: a message to
absorb is stored first, then removed by value (``LREM``, from the tail; its
delivery tag makes it unique). A message that is not absorbed is never
touched: it stays where it was. A run killed between the two leaves the
message in the list with its job stored: the next run finds the job and
removes the message, and a worker that takes it meanwhile drops it at start
(:func:`celery_delayed.worker.tracking.held_by_store`).

kombu's unacked hash holds the messages workers took and did not acknowledge
(delivery tag -> ``[message, exchange, routing_key]``); a worker that stops
cleanly puts its own back, so what is left there is a stopped worker's,
which kombu itself restores only after ``visibility_timeout``. An entry whose
task a live worker still holds (asked with Celery's remote control) is left
alone; the rest are absorbed like the lists' messages and removed from the
hash and its index, as kombu's own acknowledgement removes them. Since the
message names an exchange and routing key rather than a queue, its job is
released the way kombu would restore it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kombu.utils.json import loads

from ..store.broker_layout import BrokerLayout, Route
from .messages import Envelope

#: How many messages one read of a list takes.
PAGE = 500


class RedisBroker:
    """One connection to a Redis broker, read with kombu's names for its keys."""

    def __init__(self, connection: Any, layout: BrokerLayout, exchange_types: Mapping[str, str],
                 bound: Mapping[tuple[str, str], str]) -> None:
        """``exchange_types``: the app's exchanges' types; ``bound``: its queues by (exchange, routing key)."""
        import redis

        channel = connection.default_channel
        # kombu's own client adds the global key prefix to some commands only: use a plain client on its pool
        self.client = redis.Redis(connection_pool=channel.client.connection_pool)
        self.layout = layout
        self.exchange_types, self.bound = exchange_types, bound

    def lists(self, queue: str) -> list[str]:
        """The Redis lists of ``queue``, one per priority step, highest priority first (as kombu reads them)."""
        steps = sorted(set(self.layout.priority_steps))
        return [self.layout.list_key(queue, step) for step in steps]

    def length(self, key: str) -> int:
        """How many messages a list holds."""
        return int(self.client.llen(key))

    def page(self, key: str, kept: int, size: int = PAGE) -> list[bytes]:
        """Up to ``size`` messages of the list, tail first, past the ``kept`` ones left at its tail.

        The caller removes what it absorbs (:meth:`remove`) before it asks for
        the next page, and counts in ``kept`` what it leaves.
        """
        found = self.client.lrange(key, -(kept + size), -(kept + 1))
        chunk = [raw if isinstance(raw, bytes) else raw.encode() for raw in found]
        chunk.reverse()  # tail first: consumption order
        return chunk

    def remove(self, key: str, raws: list[bytes]) -> int:
        """Remove these messages from the list (each once, searching from the tail); how many were there."""
        if not raws:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for raw in raws:
            pipe.lrem(key, -1, raw)  # type: ignore[arg-type]  # (redis-py takes bytes too)
        return sum(int(n) for n in pipe.execute())

    def unacked_count(self) -> int:
        """How many messages kombu's unacked hash holds."""
        return int(self.client.hlen(self.layout.unacked_hash))

    def unacked(self) -> Iterator[tuple[bytes, Envelope, Route]]:
        """kombu's unacked messages: (delivery tag, message, the exchange and routing key kombu restores it by)."""
        for tag, raw in self.client.hscan_iter(self.layout.unacked_hash, count=PAGE):
            try:
                payload, exchange, routing_key = loads(raw)
                env = Envelope.from_redis(payload)
            except (ValueError, TypeError):
                continue  # not kombu's: left alone
            yield tag, env, self.route(str(exchange or ""), str(routing_key or ""), env)

    def route(self, exchange: str, routing_key: str, env: Envelope) -> Route:
        """Where kombu would restore a message sent to ``exchange`` with ``routing_key``."""
        priority = env.properties.get("priority") or 0
        priority = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
        if not exchange:
            return Route(routing_key, "", routing_key, "direct", priority)
        # (an exchange the app does not declare: direct, as Celery's own, to the queue its routing key names)
        queue = self.bound.get((exchange, routing_key), routing_key)
        return Route(queue, exchange, routing_key, self.exchange_types.get(exchange, "direct"), priority)

    def forget(self, tags: list[bytes]) -> int:
        """Remove acknowledged-by-absorbing messages from the unacked hash and its index (kombu's ack)."""
        if not tags:
            return 0
        index = self.layout.global_keyprefix + self.layout.unacked_index_key
        pipe = self.client.pipeline(transaction=True)
        pipe.zrem(index, *tags)
        pipe.hdel(self.layout.unacked_hash, *tags)
        return int(pipe.execute()[1])
