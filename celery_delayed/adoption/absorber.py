"""Move a broker's ETA backlog into the store: each message stored first, then taken from the broker.

:func:`absorb` reads the app's queues (or the ones named) on its broker:
kombu's Redis transport (:mod:`.redis_broker`) or RabbitMQ
(:mod:`.amqp_broker`). Every task message whose ``eta`` is at least
``min_delay_s`` ahead becomes a job under its own task id, due at that eta
(:mod:`.messages`); the rest stay where they are. Jobs are stored in batches
(with a database, as rows first), and only then are their messages removed:
a run stopped at any point has lost nothing and, run again, stores nothing
twice, and a stored message that a worker receives anyway is dropped at
start (the worker side recognises a job the store already holds).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from celery import Celery

from ..errors import ConfigurationError, DelayedError, InvalidOption, PayloadTooLarge, SerializationError
from ..producer.prepare import Prepared
from ..store import Store, get_store
from ..store.broker_layout import BrokerLayout, Route
from .messages import FROM_THE_STORE, Envelope, EtaMessage, job_of, read

logger = logging.getLogger("celery_delayed.absorb")

#: How many jobs are stored in one round trip before their messages are removed.
BATCH = 500
#: Errors of a message the store cannot hold: it stays in its queue, and the summary names it.
_UNSTORABLE = (InvalidOption, SerializationError, PayloadTooLarge)

#: ``progress(read, total)``: messages read since the last call, and how many the queues held at the start.
Progress = Callable[[int, int], None]


@dataclass
class Report:
    """What a run of :func:`absorb` did (or, with ``dry_run``, would do)."""

    dry_run: bool
    broker: str = ""
    #: messages read, per queue
    read: Counter[str] = field(default_factory=Counter)
    #: jobs stored for messages taken from the broker, per queue
    absorbed: Counter[str] = field(default_factory=Counter)
    #: messages whose job the store held already (an earlier run stopped before removing them): removed
    already: int = 0
    #: absorbed (or to absorb), per task
    tasks: Counter[str] = field(default_factory=Counter)
    #: messages left where they are, by reason
    left: Counter[str] = field(default_factory=Counter)
    #: messages the store cannot hold: (task id, why), the first few
    refused: list[tuple[str, str]] = field(default_factory=list)
    #: kombu unacknowledged messages left alone because a live worker holds their task
    held_by_workers: int = 0
    etas: list[datetime] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        """Jobs stored (or to store) in all."""
        return sum(self.absorbed.values())

    def take(self, queue: str, msg: EtaMessage) -> None:
        self.absorbed[queue] += 1
        self.tasks[msg.task] += 1
        self.etas.append(msg.eta)

    def refuse(self, msg_id: str, why: str) -> None:
        self.left["the store cannot hold it"] += 1
        if len(self.refused) < 20:
            self.refused.append((msg_id, why))

    def lines(self) -> list[str]:
        """The summary, in words."""
        verb = "would move" if self.dry_run else "moved"
        out = [f"{verb} {self.total} ETA message(s) from the {self.broker} broker into the store"
               + ("" if self.dry_run else f" in {self.seconds:.1f} s")]
        if self.already:
            out.append(f"  {self.already} of them were stored already (by an earlier run that stopped): "
                       "taken from the broker, not stored twice")
        for queue, n in sorted(self.absorbed.items()):
            out.append(f"  queue {queue}: {n} of {self.read[queue]} message(s) read")
        for task, n in self.tasks.most_common():
            out.append(f"  task {task}: {n}")
        if self.etas:
            etas = sorted(e.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S") for e in self.etas)
            out.append(f"  due from {etas[0]} to {etas[-1]} UTC (median {etas[len(etas) // 2]})")
        for why, n in sorted(self.left.items()):
            out.append(f"  left in the broker: {n} ({why})")
        for msg_id, why in self.refused:
            out.append(f"    {msg_id}: {why}")
        if self.held_by_workers:
            out.append(f"  left alone: {self.held_by_workers} message(s) held by running workers; stop them "
                       "(their messages go back to the queue) and run absorb again")
        return out


def absorb(app: Celery, queues: Sequence[str] = (), *, dry_run: bool = False, min_delay_s: float | None = None,
           limit: int | None = None, progress: Progress | None = None,
           allow_consumers: bool = False) -> Report:
    """Move the ETA messages of ``queues`` (default: the app's) from the broker into the store.

    Args:
        dry_run: read and count, change nothing (on RabbitMQ the messages are
            read and given back, which marks them redelivered).
        min_delay_s: leave messages due sooner than this (default:
            ``delayed_intercept_min_delay_s``).
        limit: stop after this many jobs stored.
        progress: called as messages are read (see :data:`Progress`).
        allow_consumers: on RabbitMQ, read a queue with consumers attached
            (they hold messages this run cannot see).

    Raises:
        ConfigurationError: a broker other than Redis or RabbitMQ, or an unknown queue.
    """
    store = get_store(app)
    names = list(queues) or sorted(app.amqp.queues)
    if not names:
        raise ConfigurationError("the app declares no queue: name the queues to absorb with --queue")
    floor = store.config.intercept_min_delay_s if min_delay_s is None else min_delay_s
    job = _Absorbing(app, store, Report(dry_run), floor, limit, progress or (lambda n, total: None))
    started = time.monotonic()
    with app.connection_for_read() as conn:
        kind = conn.transport.driver_type
        if kind == "redis":
            job.report.broker = "Redis"
            job.redis(conn, names)
        elif kind == "amqp":
            job.report.broker = "RabbitMQ"
            job.amqp(conn, names, allow_consumers)
        else:
            raise ConfigurationError(
                f"absorb reads Redis and RabbitMQ brokers; this app's broker is {conn.transport_cls!r} "
                f"({kind})")
    job.report.seconds = time.monotonic() - started
    return job.report


class _Absorbing:
    """One run: read, store in batches, then remove."""

    def __init__(self, app: Celery, store: Store, report: Report, min_delay_s: float, limit: int | None,
                 progress: Progress) -> None:
        self.app, self.store, self.report = app, store, report
        self.min_delay_s, self.limit, self._progress = min_delay_s, limit, progress
        self.size = 0  # messages in the queues when the run began

    def progress(self, n: int) -> None:
        self._progress(n, self.size)

    @property
    def full(self) -> bool:
        return self.limit is not None and self.report.total >= self.limit

    def classify(self, env: Envelope) -> EtaMessage | str:
        return read(env, datetime.now(timezone.utc), self.min_delay_s, self.app.timezone)

    def prepare(self, queue: str, msg: EtaMessage, route: Route | None = None) -> Prepared | None:
        try:
            return job_of(self.app, self.store, msg, queue, route)
        except _UNSTORABLE as exc:
            self.report.refuse(msg.id, f"{type(exc).__name__}: {exc}")
            return None

    def store_batch(self, prepared: list[Prepared]) -> None:
        """Store the batch's jobs (a job the store holds already is kept as it is); count them."""
        if self.report.dry_run or not prepared:
            return
        if self.store.config.database_url:
            from ..sql.outbox import store_with_rows  # an optional extra: only with a database
            from ..sql.rows import get_rows

            rows = get_rows(self.app)
            assert rows is not None
            have = rows.existing([p.job.id for p in prepared])
            new = [p for p in prepared if p.job.id not in have]
            if new:
                store_with_rows(self.app, self.store, rows, new)
            self.report.already += len(prepared) - len(new)
            return
        results = self.store.jobs.schedule([p.job for p in prepared])
        self.report.already += sum(1 for r in results if not r.created)

    # -- Redis -------------------------------------------------------------------------------

    def redis(self, conn: Any, queues: Sequence[str]) -> None:
        from .redis_broker import PAGE, RedisBroker

        layout = BrokerLayout.from_app(self.app, self.store.config)
        declared = list(self.app.amqp.queues.values())
        kinds = {q.exchange.name: q.exchange.type for q in declared if q.exchange is not None and q.exchange.name}
        bound = {(q.exchange.name, q.routing_key): q.name for q in declared
                 if q.exchange is not None and q.exchange.name and q.routing_key}
        broker = RedisBroker(conn, layout, kinds, bound)
        self.size = sum(broker.length(key) for queue in queues for key in broker.lists(queue)) + broker.unacked_count()
        for queue in queues:
            for key in broker.lists(queue):
                kept = 0
                while not self.full:
                    chunk = broker.page(key, kept, PAGE)
                    if not chunk:
                        break
                    taken = self._redis_chunk(queue, chunk)
                    removed = 0 if self.report.dry_run else broker.remove(key, taken)
                    if removed < len(taken):
                        logger.info("%d message(s) of %s were taken by a consumer while being absorbed: a worker "
                                    "drops them at start", len(taken) - removed, queue)
                    kept += len(chunk) - removed  # what stays at the list's tail, before the next page
                    if len(chunk) < PAGE:
                        break
        if not self.full:
            self._redis_unacked(broker, set(queues))

    def _redis_chunk(self, queue: str, chunk: list[bytes]) -> list[bytes]:
        """Store the chunk's ETA messages' jobs; the raw messages to remove (all, with no more than the limit)."""
        self.report.read[queue] += len(chunk)
        self.progress(len(chunk))
        batch: list[Prepared] = []
        raws: list[bytes] = []
        for raw in chunk:
            if self.limit is not None and self.report.total >= self.limit:
                break
            try:
                env = Envelope.from_redis(raw)
            except (ValueError, TypeError):
                self.report.left["not a kombu message"] += 1
                continue
            found = self.classify(env)
            if isinstance(found, str):
                self.report.left[found] += 1
                continue
            p = self.prepare(queue, found)
            if p is None:
                continue
            self.report.take(queue, found)
            batch.append(p)
            raws.append(raw)
        self.store_batch(batch)
        return raws

    def _redis_unacked(self, broker: Any, queues: set[str]) -> None:
        held: set[str] | None = None  # asked of the workers once there is an entry to absorb
        batch: list[Prepared] = []
        tags: list[bytes] = []
        for tag, env, route in broker.unacked():
            if self.full:
                break
            if route.queue not in queues:
                continue  # another queue's: not asked for
            queue = f"{route.queue} (unacknowledged)"
            self.report.read[queue] += 1
            self.progress(1)
            found = self.classify(env)
            if isinstance(found, str):
                if found != FROM_THE_STORE:  # a look-ahead release a worker holds: not a backlog
                    self.report.left[f"{found}, unacknowledged"] += 1
                continue
            if held is None:
                held = live_worker_tasks(self.app)
            if found.id in held:
                self.report.held_by_workers += 1
                continue
            p = self.prepare(queue, found, route)
            if p is None:
                continue
            self.report.take(queue, found)
            batch.append(p)
            tags.append(tag)
            if len(batch) >= BATCH:
                self._settle_unacked(broker, batch, tags)
                batch, tags = [], []
        self._settle_unacked(broker, batch, tags)

    def _settle_unacked(self, broker: Any, batch: list[Prepared], tags: list[bytes]) -> None:
        self.store_batch(batch)
        if not self.report.dry_run:
            broker.forget(tags)

    # -- RabbitMQ ----------------------------------------------------------------------------

    def amqp(self, conn: Any, queues: Sequence[str], allow_consumers: bool) -> None:
        from kombu import Queue

        from .amqp_broker import AmqpQueue

        sources = []
        for name in queues:
            declared = self.app.amqp.queues.get(name)
            sources.append(AmqpQueue(conn, declared if declared is not None else Queue(name), allow_consumers))
        self.size = sum(source.size for source in sources)
        for name, source in zip(queues, sources, strict=True):
            try:
                self._amqp_queue(name, source)
            finally:
                try:
                    source.give_back()
                except conn.connection_errors + conn.channel_errors:
                    # (the broker puts back what a closed channel held: nothing is lost)
                    logger.warning("could not give the messages read from %s back; the broker does when the "
                                   "connection closes", name)

    def _amqp_queue(self, queue: str, source: Any) -> None:
        batch: list[Prepared] = []
        taken: list[Any] = []
        while not self.full:
            got = source.get()
            if got is None:
                break
            message, env = got
            self.report.read[queue] += 1
            self.progress(1)
            found = self.classify(env)
            if isinstance(found, str):
                self.report.left[found] += 1
                source.hold(message)
                continue
            p = self.prepare(queue, found)
            if p is None:
                source.hold(message)
                continue
            self.report.take(queue, found)
            if self.report.dry_run:
                source.hold(message)
                continue
            batch.append(p)
            taken.append(message)
            if len(batch) >= BATCH:
                self.store_batch(batch)
                source.ack(taken)
                batch, taken = [], []
        self.store_batch(batch)
        source.ack(taken)


def live_worker_tasks(app: Celery, timeout: float = 1.0) -> set[str]:
    """The task ids the app's running workers hold (ETA, reserved and active), asked by remote control."""
    inspect = app.control.inspect(timeout=timeout)
    ids: set[str] = set()
    try:
        for replies in (inspect.scheduled(), inspect.reserved(), inspect.active()):
            for requests in (replies or {}).values():
                for r in requests or ():
                    req = r.get("request", r) if isinstance(r, dict) else {}
                    if isinstance(req, dict) and req.get("id"):
                        ids.add(str(req["id"]))
    except DelayedError:
        raise
    except Exception as exc:  # no answer is no worker: but say it
        logger.warning("could not ask the workers which tasks they hold (%s): unacknowledged messages are "
                       "absorbed unless a worker holds them", exc)
    return ids
