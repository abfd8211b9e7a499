"""The state mirror: Redis's job state changes, applied to the database rows in batches.

With ``delayed_database_url`` set, the scripts that change a job's state
append one entry per call to their shard's change log (``{p}:{s}:changes``,
a Redis stream: the new state and the ids), inside the same script, so no
change is missed and no database write sits on the hot path of a release or
a task. The scheduler that holds a shard applies its log: it reads a batch,
reads the records of the jobs named (one pipelined round trip), updates
their rows in one transaction, then trims what it applied. A crash between
the commit and the trim applies the batch again, which is harmless (the
updates set, they do not add).

The lag (the age of the oldest entry not yet applied) is in ``delayed
status``; under a release burst it is a batch or two (measured in ``bench/``).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from ..store import Store

if TYPE_CHECKING:  # SQLAlchemy is an optional extra: imported only with a database
    from ..sql.rows import JobRows
from ..vocab import TERMINAL, Field, JobState

logger = logging.getLogger("celery_delayed.scheduler")

#: States whose change rewrites the row's record (a new message, due time or failure).
_REWRITE = frozenset({JobState.SCHEDULED, JobState.DEAD, JobState.FAILED})
#: Entries applied per batch.
BATCH = 1000


class Mirror:
    """Applies one store's change logs to its rows, shard by shard."""

    def __init__(self, store: Store, rows: JobRows) -> None:
        self.store = store
        self.rows = rows
        self.applied = 0

    def apply_shard(self, shard: int, limit: int = BATCH) -> int:
        """Apply up to ``limit`` entries of one shard's log; return how many entries it applied."""
        entries = self.store.changes.read(shard, limit)
        if not entries:
            return 0
        latest: dict[str, str] = {}
        for _entry_id, state, ids in entries:
            for job_id in ids:
                latest[job_id] = state  # the last change wins
        records = self.store.lookup.records(shard, list(latest))
        changes = []
        for job_id, state in latest.items():
            rec = records.get(job_id) or {}
            change: dict[str, Any] = {"id": job_id, "state": rec.get(Field.STATE, state) or state}
            if rec.get(Field.DUE):
                change["due_ms"] = int(float(rec[Field.DUE]))
            if rec.get(Field.ATTEMPT):
                change["attempts"] = int(rec[Field.ATTEMPT])
            final = rec.get(Field.FINISHED) or rec.get(Field.DIED) or rec.get(Field.CANCELLED)
            if change["state"] in TERMINAL and final:
                change["finished_ms"] = int(float(final))
            if change["state"] in _REWRITE and rec.get(Field.MESSAGE):
                change["record"] = json.dumps({k: v for k, v in rec.items() if v}, separators=(",", ":"))
            changes.append(change)
        self.rows.apply(changes)
        self.store.changes.trim(shard, entries[-1][0])
        self.applied += len(changes)
        return len(entries)

    def apply(self, shards: list[int]) -> int:
        """Apply every pending entry of the given shards (in bounded batches); return the entries applied."""
        total = 0
        for shard in shards:
            while True:
                n = self.apply_shard(shard)
                total += n
                if n < BATCH:
                    break
        return total
