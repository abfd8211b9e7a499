"""The run-time ledger of ``DelayedTask``: execution leases and done markers in the job record.

One execution of a job at a time: ``start.lua`` re-reads the record and takes
the job's execution lease (fields ``lo``/``lu``, see ``store.py``), a
:class:`LeaseKeeper` (one heartbeat thread per process) extends it while the
body runs, and ``finish.lua`` records the outcome; a SUCCEEDED record is the
done marker that turns a redelivery into a no-op until it expires.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

from .errors import DelayedError
from .store import Store

logger = logging.getLogger("celery_delayed.worker")

#: ``start`` outcomes (start.lua's return codes).
RUN, UNTRACKED, CANCELLED, DONE, BUSY, OTHER = 1, 0, -1, -2, -3, -4


@dataclass(frozen=True)
class Started:
    """What ``start.lua`` decided for one delivery."""

    code: int  # RUN, UNTRACKED, CANCELLED, DONE, BUSY or OTHER
    state: str  # the record's state ('' without a record)
    attempt: int  # executions begun, this one included when code is RUN
    lease_until_ms: int  # RUN: our deadline; BUSY: the other execution's


@dataclass(frozen=True)
class Execution:
    """One running execution of a job: who holds its lease."""

    job_id: str
    shard: int
    owner: str
    attempt: int
    delivery_tag: str = ""  # the message's, to keep kombu's unacked entry fresh


def owner_token(hostname: str, delivery_tag: object) -> str:
    """A lease owner token unique to one execution.

    The Redis transport redelivers a message with its original delivery tag,
    so the tag alone cannot tell two deliveries apart: a random nonce does.
    """
    return f"{hostname}|{os.getpid()}|{delivery_tag or ''}|{uuid.uuid4().hex[:12]}"


class Ledger:
    """Runs the worker-side scripts of one store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.lease_ms = store.config.exec_lease_ms
        opts = store.app.conf.broker_transport_options or {}
        #: kombu's unacked index, when the broker is Redis on the store's server.
        self.unacked_index = (
            (opts.get("global_keyprefix", "") or "") + opts.get("unacked_index_key", "unacked_index")
            if store.direct else ""
        )

    def _key(self, job_id: str, shard: int) -> str:
        return self.store.keys.shard(shard).job(job_id)

    def start(
        self, job_id: str, shard: int, owner: str, hostname: str = "", now_ms: int | None = None,
    ) -> Started:
        """Take the job's execution lease if it may run now (see ``lua/start.lua``)."""
        code, state, attempt, until = self.store._run(
            self.store.scripts.start, [self._key(job_id, shard)],
            [owner, self.lease_ms, "" if now_ms is None else now_ms, hostname],
        )
        return Started(int(code), str(state), int(attempt), int(until))

    def extend(self, ex: Execution, now_ms: int | None = None) -> bool:
        """Push the lease deadline on by ``delayed_exec_lease_ms``; False when the lease is lost.

        On the Redis broker it also refreshes the message's entry in kombu's
        unacked index, so a task running longer than ``visibility_timeout`` is
        not redelivered while its lease is alive.
        """
        keys = [self._key(ex.job_id, ex.shard)]
        args: list[object] = [ex.owner, self.lease_ms, "" if now_ms is None else now_ms]
        if self.unacked_index and ex.delivery_tag:
            keys.append(self.unacked_index)
            args += [ex.delivery_tag, repr(time.time())]
        code, _state, _until = self.store._run(self.store.scripts.extend_lease, keys, args)
        return int(code) == 1

    def finish(self, ex: Execution, outcome: str, reason: str = "", now_ms: int | None = None) -> tuple[int, str]:
        """Record ``outcome`` (SUCCEEDED, FAILED or QUEUED) and give the lease back.

        Returns ``(code, state)`` as ``lua/finish.lua``: 1 recorded; 0 no
        record; -1 the lease was not ours any more (state = the job's state).
        """
        cfg = self.store.config
        code, state = self.store._run(
            self.store.scripts.finish, [self._key(ex.job_id, ex.shard)],
            [ex.owner, outcome, cfg.done_ttl_s * 1000, cfg.idempotency_ttl_s * 1000,
             "" if now_ms is None else now_ms, reason],
        )
        return int(code), str(state)


class LeaseKeeper:
    """Extends one execution's lease every third of it until stopped.

    The beats come from one daemon thread per process (see :class:`_Beater`),
    not a thread per execution: starting and stopping a keeper costs a dict
    update. It stops by itself when the lease is lost (the job was cancelled
    with ``terminate``, or taken over after a stall longer than the lease); a
    store outage is logged and retried at the next beat.
    """

    def __init__(self, ledger: Ledger, execution: Execution) -> None:
        self.ledger = ledger
        self.execution = execution
        self.interval_s = max(ledger.lease_ms / 3000.0, 0.05)
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
        try:
            if not self.ledger.extend(self.execution):
                if not self.stopped:  # not just a beat that raced finish()
                    self.lost = True
                    logger.warning("job %s: execution lease lost (cancelled or taken over)",
                                   self.execution.job_id)
                return False
        except DelayedError as exc:
            logger.warning("job %s: could not extend the execution lease: %s", self.execution.job_id, exc)
        self.next_at = time.monotonic() + self.interval_s
        return True


class _Beater:
    """The one thread of a process that beats every running execution's :class:`LeaseKeeper`."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.keepers: set[LeaseKeeper] = set()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="celery-delayed-leases", daemon=True)
        self.thread.start()

    def add(self, keeper: LeaseKeeper) -> None:
        with self.lock:
            self.keepers.add(keeper)
        self.wake.set()  # it may be due before anything the thread sleeps toward

    def remove(self, keeper: LeaseKeeper) -> None:
        with self.lock:
            self.keepers.discard(keeper)

    def _run(self) -> None:
        while True:
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
                nxt = min((k.next_at for k in self.keepers), default=now + 60.0)
            self.wake.wait(max(nxt - time.monotonic(), 0.0))
            self.wake.clear()


_beater_lock = threading.Lock()
_the_beater: _Beater | None = None


def _beater() -> _Beater:
    """This process's beater; a forked child (prefork pool) gets its own."""
    global _the_beater
    with _beater_lock:
        if _the_beater is None or _the_beater.pid != os.getpid():
            _the_beater = _Beater()
        return _the_beater
