"""Recurring schedules in the store: one hash per schedule, in the shard of its name.

The gateway of the four schedule scripts (``put_schedule``, ``drop_schedule``,
``pause_schedule``, ``advance_schedule``) and the reads that list schedules.
A schedule's keys (``keys.py``) and its occurrences share one shard, so
every script touches one slot. The fields are :class:`~celery_delayed.vocab.ScheduleField`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import LeaseLost, StoreUnavailable
from ..vocab import Reply, ScheduleField
from .facet import Facet
from .keys import shard_for
from .loader import Arg

#: Occurrence ids a schedule keeps (the newest): those a change or pause cancels.
KEEP_OCCURRENCES = 200


@dataclass(frozen=True)
class StoredSchedule:
    """A recurring schedule as the store holds it."""

    name: str
    shard: int
    definition: dict[str, Any]
    source: str
    config_hash: str | None
    version: int
    epoch: str
    origin_ms: int
    last_raw: str  # the cursor as stored: advance_schedule compares it verbatim
    paused: bool
    updated_ms: int
    #: why the record cannot be read ('' when it can): then ``definition`` is empty
    error: str = ""

    @property
    def last_ms(self) -> int:
        """The cursor: occurrences exist for every fire time up to it."""
        return int(float(self.last_raw or 0))

    @classmethod
    def from_hash(cls, shard: int, h: dict[str, str], name: str = "") -> StoredSchedule | None:
        """Parse a schedule's hash (None: no such schedule).

        A record that cannot be parsed (written by hand, say) is returned with
        its ``error`` set rather than raised, so that one bad record breaks no
        listing of the others.
        """
        if not h or ScheduleField.DEFINITION not in h:
            return None
        name = h.get(ScheduleField.NAME) or name
        try:
            definition = json.loads(h[ScheduleField.DEFINITION])
            if not isinstance(definition, dict):
                raise ValueError(f"the definition is not a JSON object: {h[ScheduleField.DEFINITION][:100]!r}")
            return cls(
                name=name, shard=shard, definition=definition,
                source=h.get(ScheduleField.SOURCE, ""), config_hash=h.get(ScheduleField.CONFIG_HASH),
                version=int(h.get(ScheduleField.VERSION, "0")), epoch=h.get(ScheduleField.EPOCH, ""),
                origin_ms=int(float(h.get(ScheduleField.ORIGIN, "0"))),
                last_raw=h.get(ScheduleField.LAST, "0"), paused=h.get(ScheduleField.PAUSED) == "1",
                updated_ms=int(float(h.get(ScheduleField.UPDATED, "0"))),
            )
        except (ValueError, OverflowError) as exc:  # JSONDecodeError is a ValueError
            version = h.get(ScheduleField.VERSION, "0")
            return cls(name=name, shard=shard, definition={}, source=h.get(ScheduleField.SOURCE, ""),
                       config_hash=h.get(ScheduleField.CONFIG_HASH),
                       version=int(version) if version.isdigit() else 0, epoch=h.get(ScheduleField.EPOCH, ""),
                       origin_ms=0, last_raw="0", paused=h.get(ScheduleField.PAUSED) == "1", updated_ms=0,
                       error=f"its record cannot be read: {exc}")


class ScheduleRecords(Facet):
    """The recurring schedules of one store (see the module docstring)."""

    SCRIPTS = ("put_schedule", "drop_schedule", "pause_schedule", "advance_schedule")

    def shard_of(self, name: str) -> int:
        """The shard of a schedule and of all its occurrences: ``crc32(name) % shards``."""
        return shard_for(name, self.layout.shards)

    def _keys(self, name: str) -> tuple[int, list[str]]:
        s = self.shard_of(name)
        shard_keys = self.keys.shard(s)
        return s, [shard_keys.schedule(name), shard_keys.schedules, shard_keys.occurrences(name)]

    def _on_shard(self, name: str, call: Callable[[int, list[str]], Any]) -> Any:
        """``call(shard, keys)`` on the schedule's shard, again while a reshard moves it.

        A reply ``!moved`` (the shard was sealed against this process's shard
        count, or the schedule is being moved) or NOT_FOUND after a reshard
        this process had not seen: the layout is read again and the call made
        on the schedule's new shard.
        """
        deadline = time.monotonic() + 10.0
        while True:
            s, keys = self._keys(name)
            reply = call(s, keys)
            moved = reply and reply[0] == "!moved"
            if not moved and not (reply and reply[0] == Reply.NOT_FOUND and self.layout.reload(1.0)):
                return reply
            if time.monotonic() > deadline:
                raise StoreUnavailable(f"schedule {name!r} is being moved by a reshard for more than 10 s; try again")
            if moved and not self.layout.reload():
                time.sleep(0.02)

    def put_schedule(self, name: str, definition: dict[str, Any], source: str, config_hash: str = "",
            now_ms: int | None = None, since_ms: int = 0, after_ms: int | None = None,
            paused: bool = False) -> tuple[bool, list[str]]:
        """Create or replace a schedule (``put_schedule.lua``).

        Returns (written, ids of the old definition's occurrences to cancel).
        With ``source="config"`` nothing is written when the stored config
        hash is ``config_hash`` already, or when a scheduler started later
        than ``since_ms`` (this one's start) wrote it. ``after_ms``: the
        cursor and the interval's origin (default: now, the origin kept);
        ``paused``: written paused (else the flag is left as it is).
        """
        self.layout.check()
        self.redis.client.sadd(self.keys.schedules, name)  # the index first: a reader may see a name too early
        text, epoch = json.dumps(definition, sort_keys=True), uuid.uuid4().hex[:16]
        reply = self._on_shard(name, lambda s, keys: self.redis.run(
            self.redis.scripts.put_schedule, keys,
            [self.redis.now_arg(now_ms), name, text, source, config_hash, str(since_ms) if source == "config" else "",
             epoch, f"{s}/{self.layout.shards}", "" if after_ms is None else str(int(after_ms)),
             "1" if paused else ""]))
        return int(reply[0]) == Reply.OK, [str(x) for x in reply[2:]]

    def drop_schedule(self, name: str, only_config: bool = False, since_ms: int = 0) -> tuple[int, list[str]]:
        """Remove a schedule (``drop_schedule.lua``); return (reply code, occurrence ids to cancel).

        ``only_config``: only one that came from the config, and that no
        scheduler started later than ``since_ms`` wrote.
        """
        reply = self._on_shard(name, lambda _s, keys: self.redis.run(
            self.redis.scripts.drop_schedule, keys,
            [self.redis.now_arg(None), name, "config" if only_config else "", since_ms, self.config.record_ttl_ms]))
        if int(reply[0]) != Reply.UNCHANGED:
            self.redis.client.srem(self.keys.schedules, name)
        return int(reply[0]), [str(x) for x in reply[1:]]

    def index(self) -> list[str]:
        """The names of every schedule (one read; ``{prefix}:schedules``)."""
        return sorted(_text(x) for x in self.redis.client.smembers(self.keys.schedules))

    def pause_schedule(self, name: str, paused: bool, now_ms: int | None = None) -> tuple[int, list[str]]:
        """Pause or resume a schedule (``pause_schedule.lua``); return (reply code, occurrence ids to cancel)."""
        reply = self._on_shard(name, lambda _s, keys: self.redis.run(
            self.redis.scripts.pause_schedule, [keys[0], keys[2]],
            [self.redis.now_arg(now_ms), "1" if paused else "0"]))
        return int(reply[0]), [str(x) for x in reply[1:]]

    def advance_schedule(self, sched: StoredSchedule, owner: str, fence: str, new_last_ms: int,
                occurrences: Sequence[tuple[str, int]], now_ms: int | None = None) -> bool:
        """Record created occurrences and move the cursor (``advance_schedule.lua``), under the shard's lease.

        Returns False when the schedule changed since it was read (nothing done).

        Raises:
            LeaseLost: the caller does not hold the shard's lease.
        """
        shard_keys = self.keys.shard(sched.shard)
        args: list[Arg] = [self.redis.now_arg(now_ms), owner, fence, str(sched.version), sched.last_raw,
                           str(new_last_ms), KEEP_OCCURRENCES]
        for job_id, fire in occurrences:
            args += [job_id, str(fire)]
        (code,) = self.redis.run(self.redis.scripts.advance_schedule,
                                 [shard_keys.schedule(sched.name), shard_keys.occurrences(sched.name),
                                  shard_keys.lease], args)
        if code == Reply.NOT_OWNER:
            raise LeaseLost(f"cannot advance schedule {sched.name!r}: shard {sched.shard}'s lease is not held")
        return int(code) == Reply.OK

    def names(self, shards: Iterable[int]) -> dict[int, list[str]]:
        """The schedules' names of each shard, in one round trip."""
        shards = list(shards)
        pipe = self.redis.client.pipeline(transaction=False)
        for s in shards:
            pipe.smembers(self.keys.shard(s).schedules)
        return {s: sorted(_text(x) for x in members) for s, members in zip(shards, pipe.execute(), strict=True)}

    def read(self, names: dict[int, list[str]]) -> list[StoredSchedule]:
        """The schedules named, by shard, in one round trip (those gone meanwhile are left out)."""
        pairs = [(s, n) for s, ns in names.items() for n in ns]
        pipe = self.redis.client.pipeline(transaction=False)
        for s, n in pairs:
            pipe.hgetall(self.keys.shard(s).schedule(n))
        out = []
        for (s, n), raw in zip(pairs, pipe.execute(), strict=True):
            sched = StoredSchedule.from_hash(s, {_text(k): _text(v) for k, v in raw.items()}, n)
            if sched is not None:
                out.append(sched)
        return out

    def get(self, name: str) -> StoredSchedule | None:
        """One schedule (None: there is no such schedule)."""
        s = self.shard_of(name)
        found = self.read({s: [name]})
        return found[0] if found else None

    def all(self) -> list[StoredSchedule]:
        """Every schedule of the store, sorted by name."""
        return sorted(self.read(self.names(self.layout.shard_range())), key=lambda x: x.name)

    def occurrences(self, name: str) -> list[tuple[str, int]]:
        """A schedule's recent occurrences: (job id, fire time ms), the earliest first."""
        s = self.shard_of(name)
        raw: list[Any] = self.redis.client.zrange(self.keys.shard(s).occurrences(name), 0, -1,
                                                  withscores=True)
        return [(_text(item[0]), int(item[1])) for item in raw]


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
