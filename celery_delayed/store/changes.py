"""The change log a database mirror reads: per shard, the jobs whose state changed."""

from __future__ import annotations

from typing import Any

from ..vocab import Field
from .facet import Facet


class ChangeLog(Facet):
    """Each shard's change log (a Redis stream the scripts append to when a database mirrors the store)."""

    def read(self, shard: int, count: int = 1000) -> list[tuple[str, str, list[str]]]:
        """The oldest entries of a shard's change log: (entry id, state, job ids)."""
        entries: list[Any] = self.redis.client.xrange(  # type: ignore[assignment]
            self.keys.shard(shard).changes, "-", "+", count=count)
        return [(str(eid), str(f.get(Field.STATE, "")), str(f.get("ids", "")).split("\n")) for eid, f in entries]

    def trim(self, shard: int, upto: str) -> None:
        """Drop the entries of a shard's change log up to and including ``upto`` (applied)."""
        ms, _, seq = upto.partition("-")
        self.redis.client.xtrim(self.keys.shard(shard).changes, minid=f"{ms}-{int(seq or 0) + 1}")

    def lag(self, shard: int) -> tuple[int, int | None]:
        """(entries not yet applied, epoch ms of the oldest) of a shard's change log."""
        key = self.keys.shard(shard).changes
        pipe = self.redis.client.pipeline(transaction=False)
        pipe.xlen(key)
        pipe.xrange(key, "-", "+", count=1)
        n, first = pipe.execute()
        return int(n), (int(str(first[0][0]).split("-")[0]) if first else None)

