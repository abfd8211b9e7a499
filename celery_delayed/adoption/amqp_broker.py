"""Absorbing from RabbitMQ (kombu's AMQP transport): get with manual acknowledgement, store, acknowledge.

Each message of a queue is taken with ``basic.get`` and held unacknowledged:
one to absorb is acknowledged only once its job is stored; one that is not
absorbed is held until the queue is done and then given back
(``basic.reject`` with requeue), which puts it back in its place. A run
killed at any point closes its connection, and RabbitMQ puts back every
message it held: those whose job was stored are found in the store by the
next run (and dropped at start by a worker that takes one meanwhile).

A queue with consumers attached is refused: its consumers hold messages this
run cannot see (a worker keeps its ETA messages unacknowledged until they are
due), and compete for the rest. Stop the workers first; their messages go
back to the queue.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigurationError
from .messages import Envelope


class AmqpQueue:
    """One queue on one channel, read with ``basic.get`` and manual acknowledgement."""

    def __init__(self, connection: Any, queue: Any, allow_consumers: bool = False) -> None:
        """``queue`` (a kombu ``Queue``) on ``connection``'s default channel.

        Raises:
            ConfigurationError: no such queue, or (without ``allow_consumers``) consumers are attached.
        """
        self.queue = queue.bind(connection.default_channel)
        try:
            _, self.size, consumers = self.queue.queue_declare(passive=True)
        except connection.channel_errors as exc:
            raise ConfigurationError(f"queue {queue.name!r} does not exist on the broker ({exc})") from exc
        if consumers and not allow_consumers:
            raise ConfigurationError(
                f"queue {queue.name!r} has {consumers} consumer(s) attached: the workers hold its ETA messages "
                "unacknowledged, where absorbing cannot reach them. Stop the workers (their messages go back to "
                "the queue), run absorb, then start them again")
        self.held: list[Any] = []

    def get(self) -> tuple[Any, Envelope] | None:
        """The next message and its envelope, held unacknowledged; None when the queue is empty."""
        message = self.queue.get(no_ack=False, accept=None)
        if message is None:
            return None
        return message, Envelope.from_amqp(message)

    @staticmethod
    def ack(messages: list[Any]) -> None:
        """Acknowledge absorbed messages (their jobs are stored)."""
        for message in messages:
            message.ack()

    def hold(self, message: Any) -> None:
        """Keep a message that stays in the queue until :meth:`give_back`."""
        self.held.append(message)

    def give_back(self) -> int:
        """Put every held message back in the queue (in its place); how many."""
        n = 0
        for message in self.held:
            message.reject(requeue=True)
            n += 1
        self.held.clear()
        return n
