"""``delayed reshard``: change the shard count of a live store.

The layout record (``{p}:layout``) decides the shard count. A reshard from N
to M shards, with producers, schedulers and workers running:

1. **Switch.** The layout becomes ``shards=M, from=N``; every schedule script
   refuses a write placed with N once the shard is **sealed** against it
   (``{p}:{s}:sealed`` = N, checked in the script, so no write lands in the
   old place after the seal): the writer reads the layout again and places
   the job anew. The schedulers are told at once (a membership notice on the
   wake channel; they also read the layout every few heartbeats) and from
   then on hold every shard that may hold jobs (``max(N, M)``). Pause flags
   are copied to new shards.
2. **Move.** One SCAN of the store finds every key kept by shard: job records
   (pending, done markers that guard idempotency keys, dead letters), debounce
   and throttle entries and recurring schedules. Each whose home under M is
   another shard is moved in three steps, each atomic on one shard (so it
   works on Redis Cluster): ``move_out.lua`` takes it (MOVING; out of the due
   set, the pending index, the dead-letter set), ``move_in.lua`` writes it in
   its new shard (its state, TTL and indexes back; a stored message's
   ``delayed_shard`` header rewritten; its compact template copied), then the
   old record is deleted. A job being released or run stays where it is
   (its worker finds it by the message's shard header) and moves once it is
   done. With a database, the rows' ``shard`` column follows.
3. **Finish.** Passes repeat until one finds nothing out of place; then the
   layout drops ``from``, the counters of shards beyond M are added to the
   shards that remain, and the schedulers are told again.

A reshard that stops (Ctrl-C, a crash, ``--wait`` ran out) leaves the store
correct: running it again with the same ``--shards`` picks up where it
stopped (the jobs it had taken are in each shard's ``moving`` set). While it
runs, scheduling costs one more read for a job whose id could still be in
its old shard (an idempotency key must not be used twice), and the
reconciler leaves rows and records alone.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigurationError, InvalidOption
from ..vocab import ScheduleField
from .client import translate_errors
from .fleet import LAYOUT_NOTICE, MEMBERS_NOTICE
from .gateway import Store
from .keys import shard_for
from .moves import JobMover

logger = logging.getLogger("celery_delayed.reshard")

#: Jobs taken out of a shard per ``move_out.lua`` call.
BATCH = 500
#: Most shards a store may have (each is a few keys; a scheduler holds its share of them).
MAX_SHARDS = 16384


@dataclass
class ReshardReport:
    """What one reshard did."""

    old: int
    new: int
    moved_jobs: int = 0
    moved_entries: int = 0  # debounce and throttle entries
    moved_schedules: int = 0
    rows_updated: int = 0
    passes: int = 0
    left_running: int = 0  # out of place, released or running: they move once done
    finished: bool = False
    seconds: float = 0.0
    by_state: dict[str, int] = field(default_factory=dict)


def _escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


@translate_errors
class Resharder(JobMover):
    """Moves a live store from its shard count to another (see the module docstring).

    Args:
        store: the store (its app's settings; any ``delayed_shards``: the layout decides).
        rows: the database's rows (``delayed_database_url``), whose ``shard`` column follows.
        progress: called with a line of progress now and then.
    """

    def __init__(self, store: Store, rows: Any = None, progress: Callable[[str], None] | None = None) -> None:
        super().__init__(store.redis, store.lookup, store.moves)
        self.store = store
        self.rows = rows
        self.progress = progress or (lambda _line: None)
        self._rows_updated = 0

    def moved(self, home: int, ids: list[str]) -> None:
        """The moved jobs' rows say their new shard."""
        if self.rows is not None:
            self._rows_updated += self.rows.set_shard(ids, home)

    # -- the layout ----------------------------------------------------------------------

    def layout(self) -> tuple[int, int | None]:
        """(shards, the count a reshard in progress moves from, or None); raises when no layout is recorded."""
        got = self.client.hmget(self.keys.layout, ["shards", "from"])
        if got[0] is None:
            raise ConfigurationError(
                f"no store under prefix {self.store.config.key_prefix!r} yet: there is nothing to reshard "
                "(set delayed_shards before the first job is scheduled)")
        return int(got[0]), (int(got[1]) if got[1] else None)

    def begin(self, new: int) -> int:
        """Switch the layout to ``new`` shards and seal the old ones; return the count it moves from.

        Raises:
            InvalidOption: ``new`` is not a shard count.
            ConfigurationError: another reshard (to another count) is in progress.
        """
        if isinstance(new, bool) or not isinstance(new, int) or not 1 <= new <= MAX_SHARDS:
            raise InvalidOption(f"--shards must be a whole number from 1 to {MAX_SHARDS}, got {new!r}")
        shards, moving = self.layout()
        if moving is not None:
            if shards != new:
                raise ConfigurationError(
                    f"a reshard from {moving} to {shards} shards is in progress: finish it first "
                    f"(`delayed reshard --shards {shards}`), then reshard to {new}")
            old = moving
        else:
            if shards == new:
                return shards
            old = shards
            # The switch: from now on, the layout says new; writers that still place with old are sealed out below.
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(self.keys.layout, mapping={"shards": str(new), "from": str(old)})
            pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for s in range(old):
            pipe.set(self.keys.shard(s).base + ":sealed", str(old))
        pipe.execute()
        self._copy_pauses(old, new)
        self._tell()
        self.store.layout.reload()
        return old

    def _copy_pauses(self, old: int, new: int) -> None:
        """Pause flags and rate limits set at run time hold the new shards too."""
        if new <= old:
            return
        for name in ("paused", "limits"):
            flags: dict[Any, Any] = dict(self.client.hgetall(getattr(self.keys.shard(0), name)))
            if not flags:
                continue
            pipe = self.client.pipeline(transaction=False)
            for s in range(old, new):
                pipe.hset(getattr(self.keys.shard(s), name), mapping=flags)
            pipe.execute()

    def _tell(self) -> None:
        """Tell the schedulers to read the layout now."""
        self.client.publish(self.keys.wake, MEMBERS_NOTICE + LAYOUT_NOTICE)

    # -- the whole run -------------------------------------------------------------------

    def run(self, new: int, wait_s: float = 600.0, pause_s: float = 1.0) -> ReshardReport:
        """Reshard to ``new`` shards: switch, move passes until nothing is out of place (or ``wait_s``), finish."""
        t0 = time.monotonic()
        old = self.begin(new)
        report = ReshardReport(old, new)
        if old == new and self.store.layout.moving_from is None:
            report.finished = True
            return report
        deadline = time.monotonic() + wait_s
        while True:
            left = self.sweep(new, old, report)
            report.passes += 1
            if left == 0:
                self.finish(new, old)
                report.finished = True
                break
            report.left_running = left
            if time.monotonic() > deadline:
                break
            self.progress(f"pass {report.passes}: {left} job(s) out of place are released or running; "
                          "they move once done")
            time.sleep(pause_s)
        report.seconds = round(time.monotonic() - t0, 3)
        return report

    def finish(self, new: int, old: int) -> None:
        """Nothing is out of place: drop ``from`` from the layout and fold the counters of removed shards."""
        if old > new:
            for s in range(new, old):
                src = self.keys.shard(s)
                stats = self.client.hgetall(src.stats)
                pipe = self.client.pipeline(transaction=False)
                for name, value in stats.items():
                    try:
                        pipe.hincrby(self.keys.shard(s % new).stats, name, int(value))
                    except ValueError:
                        continue
                pipe.execute()
                pipe = self.client.pipeline(transaction=False)
                for key in (src.stats, src.next, src.paused, src.held, src.schedules, src.index_parts, src.limits,
                            src.tokens, src.limit_waits, src.tenants):
                    pipe.delete(key)
                pipe.execute()
        self.client.hdel(self.keys.layout, "from")
        self._tell()
        self.store.layout.reload()

    # -- one pass ------------------------------------------------------------------------

    def sweep(self, new: int, old: int, report: ReshardReport) -> int:
        """One pass over the store; return how many jobs out of place could not move yet (released or running).

        Debounce and throttle entries (with their jobs) and schedules move as
        the scan finds them; other jobs in batches.
        """
        span = max(new, old)
        left = self._resume_taken(span, new)
        jobs: dict[int, list[str]] = defaultdict(list)
        queued = 0
        for shard, kind, rest in self._scan(span):
            if kind == "job":  # its shard key, when it has one, decides its home: read in move_batch
                jobs[shard].append(rest)
                queued += 1
            elif kind in ("debounce", "throttle"):
                self.move_entry(shard, kind, rest, new)
            elif kind == "sched" and shard_for(rest, new) != shard:
                self._move_schedule(shard, rest, new, report)
            if queued >= 5000:
                left += self._move_jobs(jobs, new)
                jobs.clear()
                queued = 0
        left += self._move_jobs(jobs, new)
        self._report(report)
        self.progress(f"pass {report.passes + 1}: moved {report.moved_jobs} job(s), {report.moved_schedules} "
                      f"schedule(s), {report.moved_entries} debounce/throttle entries so far")
        return left

    def _report(self, report: ReshardReport) -> None:
        report.moved_jobs, report.moved_entries = self.counts.moved_jobs, self.counts.moved_entries
        report.by_state = dict(self.counts.by_state)
        report.rows_updated = self._rows_updated

    def _scan(self, span: int) -> Iterator[tuple[int, str, str]]:
        """(shard, kind, the rest of the key) of every per-shard key of a kind that moves: one SCAN of the store."""
        head = f"{self.keys.prefix}:{{"
        for key in self.client.scan_iter(match=_escape(head) + "*", count=1000):
            key = str(key)
            close = key.find("}:", len(head))
            if close < 0:
                continue
            try:
                shard = int(key[len(head):close])
            except ValueError:
                continue
            if not 0 <= shard < span:
                continue
            kind, _, rest = key[close + 2:].partition(":")
            if kind in ("job", "debounce", "throttle", "sched") and rest:
                yield shard, kind, rest

    # -- jobs ------------------------------------------------------------------------------

    def _resume_taken(self, span: int, new: int) -> int:
        """Finish the moves an earlier run took out but did not complete (each shard's ``moving`` set)."""
        left = 0
        for s in range(span):
            ids = [str(i) for i in self.client.smembers(self.keys.shard(s).moving)]
            if ids:
                left += self._move_jobs({s: ids}, new)
        return left

    def _move_jobs(self, jobs: dict[int, list[str]], new: int) -> int:
        left = 0
        for shard, ids in jobs.items():
            for at in range(0, len(ids), BATCH):
                left += self.move_batch(shard, ids[at:at + BATCH], new)
        return left

    # -- schedules -----------------------------------------------------------------------------

    def _move_schedule(self, shard: int, name: str, new: int, report: ReshardReport) -> None:
        """Move a recurring schedule (its hash, its occurrences, its name in the shard's set).

        ``mv`` on the old hash first: advance_schedule.lua, pause and drop
        leave a schedule being moved alone (its new shard's holder goes on).
        """
        home = shard_for(name, new)
        src, dest = self.keys.shard(shard), self.keys.shard(home)
        if not self.client.exists(src.schedule(name)):
            self.client.srem(src.schedules, name)
            return
        self.client.hset(src.schedule(name), ScheduleField.MOVING, "1")
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(src.schedule(name))
        pipe.pttl(src.schedule(name))
        pipe.zrange(src.occurrences(name), 0, -1, withscores=True)
        fields, ttl, occ = pipe.execute()
        fields = {str(k): str(v) for k, v in fields.items() if str(k) != ScheduleField.MOVING}
        if not self.client.exists(dest.schedule(name)):
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(dest.schedule(name), mapping=fields)
            if int(ttl) > 0:
                pipe.pexpire(dest.schedule(name), int(ttl))
            if occ:
                pipe.zadd(dest.occurrences(name), {str(m): float(sc) for m, sc in occ})
            pipe.sadd(dest.schedules, name)
            pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(src.schedule(name))  # one key per DELETE: a cluster pipeline takes no more
        pipe.delete(src.occurrences(name))
        pipe.srem(src.schedules, name)
        pipe.execute()
        report.moved_schedules += 1


def describe(report: ReshardReport) -> str:
    """The report as the CLI prints it."""
    states = ", ".join(f"{n} {s.lower() or '?'}" for s, n in sorted(report.by_state.items()))
    head = (f"resharded {report.old} -> {report.new} shards in {report.seconds:.1f} s ({report.passes} pass(es)): "
            if report.finished else
            f"reshard {report.old} -> {report.new} not finished after {report.seconds:.1f} s: "
            f"{report.left_running} job(s) released or running in their old shard move once done; run "
            f"`delayed reshard --shards {report.new}` again to finish. So far: ")
    return (head + f"moved {report.moved_jobs} job(s)" + (f" ({states})" if states else "")
            + f", {report.moved_schedules} schedule(s), {report.moved_entries} debounce/throttle entries"
            + (f", {report.rows_updated} row(s)" if report.rows_updated else ""))


def report_json(report: ReshardReport) -> str:
    """The report as JSON (``--json``)."""
    return json.dumps(report.__dict__, sort_keys=True)
