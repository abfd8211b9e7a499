"""The execution record of the worker side: one execution of a job at a time.

``start.lua`` (:meth:`Store.start <celery_delayed.store.Store.start>`)
re-reads the job's record just before the body runs and takes its execution
lease (fields ``lo``/``lu``); a :class:`LeaseKeeper` (one heartbeat thread per
process) extends it while the body runs; one script ends the attempt and
gives the lease back (:mod:`.ending`): ``finish.lua`` records the outcome.
A SUCCEEDED record is the done marker that turns a redelivery into a no-op
until it expires.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import DelayedError
from ..store import Store, get_store
from ..threads import BackgroundThread
from ..vocab import STORE_HEADER, request_header, request_shard

logger = logging.getLogger("celery_delayed.worker")


@dataclass
class Execution:
    """One running execution of a job: who holds its lease."""

    job_id: str
    shard: int
    owner: str
    attempt: int
    delivery_tag: str = ""  # the message's, to keep kombu's unacked entry fresh


def execution_token(hostname: str, delivery_tag: object) -> str:
    """A lease owner token unique to one execution: ``"<hostname>|<pid>|<delivery tag>|<nonce>"``.

    The Redis transport redelivers a message with its original delivery tag,
    so the tag alone cannot tell two deliveries apart: a random nonce does.
    """
    return f"{hostname}|{os.getpid()}|{delivery_tag or ''}|{uuid.uuid4().hex[:12]}"


_warned_prefixes: set[str] = set()


def job_store(app: Any, request: Any) -> Store:
    """The store of the job a Celery request runs: the one its ``delayed_store`` header names.

    A worker whose app uses another ``delayed_key_prefix`` than the producer
    that scheduled the job still finds the job's record (on its own Redis),
    and says so once per prefix: the apps are probably configured apart.
    """
    store = get_store(app)
    prefix = request_header(request, STORE_HEADER)
    if not isinstance(prefix, str) or not prefix or prefix == store.config.key_prefix:
        return store
    if prefix not in _warned_prefixes:
        _warned_prefixes.add(prefix)
        logger.warning(
            "a message names the celery-delayed store with prefix %r, but this worker's app uses %r: using %r "
            "on this worker's Redis (configure producers, schedulers and workers with the same "
            "delayed_key_prefix)", prefix, store.config.key_prefix, prefix)
    return get_store(app, prefix)


def job_shard(store: Store, request: Any) -> int:
    """The shard of the job a Celery request runs: its ``delayed_shard`` header, else the id's own shard."""
    shard = request_shard(request)
    if shard is None or not store.layout.valid_shard(shard):
        return store.layout.shard_of(request.id)
    return shard


def delivery_tag(request: Any) -> str:
    """The delivery tag of the message a request came in (for kombu's unacked index)."""
    props = getattr(request, "properties", None) or {}
    return str(props.get("delivery_tag") or (request.delivery_info or {}).get("delivery_tag") or "")


class LeaseKeeper:
    """Extends one execution's lease every third of it until stopped.

    The beats come from one daemon thread per process (see :class:`_Beater`),
    not a thread per execution: starting and stopping a keeper costs a dict
    update. It stops by itself when the lease is lost (the job was cancelled
    with ``terminate``, or taken over after a stall longer than the lease); a
    store outage is logged and retried at the next beat.
    """

    def __init__(self, store: Store, execution: Execution) -> None:
        self.store = store
        self.execution = execution
        self.interval_s = max(store.config.exec_lease_ms / 3000.0, 0.05)
        self.next_at = 0.0
        self.lost = False
        self.stopped = False

    def start(self) -> LeaseKeeper:
        """Start beating; return self."""
        self.next_at = time.monotonic() + self.interval_s
        _beater().add(self)
        return self

    def stop(self) -> None:
        """Stop beating (idempotent). A beat already under way is harmless: the
        script extends only a RUNNING job under this execution's owner."""
        self.stopped = True
        _beater().remove(self)

    def beat(self) -> bool:
        """Extend the lease once; return False when this keeper is done (stopped or lost)."""
        if self.stopped:
            return False
        ex = self.execution
        try:
            if not self.store.executions.extend_lease(ex.job_id, ex.shard, ex.owner, ex.delivery_tag):
                if not self.stopped:  # not just a beat that raced finish()
                    self.lost = True
                    logger.warning("job %s: execution lease lost (cancelled or taken over)", ex.job_id)
                return False
        except DelayedError as exc:
            logger.warning("job %s: could not extend the execution lease: %s", ex.job_id, exc)
        self.next_at = time.monotonic() + self.interval_s
        return True


class _Beater(BackgroundThread):
    """The one thread of a process that beats every running execution's :class:`LeaseKeeper`."""

    def __init__(self) -> None:
        super().__init__(name="celery-delayed-leases")
        self.pid = os.getpid()
        self.keepers: set[LeaseKeeper] = set()
        self.lock = threading.Lock()
        self.sleeps_until = 0.0  # when the thread wakes by itself next (monotonic)
        # With no keeper, it sleeps one (shortest) interval, not until woken: a keeper
        # added after that is due after it wakes, so a short task wakes no thread.
        self.idle_s = 60.0
        self.start()

    def add(self, keeper: LeaseKeeper) -> None:
        with self.lock:
            self.keepers.add(keeper)
            self.idle_s = min(self.idle_s, keeper.interval_s)
        if keeper.next_at < self.sleeps_until:  # due before the thread wakes by itself
            self.wake()

    def remove(self, keeper: LeaseKeeper) -> None:
        with self.lock:
            self.keepers.discard(keeper)

    def body(self) -> float:
        """Beat the keepers that are due; return the seconds until the next one is."""
        self.sleeps_until = 0.0  # awake
        now = time.monotonic()
        with self.lock:
            due = [k for k in self.keepers if k.next_at <= now]
        for k in due:
            try:
                alive = k.beat()
            except Exception:  # one bad reply must not end every execution's heartbeat
                logger.exception("job %s: extending the execution lease failed", k.execution.job_id)
                k.next_at = time.monotonic() + k.interval_s
                alive = True
            if not alive:
                self.remove(k)
        with self.lock:
            nxt = min((k.next_at for k in self.keepers), default=now + self.idle_s)
            self.sleeps_until = nxt
        return max(nxt - time.monotonic(), 0.0)


_beater_lock = threading.Lock()
_the_beater: _Beater | None = None


def _beater() -> _Beater:
    """This process's beater; a forked child (prefork pool) gets its own."""
    global _the_beater
    beater = _the_beater
    if beater is not None and beater.pid == os.getpid():
        return beater
    with _beater_lock:
        if _the_beater is None or _the_beater.pid != os.getpid():
            _the_beater = _Beater()
        return _the_beater
