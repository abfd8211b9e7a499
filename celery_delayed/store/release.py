"""The scheduler's side: releasing due jobs into their queues, and what the reconciler sends again.

Direct path: :meth:`Releases.release_due` pushes due jobs onto their kombu
queues in the script. Publish path: :meth:`Releases.claim_due` leases them,
the scheduler publishes, then :meth:`Releases.ack_claimed` (or
:meth:`Releases.refuse_claimed`). :meth:`Releases.rerelease` sends again a
released job whose message the broker lost.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import LeaseLost
from ..vocab import Reply
from .facet import Facet
from .records import Batch

_REFUSED_DELAY_MS = 1000


def _triples(reply: Sequence[Any], start: int) -> list[tuple[str, str, str]]:
    """The (id, state, reason) entries at the end of a release reply."""
    return [(str(reply[i]), str(reply[i + 1]), str(reply[i + 2])) for i in range(start, len(reply), 3)]


class Releases(Facet):
    """Release due jobs (direct or publish path), and find and send again the ones a broker lost."""

    SCRIPTS = ("release_due", "claim_due", "ack_claimed", "refuse_claimed", "rerelease")

    def release_due(
        self, shard: int, owner: str = "", fence: str = "", now_ms: int | None = None, limit: int | None = None,
        lookahead_ms: int = 0,
    ) -> Batch:
        """Direct path (``release_due.lua``): push up to ``limit`` due jobs of ``shard`` onto their queues.

        With ``lookahead_ms``, jobs due within that much of now go too, with
        Celery's ``eta`` set to their due time (the scheduler passes
        ``delayed_lookahead_ms``), except a debounce key's job: it goes when it
        is due (``Batch.hold_ms`` says when the earliest one left is).

        Raises:
            LeaseLost: ``owner`` does not hold the shard's lease with ``fence``.
        """
        self.layout.check()
        shard_keys = self.keys.shard(shard)
        cfg, broker = self.config, self.broker
        reply = self.redis.run(
            self.redis.scripts.release_due, [shard_keys.due, shard_keys.buckets, shard_keys.next, shard_keys.lease,
                                             shard_keys.dlq, shard_keys.released, shard_keys.changes],
            [self.redis.now_arg(now_ms), shard_keys.job_prefix, limit or cfg.batch_size, cfg.bucket_ms, owner, fence,
             cfg.record_ttl_ms, broker.global_keyprefix, broker.deadletter_queue, cfg.dlq_max_age_s * 1000,
             cfg.dlq_max_len_per_shard, self.redis.logs_changes, lookahead_ms, *self._limits()],
        )
        batch = self._batch(reply, shard)
        end = 7 + 2 * batch.count
        for i in range(7, end, 2):
            batch.ids.append(reply[i])
            batch.events.append(json.loads(reply[i + 1]) if reply[i + 1] else None)
        batch.not_sent = _triples(reply, end)
        return batch

    def claim_due(
        self, shard: int, owner: str = "", fence: str = "", now_ms: int | None = None, limit: int | None = None,
        lookahead_ms: int = 0,
    ) -> Batch:
        """Publish path (``claim_due.lua``): lease up to ``limit`` due (or stale in-flight) jobs of ``shard``.

        ``lookahead_ms`` as in :meth:`release_due`.

        Raises:
            LeaseLost: ``owner`` does not hold the shard's lease with ``fence``.
        """
        self.layout.check()
        shard_keys = self.keys.shard(shard)
        cfg = self.config
        reply = self.redis.run(
            self.redis.scripts.claim_due, [shard_keys.due, shard_keys.buckets, shard_keys.next, shard_keys.lease,
                                           shard_keys.inflight, shard_keys.dlq, shard_keys.changes],
            [self.redis.now_arg(now_ms), shard_keys.job_prefix, limit or cfg.batch_size, cfg.bucket_ms, owner, fence,
             cfg.claim_lease_ms, cfg.record_ttl_ms, cfg.dlq_max_age_s * 1000, cfg.dlq_max_len_per_shard,
             self.redis.logs_changes, lookahead_ms, *self._limits()],
        )
        batch = self._batch(reply, shard)
        end = 7 + 6 * batch.count
        for i in range(7, end, 6):
            jid, msg, ex, rk, q, ev = reply[i:i + 6]
            batch.ids.append(jid)
            batch.messages.append((msg, ex, rk, q))
            batch.events.append(json.loads(ev) if ev else None)
        batch.not_sent = _triples(reply, end)
        return batch

    def _limits(self) -> list[Any]:
        """The release scripts' rate-limit arguments: the shard count, then the app's limits
        (n, then key, jobs per second each); the ones set at run time the scripts read themselves."""
        limits = self.config.rate_limits
        return [self.layout.shards, len(limits), *(x for k, v in limits.items() for x in (k, repr(v)))]

    @staticmethod
    def _batch(reply: Sequence[Any], shard: int) -> Batch:
        if reply[0] == Reply.NOT_OWNER:
            raise LeaseLost(f"the lease of shard {shard} is held by another scheduler")
        nxt, hold = int(reply[3]), int(reply[5])
        return Batch(int(reply[1]), int(reply[2]), None if nxt < 0 else nxt, int(reply[4]),
                     hold_ms=None if hold < 0 else hold, tenants=bool(int(reply[6])))

    def ack_claimed(self, shard: int, ids: Iterable[str], now_ms: int | None = None) -> int:
        """Publish path (``ack_claimed.lua``): confirm published jobs; return how many were still in flight."""
        ids = list(ids)
        if not ids:
            return 0
        shard_keys = self.keys.shard(shard)
        return int(self.redis.run(
            self.redis.scripts.ack_claimed, [shard_keys.inflight, shard_keys.released, shard_keys.changes],
            [self.redis.now_arg(now_ms), shard_keys.job_prefix, self.config.record_ttl_ms, self.redis.logs_changes,
             *ids],
        ))

    def refuse_claimed(
        self, shard: int, refused: Sequence[tuple[str, str, bool]], now_ms: int | None = None,
    ) -> list[tuple[str, str, int]]:
        """Publish path (``refuse_claimed.lua``): put back claimed jobs the broker refused.

        ``refused``: (job id, the broker's reason, whether the refusal counts
        toward ``delayed_publish_max_refusals``: True when the broker can never
        take the message, False for a nack). Returns (id, state, counted
        refusals) per job: SCHEDULED (put back, a little later each time) or
        DEAD; another state when it was no longer in flight (left alone).
        """
        if not refused:
            return []
        cfg = self.config
        shard_keys = self.keys.shard(shard)
        reply = self.redis.run(
            self.redis.scripts.refuse_claimed, [shard_keys.due, shard_keys.buckets, shard_keys.next,
                                                shard_keys.inflight, shard_keys.dlq, shard_keys.changes],
            [self.redis.now_arg(now_ms), shard_keys.job_prefix, cfg.bucket_ms, self.keys.wake, shard,
             cfg.publish_max_refusals,
             _REFUSED_DELAY_MS, cfg.claim_lease_ms, cfg.dlq_max_age_s * 1000, cfg.dlq_max_len_per_shard,
             self.redis.logs_changes,
             *(x for job_id, why, counts in refused for x in (job_id, why, "1" if counts else ""))],
        )
        return [(str(reply[i]), str(reply[i + 1]), int(reply[i + 2])) for i in range(1, len(reply), 3)]

    def any_released(self) -> bool:
        """True when some shard has a released job not started yet (one ``EXISTS`` over every shard's set).

        The reconciler's pass reads no shard when none has (an idle fleet);
        on Redis Cluster the client splits the command by slot.
        """
        return bool(self.redis.client.exists(*(self.keys.shard(s).released for s in self.layout.shard_range())))

    def release_candidates(self, shard: int, older_than_ms: int, after: float = 0.0,
                           limit: int = 1000) -> list[tuple[str, float]]:
        """Released jobs not started, due (or last released again) at or before ``older_than_ms``: (id, score).

        Scores greater than ``after`` only, lowest first (a page).
        """
        rows: list[tuple[str, float]] = self.redis.client.zrangebyscore(  # type: ignore[assignment]
            self.keys.shard(shard).released, f"({after}" if after else "-inf", older_than_ms, start=0, num=limit,
            withscores=True)
        return [(str(j), float(sc)) for j, sc in rows]

    def rerelease(self, shard: int, ids: Sequence[str], max_copies: int,
                  now_ms: int | None = None) -> list[tuple[str, str]]:
        """Send again the jobs whose message the broker lost (``rerelease.lua``): (id, outcome) per job.

        Outcomes: 'rereleased', 'held', 'waiting', 'exhausted', 'gone' (see the script).
        """
        if not ids:
            return []
        shard_keys = self.keys.shard(shard)
        b = self.broker
        keys = [shard_keys.released, shard_keys.due, shard_keys.buckets, shard_keys.next, shard_keys.changes]
        if b.direct:
            keys += [b.unacked_hash, b.unacked_index]
        reply = self.redis.run(
            self.redis.scripts.rerelease, keys,
            [self.redis.now_arg(now_ms), shard_keys.job_prefix, "direct" if b.direct else "publish", max_copies,
             b.global_keyprefix, b.deadletter_queue, self.config.key_prefix, self.config.bucket_ms, self.keys.wake,
             shard, self.redis.logs_changes, int(self.config.requeue_after_s * 1000), *ids],
        )
        return [(str(reply[i]), str(reply[i + 1])) for i in range(1, len(reply), 2)]
