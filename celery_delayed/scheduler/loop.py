"""The scheduler loop: hold shards, sleep until the next due job, release it.

One process (``celery -A proj delayed run``) or a thread in a worker
(``celery -A proj worker --delayed``). Several may run side by side: each
heartbeats a membership lease, computes from the live members which shards
it should hold (:func:`share`: the same answer in every member) and takes,
keeps or gives up each shard's own lease (``shard_lease.lua``: one slot per
call, so this runs on Redis Cluster). A dead member's shards move to the
others once their leases run out; a leaving member gives them up at once.
The loop never polls blindly: it sleeps until the earliest due time of its
shards, or its next heartbeat, and a job scheduled earlier than that wakes it
through pub/sub (see :mod:`.wakeup`).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid

from celery import Celery
from kombu.exceptions import OperationalError

from ..config import get_config
from ..doctor import PROBLEM, store_findings
from ..errors import ConfigurationError, DelayedError, LeaseLost, StoreFull, StoreUnavailable
from ..schedules.definition import config_entries
from ..schedules.keeper import Recurrer
from ..store import LAYOUT_NOTICE, Store
from ..threads import BackgroundThread
from .maintenance import Maintenance
from .releaser import Releaser, make_releaser
from .wakeup import WakeListener

logger = logging.getLogger("celery_delayed.scheduler")

# Errors that mean "Redis or the broker is unreachable right now": logged
# briefly and retried with back-off. Anything else is logged with a traceback
# and retried the same way: the scheduler process never dies of an error.
_TRANSIENT = (StoreUnavailable, OperationalError, OSError)
#: Every this many membership leases a scheduler checks every lease it may hold, even when nothing
#: suggests that it lost one (a safety net: each check costs a script call per shard).
VERIFY_LEASES = 20
_INF = float("inf")
#: Under look-ahead a shard is visited when its earliest job is this much less than
#: ``delayed_lookahead_ms`` from due (half the look-ahead when that is shorter); the visit
#: releases the whole look-ahead, so a steady stream goes in batches of about this long.
LOOKAHEAD_SLICE_MS = 250
#: While several tenants have jobs due on its shards, a scheduler shares one batch
#: (``delayed_batch_size``) between the shards it visits in a round, each call taking at least
#: this many: a tenant's jobs on the last shard of the round then wait for about one batch,
#: not one batch per shard.
FAIR_MIN_BATCH = 50
#: Heartbeats between two reads of the store's layout (a reshard also tells the schedulers at once).
LAYOUT_EVERY = 2


def share(members: list[str], owner: str, shards: int) -> set[int]:
    """The shards ``owner`` should hold: shard i goes to the (i mod M)-th of the M sorted live members.

    Every member computes the same split from the same membership, and none
    holds more than its fair share plus one (``ceil(shards / M)``).
    """
    live = sorted(members)
    if owner not in live:
        return set()
    k, m = live.index(owner), len(live)
    return set(range(k, shards, m))


def scheduler_token() -> str:
    """A unique scheduler id: host, pid and a random part (no '|', which leases use)."""
    host = socket.gethostname().replace("|", "_")
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Scheduler(BackgroundThread):
    """Release due jobs of the shards this process holds, until stopped.

    A daemon thread (:meth:`start`, :meth:`stop`), or a loop in the caller's
    thread (:meth:`run`, ended by :meth:`request_stop`). A stop takes effect
    after the batch being moved: a batch in flight is finished (published and
    acknowledged), so a stop never strands a claimed job until its claim
    lease runs out.

    Args:
        app: the Celery app (its ``delayed_*`` settings apply).
        store: the store (default: one of its own, on a fail-fast Redis client).
        owner: this scheduler's token (default: host:pid:random).
        max_sleep_s: the longest it sleeps without looking (a safety net;
            wake-ups arrive through pub/sub). Default: the heartbeat period.
    """

    def __init__(
        self,
        app: Celery,
        store: Store | None = None,
        owner: str | None = None,
        max_sleep_s: float | None = None,
    ) -> None:
        super().__init__(name="celery-delayed")
        self.app = app
        if store is None:
            store = Store(app, get_config(app), fail_fast=True)
        self.store = store
        self.config = store.config
        self.owner = owner or scheduler_token()
        # Four heartbeats per lease: a member survives a few slow ones.
        self.heartbeat_s = self.config.lease_ms / 4000.0
        self.max_sleep_s = max_sleep_s if max_sleep_s is not None else self.heartbeat_s
        self.releaser: Releaser = make_releaser(app, store)
        self.shards: dict[int, str] = {}  # shard -> fence
        self.next_due: dict[int, float] = {}  # shard -> due ms (Redis clock)
        self.no_tenants: set[int] = set()  # shards whose last release found fewer than two tenants due
        self.members: list[str] = []
        self.released = 0
        self.batches = 0
        self.ready = threading.Event()  # set once the first heartbeat has run
        self._offset_ms = 0.0  # Redis clock - local clock
        self._lock = threading.Lock()
        self._next_heartbeat = 0.0  # time.monotonic() of the next heartbeat
        # Check every lease this scheduler may hold at the next heartbeat (not only the shards it
        # gains or gives up): at the start, after an error or a lost lease, when it (re)joined the
        # members, and every VERIFY_LEASES of them anyway (see _hold).
        self._verify = True
        self._verify_at = 0.0
        self._joined = False
        self._checked = False
        self._beats = 0
        self._layout_due = False
        #: the error that stopped the scheduler for good (a setting that disagrees with the store's)
        self.fatal: ConfigurationError | None = None
        # Wake-ups that arrive while a shard is being moved: the move's result
        # may predate them, so they are applied after it (see _apply).
        self._woken: dict[int, float] = {}
        self._listener = WakeListener(store, self._on_due, self._on_members, self._wake_all)
        self.maintenance: Maintenance | None = None
        self.recurrer: Recurrer | None = None

    # -- clock -----------------------------------------------------------------

    def _redis_now(self) -> float:
        return time.time() * 1000.0 + self._offset_ms

    def _observe(self, server_now_ms: int) -> None:
        if server_now_ms > 0:
            self._offset_ms = server_now_ms - time.time() * 1000.0

    # -- wake-ups (called from the listener thread) -------------------------------

    def _on_due(self, shard: int, due: float) -> None:
        with self._lock:
            if shard not in self.shards:
                return
            self._woken[shard] = min(due, self._woken.get(shard, _INF))
            if due < self.next_due.get(shard, _INF):
                self.next_due[shard] = due
                self.wake()

    def _on_members(self, owner: str) -> None:
        if owner == LAYOUT_NOTICE:  # a reshard changed the layout: read it at the next heartbeat, now
            self._layout_due = True
        if owner != self.owner:
            self._next_heartbeat = 0.0
            self.wake()

    def _wake_all(self) -> None:
        """Look at every held shard now (after a (re)subscription or an outage)."""
        with self._lock:
            for s in self.shards:
                self.next_due[s] = 0.0
                self._woken[s] = 0.0  # also overrides the result of a move in flight
        self.wake()

    # -- membership ----------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Renew the membership, then take, keep or give up shard leases to match the live members."""
        self._next_heartbeat = time.monotonic() + self.heartbeat_s
        self._beats += 1
        if self._layout_due or self._beats % LAYOUT_EVERY == 0:  # follow a reshard (told, or found out)
            self._layout_due = False
            if self.store.layout.reload():
                logger.info("scheduler %s: the store's layout is now %d shards%s", self.owner, self.store.layout.shards,
                            f" (a reshard is moving jobs from {self.store.layout.moving_from})"
                            if self.store.layout.moving_from else "")
        beat = self.store.fleet.heartbeat(self.owner)
        self._observe(beat.now_ms)
        self._hold(beat.members, verify=beat.joined)
        if len(beat.members) > 1:
            self._watch_members(beat.deadlines)
        if not self._joined or beat.joined:  # joined, or back after being counted dead: the others rebalance
            self._joined = True
            self._announce()
        self.ready.set()

    def _watch_members(self, deadlines: dict[str, int]) -> None:
        """Heartbeat again the moment another member's lease runs out.

        A dead member's shards are taken over when its lease expires; waiting
        for our next regular heartbeat would add up to a quarter lease.
        """
        others = [deadline for member, deadline in deadlines.items() if member != self.owner]
        if others:
            left_s = max(0.0, (min(others) - self._redis_now()) / 1000.0) + 0.02
            self._next_heartbeat = min(self._next_heartbeat, time.monotonic() + left_s)

    def _announce(self) -> None:
        """Tell the other schedulers that the membership changed (best effort)."""
        try:
            self.store.fleet.notify_members(self.owner)
        except Exception:
            logger.debug("announcing the membership change failed", exc_info=True)

    def _hold(self, members: list[str], verify: bool = False) -> None:
        """Hold this member's share of the shards.

        A shard's lease has no deadline (it is this scheduler's while it is a
        live member), so a heartbeat that changes nothing sends nothing here:
        only the shards it gains or gives up go to the store. With ``verify``
        (and after an error, a lost lease, and every ``VERIFY_LEASES``) every
        wanted shard is checked and every other one given up, in case this
        scheduler's view is stale: it was counted dead and its shards taken,
        or a reply was lost. A wanted shard that another live member holds
        is tried again when that member, giving it up, announces it (or at
        the next heartbeat, or when that member's membership runs out: see
        :meth:`_watch_members`); shards given up are announced, so their new
        holder takes them at once.
        """
        with self._lock:
            before = dict(self.shards)
        wanted = share(members, self.owner, self.store.layout.span)
        if verify or self._verify or time.monotonic() >= self._verify_at:
            self._verify = True  # until the check went through
            take, give = wanted, (set(range(self.store.layout.span)) | set(before)) - wanted
        else:
            take, give = wanted - set(before), set(before) - wanted
        self.members = members
        if not take and not give:
            return
        held, waits = self.store.fleet.shard_lease(self.owner, take, give, members)
        if self._verify:
            self._verify = False
            self._verify_at = time.monotonic() + VERIFY_LEASES * self.config.lease_ms / 1000.0
        held = {s: f for s, f in before.items() if s in wanted and s not in take} | held
        with self._lock:
            gained = {s for s, f in held.items() if self.shards.get(s) != f}  # new, or taken again: a new fence
            lost = set(before) - set(held)
            self.shards = held
            for s in gained:
                self.next_due[s] = 0.0  # look at it now
            for s in lost:
                self.next_due.pop(s, None)
                self._woken.pop(s, None)
        if set(before) - wanted:
            self._announce()
        if gained or lost:
            logger.info(
                "scheduler %s holds %d shard(s) of %d with %d member(s)%s%s%s",
                self.owner, len(held), self.store.layout.span, len(members),
                f"; gained {sorted(gained)}" if gained else "",
                f"; lost {sorted(lost)}" if lost else "",
                f"; waiting for {len(waits)}" if waits else "",
            )

    def _give_up(self) -> None:
        """Give every held shard's lease back (a clean stop: the others take them at once)."""
        with self._lock:
            held, self.shards = list(self.shards), {}
            self.next_due.clear()
        if held:
            self.store.fleet.shard_lease(self.owner, (), held)

    # -- releasing -------------------------------------------------------------------

    def release_due(self) -> int:
        """Release every due job of the held shards, one batch per shard per round.

        Round robin keeps a shard with a large backlog from starving the
        others; the membership heartbeat keeps running between rounds, so a
        long backlog does not cost this scheduler its shards. Returns how many
        jobs were released.
        """
        total = 0
        limit = self.config.batch_size
        while not self.stopping:
            if time.monotonic() >= self._next_heartbeat:
                self._heartbeat()
            now = self._redis_now() + self._lead_ms()
            with self._lock:
                due = [(s, f) for s, f in self.shards.items() if self.next_due.get(s, 0.0) <= now]
            if not due:
                break
            # Several tenants' jobs due: one batch shared between the shards, so that a tenant's
            # jobs on the round's last shard are not behind a full batch of every other shard.
            # (A shard not released from yet may have some: a resume, a new lease, a start.)
            fair = len(due) > 1 and any(s not in self.no_tenants for s, _ in due)
            each = max(min(FAIR_MIN_BATCH, limit), limit // len(due)) if fair else limit
            for shard, fence in due:
                if self.stopping:
                    break
                total += self._move(shard, fence, each)
        self.released += total
        return total

    def _move(self, shard: int, fence: str, limit: int) -> int:
        with self._lock:
            self._woken.pop(shard, None)
        try:
            batch = self.releaser.release(shard, self.owner, fence, limit)
        except LeaseLost:
            logger.info("scheduler %s lost the lease of shard %d", self.owner, shard)
            with self._lock:
                self.shards.pop(shard, None)
                self.next_due.pop(shard, None)
            self._next_heartbeat = 0.0  # re-read the membership now
            self._verify = True  # and check every lease: others may be lost too
            return 0
        self._observe(batch.now_ms)
        self.batches += 1
        if batch.tenants:
            self.no_tenants.discard(shard)
        else:
            self.no_tenants.add(shard)
        if (batch.count or batch.not_sent) and self.maintenance is not None:
            self.maintenance.released_from(shard)
        if batch.count:
            logger.debug("shard %d: released %d job(s)", shard, batch.count)
        with self._lock:
            if shard in self.shards:
                if batch.count + batch.skipped >= limit:
                    nxt = 0.0  # more may be due: next round
                else:
                    nxt = float(batch.next_due_ms) if batch.next_due_ms is not None else _INF
                if batch.hold_ms is not None:
                    # Debounce jobs wait in the store for their due time, not a look-ahead
                    # before it: come back when the earliest is due (next_due is visited a
                    # lead ahead of it).
                    nxt = min(nxt, float(batch.hold_ms + self._lead_ms()))
                # A wake-up that arrived during the move may be newer than its result.
                self.next_due[shard] = min(nxt, self._woken.pop(shard, _INF))
        return batch.count

    def _lead_ms(self) -> int:
        """How long before its earliest job is due a shard is visited.

        The look-ahead less one slice (:data:`LOOKAHEAD_SLICE_MS`, or half the
        look-ahead when that is shorter): a visit releases everything due
        within the whole look-ahead, so under a steady stream of due jobs a
        shard is visited about once per slice with a batch each time, not once
        per job, and each job still goes at least the look-ahead less a slice
        before it is due (time for a worker to take in a burst due at one
        instant before the instant).
        """
        lookahead = self.config.lookahead_ms
        return lookahead - min(lookahead // 2, LOOKAHEAD_SLICE_MS)

    def _sleep_s(self) -> float:
        with self._lock:
            earliest = min(self.next_due.values(), default=_INF)
        until_due = (earliest - self._lead_ms() - self._redis_now()) / 1000.0
        until_hb = self._next_heartbeat - time.monotonic()
        return max(0.0, min(until_due, until_hb, self.max_sleep_s))

    def held_shards(self) -> list[int]:
        """The shards this scheduler holds now."""
        with self._lock:
            return sorted(self.shards)

    def held_fences(self) -> dict[int, str]:
        """The shards this scheduler holds now, with their lease fences."""
        with self._lock:
            return dict(self.shards)

    def _start_maintenance(self) -> None:
        """The mirror, the outbox sweep and the reconciler, in a thread of their own."""
        rows = None
        if self.config.database_url:
            from ..sql.rows import get_rows  # SQLAlchemy is an optional extra

            rows = get_rows(self.app)
            assert rows is not None
            rows.check_schema()
        self.maintenance = Maintenance(self.store, rows, self.owner, self.held_shards)
        self.maintenance.start()

    def preflight(self) -> list[str]:
        """Check the store before joining; return (and log) what ``delayed doctor`` finds wrong with it.

        Raises:
            ConfigurationError: this scheduler's settings disagree with the
                store's layout or with the schedulers already running: it must
                not join (it would take shards it cannot serve); or an entry of
                ``delayed_schedule`` is wrong.
            StoreUnavailable: Redis cannot be reached (the loop tries again).
        """
        self.store.fleet.check()
        try:
            config_entries(self.app)  # recurring schedules: a bad entry stops the scheduler with its message
        except DelayedError as exc:
            if isinstance(exc, StoreUnavailable):
                raise
            raise ConfigurationError(f"delayed_schedule: {exc}") from exc
        if self.config.database_url:
            from ..sql.binding import ensure_bound  # SQLAlchemy is an optional extra
            from ..sql.rows import get_rows

            rows = get_rows(self.app)
            assert rows is not None
            rows.check_schema()
            ensure_bound(self.store, rows, max_age_s=0)  # a database bound to another store: never join
        warnings = []
        for f in store_findings(self.store):
            if f.level == "ok":
                continue
            text = f"{f.message}; {f.fix}" if f.fix else f.message
            logger.log(logging.ERROR if f.level == PROBLEM else logging.WARNING, "celery-delayed store: %s", text)
            warnings.append(text)
        self._checked = True
        return warnings

    def run_once(self) -> float:
        """Heartbeat if it is time, release what is due; return seconds to sleep."""
        if not self._checked:
            self.preflight()
        if self.maintenance is None:
            self._start_maintenance()
        if self.recurrer is None:  # recurring schedules (schedules/keeper.py)
            self.recurrer = Recurrer(self.app, self.store, self.owner, self.held_fences)
            self.recurrer.start()
        if time.monotonic() >= self._next_heartbeat:
            self._heartbeat()
        self.release_due()
        return self._sleep_s()

    # -- the thread (see BackgroundThread) ---------------------------------------------------

    def on_start(self) -> None:
        """Say so, and start the wake-up listener."""
        logger.info(
            "celery-delayed scheduler %s starting (%s path, %d shards, prefix %r)",
            self.owner, "direct" if self.store.broker.direct else "publish",
            self.store.layout.shards, self.config.key_prefix,
        )
        self._listener.start()

    def body(self) -> float:
        """One :meth:`run_once`; sleep until the next due job or heartbeat (a wake-up cuts it short)."""
        sleep_s = self.run_once()
        if self.failures:
            logger.warning("scheduler %s: resuming after %d failed attempt(s)", self.owner, self.failures)
        return sleep_s

    def on_error(self, exc: Exception) -> float:
        """Log the error and back off, then take the shards again; a setting the store refuses stops for good.

        The scheduler never dies of any other error: an unreachable Redis or
        broker is logged briefly, anything else with a traceback.
        """
        if isinstance(exc, ConfigurationError):
            logger.critical("scheduler %s: %s; stopping", self.owner, exc)
            self.fatal = exc
            self.request_stop()
            return 0.0
        backoff = self.backoff(self.failures)
        if isinstance(exc, StoreFull):
            logger.error("scheduler: store out of memory (%s); retrying in %.1fs", exc, backoff)
        elif isinstance(exc, _TRANSIENT):
            logger.warning("scheduler: store or broker unavailable (%s); retrying in %.1fs", exc, backoff)
        else:
            logger.exception("scheduler: unexpected error; retrying in %.1fs", backoff)
        self._recover()
        # Jitter keeps several schedulers from reconnecting in lockstep.
        return backoff * (0.5 + random.random())

    def _recover(self) -> None:
        """After an error: heartbeat and take the shards again at once, then look at every shard.

        Redis may have restarted without its data (leases gone), and jobs may
        have been scheduled while the listener was not subscribed.
        """
        self._next_heartbeat = 0.0
        self._verify = True
        self._wake_all()  # its wake-up is dropped: the loop sleeps the back-off first (BackgroundThread.run)
        try:
            self.releaser.close()
        except Exception:
            logger.debug("closing the releaser failed", exc_info=True)

    def on_exit(self) -> None:
        """Stop the other threads, leave the scheduler set (handing the shards over), close the store."""
        # Asked first, joined last: the listener reads this scheduler's own leave announcement
        # and ends then, rather than after its read timeout.
        self._listener.request_stop()
        if self.maintenance is not None:
            self.maintenance.stop()
        if self.recurrer is not None:
            self.recurrer.stop()
        if self._joined:
            try:
                self.store.fleet.heartbeat(self.owner, leave=True)  # hand the shards over at once
                self._give_up()
                self._announce()
            except Exception:
                logger.debug("leaving the scheduler set failed", exc_info=True)
        self.releaser.close()
        self._listener.stop()
        self.store.redis.close()
        logger.info("celery-delayed scheduler %s stopped (%d released)", self.owner, self.released)

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` (or :meth:`request_stop`) was called."""
        return self.stopping

    @property
    def listening(self) -> bool:
        """True while the wake-up listener is subscribed."""
        return self._listener.subscribed.is_set()
