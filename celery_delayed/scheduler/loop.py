"""The scheduler loop: hold shards, sleep until the next due job, release it.

One process (``celery -A proj delayed run``) or a thread in a worker
(``celery -A proj worker --delayed``). Several may run side by side: each
heartbeats a membership lease; the live members split the shards between
them (``rebalance.lua``), and a dead member's shards move to the others once
its lease runs out. The loop never polls blindly: it sleeps until the
earliest due time of its shards, or its next heartbeat, and a job scheduled
earlier than that wakes it through pub/sub (``schedule.lua`` publishes only
when the new job is earlier than the shard's known next due time).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from typing import Any

import redis
from celery import Celery
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..errors import LeaseLost, StoreUnavailable
from ..store import Store, get_store
from .mover import Mover, make_mover

logger = logging.getLogger("celery_delayed.scheduler")

_TRANSIENT = (StoreUnavailable, RedisConnectionError, RedisTimeoutError, OSError)


def owner_token() -> str:
    """A unique scheduler id: host, pid and a random part (no '|', which leases use)."""
    host = socket.gethostname().replace("|", "_")
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Scheduler:
    """Release due jobs of the shards this process holds, until :meth:`stop`.

    Args:
        app: the Celery app (its ``delayed_*`` settings apply).
        store: the store (default: the app's).
        owner: this scheduler's token (default: host:pid:random).
        max_sleep_s: the longest it sleeps without looking (a safety net;
            wake-ups arrive through pub/sub).
    """

    def __init__(
        self,
        app: Celery,
        store: Store | None = None,
        owner: str | None = None,
        max_sleep_s: float | None = None,
    ) -> None:
        self.app = app
        self.store = store or get_store(app)
        self.config = self.store.config
        self.owner = owner or owner_token()
        self.heartbeat_s = self.config.lease_ms / 4000.0
        self.max_sleep_s = max_sleep_s if max_sleep_s is not None else self.heartbeat_s
        self.mover: Mover = make_mover(app, self.store)
        self.shards: dict[int, str] = {}  # shard -> fence
        self.next_due: dict[int, float] = {}  # shard -> due ms (Redis clock)
        self.members: list[str] = []
        self.released = 0
        self.batches = 0
        self._offset_ms = 0.0  # Redis clock - local clock
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._next_heartbeat = 0.0
        self._listener: threading.Thread | None = None
        self._pubsub_client: redis.Redis | None = None
        self.ready = threading.Event()  # set once the first heartbeat has run

    # -- clock -----------------------------------------------------------------

    def _redis_now(self) -> float:
        return time.time() * 1000.0 + self._offset_ms

    def _observe(self, server_now_ms: int) -> None:
        if server_now_ms > 0:
            self._offset_ms = server_now_ms - time.time() * 1000.0

    # -- wake-ups ----------------------------------------------------------------

    def _listen(self) -> None:
        """Pub/sub thread: a job due earlier than known wakes the loop."""
        backoff = 0.1
        while not self._stop.is_set():
            pubsub = None
            try:
                client = redis.Redis.from_url(
                    self.config.redis_url, decode_responses=True, health_check_interval=10
                )
                self._pubsub_client = client
                pubsub = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
                pubsub.subscribe(self.store.keys.wake)
                # After (re)subscribing, look at every shard again: a wake-up
                # may have been published while we were not listening.
                self._wake_all()
                backoff = 0.1
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=1.0)
                    if msg and msg.get("type") == "message":
                        self._on_wake(str(msg["data"]))
            except Exception as exc:
                if self._stop.is_set():
                    break
                logger.warning("wake-up listener: %s; retrying in %.1fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        logger.debug("closing pubsub failed", exc_info=True)

    def _on_wake(self, data: str) -> None:
        shard_s, _, due_s = data.partition(":")
        try:
            shard, due = int(shard_s), float(due_s)
        except ValueError:
            return
        with self._lock:
            if shard in self.shards and due < self.next_due.get(shard, float("inf")):
                self.next_due[shard] = due
                self._wake.set()

    def _wake_all(self) -> None:
        with self._lock:
            for s in self.shards:
                self.next_due[s] = 0.0
        self._wake.set()

    # -- membership ----------------------------------------------------------------

    def _heartbeat(self) -> None:
        now, members = self.store.heartbeat(self.owner)
        self._observe(now)
        if members != self.members or not self.shards:
            self._rebalance(members)
        self._next_heartbeat = time.monotonic() + self.heartbeat_s
        self.ready.set()

    def _rebalance(self, members: list[str] | None = None) -> None:
        shards = self.store.rebalance(self.owner)
        with self._lock:
            gained = set(shards) - set(self.shards)
            lost = set(self.shards) - set(shards)
            self.shards = shards
            for s in gained:
                self.next_due[s] = 0.0  # look at it now
            for s in lost:
                self.next_due.pop(s, None)
        if members is not None:
            self.members = members
        if gained or lost:
            logger.info(
                "scheduler %s holds %d shard(s) of %d with %d member(s)%s%s",
                self.owner, len(shards), self.config.shards, len(self.members),
                f"; gained {sorted(gained)}" if gained else "",
                f"; lost {sorted(lost)}" if lost else "",
            )

    # -- releasing -------------------------------------------------------------------

    def release_due(self) -> int:
        """Release every due job of the held shards, one batch per shard per round.

        Round-robin keeps a shard with a large backlog from starving the
        others. Returns how many jobs were released.
        """
        total = 0
        limit = self.config.batch_size
        while not self._stop.is_set():
            now = self._redis_now()
            with self._lock:
                due = [(s, f) for s, f in self.shards.items() if self.next_due.get(s, 0.0) <= now]
            if not due:
                break
            for shard, fence in due:
                if self._stop.is_set():
                    break
                try:
                    batch = self.mover.move(shard, self.owner, fence, limit)
                except LeaseLost:
                    logger.info("scheduler %s lost the lease of shard %d", self.owner, shard)
                    with self._lock:
                        self.shards.pop(shard, None)
                        self.next_due.pop(shard, None)
                    self._next_heartbeat = 0.0  # re-read the membership now
                    continue
                self._observe(batch.now_ms)
                self.batches += 1
                total += batch.count
                with self._lock:
                    if shard not in self.shards:
                        continue
                    if batch.count + batch.skipped >= limit:
                        self.next_due[shard] = 0.0  # more are due: next round
                    else:
                        nxt = float(batch.next_due_ms) if batch.next_due_ms is not None else float("inf")
                        self.next_due[shard] = nxt
        self.released += total
        return total

    def _sleep_s(self) -> float:
        with self._lock:
            earliest = min(self.next_due.values(), default=float("inf"))
        until_due = (earliest - self._redis_now()) / 1000.0
        until_hb = self._next_heartbeat - time.monotonic()
        return max(0.0, min(until_due, until_hb, self.max_sleep_s))

    def run_once(self) -> float:
        """Heartbeat if it is time, release what is due; return seconds to sleep."""
        if time.monotonic() >= self._next_heartbeat:
            self._heartbeat()
        self._wake.clear()
        self.release_due()
        return self._sleep_s()

    def run(self) -> None:
        """Run until :meth:`stop`; Redis errors are logged and retried with backoff."""
        logger.info(
            "celery-delayed scheduler %s starting (%s path, %d shards, prefix %r)",
            self.owner, "direct" if self.store.direct else "publish",
            self.config.shards, self.config.key_prefix,
        )
        self._listener = threading.Thread(target=self._listen, name="delayed-wake", daemon=True)
        self._listener.start()
        backoff = 0.1
        try:
            while not self._stop.is_set():
                try:
                    sleep_s = self.run_once()
                    backoff = 0.1
                except _TRANSIENT as exc:
                    logger.warning("scheduler: store unavailable (%s); retrying in %.1fs", exc, backoff)
                    sleep_s = backoff * (0.5 + random.random())
                    backoff = min(backoff * 2, 5.0)
                    self._next_heartbeat = 0.0
                    self.mover.close()
                except Exception:
                    logger.exception("scheduler: unexpected error; retrying in %.1fs", backoff)
                    sleep_s = backoff
                    backoff = min(backoff * 2, 5.0)
                if sleep_s > 0:
                    self._wake.wait(sleep_s)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        try:
            self.store.heartbeat(self.owner, leave=True)  # hand the shards over at once
        except Exception:
            logger.debug("leaving the scheduler set failed", exc_info=True)
        self.mover.close()
        if self._listener is not None:
            self._listener.join(timeout=3)
        logger.info("celery-delayed scheduler %s stopped (%d released)", self.owner, self.released)

    def stop(self) -> None:
        """Ask the loop to stop after the batch it is moving (safe from a signal handler)."""
        self._stop.set()
        self._wake.set()

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stop.is_set()

    def status(self) -> dict[str, Any]:
        """A snapshot of this scheduler: owner, shards held, released count."""
        with self._lock:
            return {"owner": self.owner, "shards": sorted(self.shards), "members": list(self.members),
                    "released": self.released, "batches": self.batches}
