"""Publisher confirms for a whole batch on an AMQP channel.

py-amqp's ``confirm_publish`` waits for the broker's ack after every single
message: one round trip each (a few hundred messages a second). Instead the
channel is put in confirm mode once, a batch is published without waiting,
and the acks (which RabbitMQ sends for many messages at once, ``multiple``)
are collected in one wait at the end.
"""

from __future__ import annotations

import time
from typing import Any


class ConfirmTimeout(TimeoutError):
    """The broker did not confirm every message of the batch in time."""


class BatchConfirms:
    """Tracks the broker's acks and nacks of messages published on one channel.

    Delivery tags count the channel's publishes from 1 after ``confirm.select``,
    so every publish on the channel must go through :meth:`published`.
    """

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        channel.confirm_select()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        self._seq = 0
        self._pending: dict[int, str] = {}  # delivery tag -> job id, in publish order
        self._acked: list[str] = []
        self._nacked: list[str] = []

    def published(self, job_id: str) -> None:
        """Record that ``job_id`` was just published on the channel."""
        self._seq += 1
        self._pending[self._seq] = job_id

    def _settle(self, tag: int, multiple: bool, into: list[str]) -> None:
        if not multiple:
            job_id = self._pending.pop(tag, None)
            if job_id is not None:
                into.append(job_id)
            return
        # Tags are in publish order: settle from the oldest up to ``tag``.
        for t in list(self._pending):
            if t > tag:
                break
            into.append(self._pending.pop(t))

    def _on_ack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple, self._acked)

    def _on_nack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple, self._nacked)

    @property
    def acked(self) -> list[str]:
        """The job ids the broker acknowledged so far (since the last :meth:`wait`)."""
        return list(self._acked)

    def wait(self, timeout_s: float) -> tuple[list[str], list[str]]:
        """Wait until every published message is acked or nacked; return (acked, nacked) job ids.

        Raises:
            ConfirmTimeout: some messages were neither acked nor nacked in time.
        """
        deadline = time.monotonic() + timeout_s
        while self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfirmTimeout(
                    f"the broker confirmed {len(self._acked)} of "
                    f"{len(self._acked) + len(self._nacked) + len(self._pending)} messages in {timeout_s:.0f}s"
                )
            try:
                self.channel.connection.drain_events(timeout=left)
            except TimeoutError:
                continue  # the deadline check above raises
        acked, nacked = self._acked, self._nacked
        self._acked, self._nacked = [], []
        return acked, nacked
