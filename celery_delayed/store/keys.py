"""Key schema: the one place that formats Redis keys.

Every key of one shard carries the shard number as a Redis Cluster hash tag,
so a script that touches one shard touches one slot::

    {prefix}:{<s>}:due                 ZSET   job id -> due time (epoch ms)
    {prefix}:{<s>}:due:<bucket_ms>     ZSET   the same, one per time bucket
                                              (only when ``delayed_bucket_ms`` > 0)
    {prefix}:{<s>}:buckets             ZSET   bucket key -> bucket start (epoch ms)
    {prefix}:{<s>}:next                STRING earliest due time the scheduler knows of
    {prefix}:{<s>}:inflight            ZSET   job id -> claim deadline (publish path)
    {prefix}:{<s>}:lease               STRING "<owner>|<fence>" of the scheduler releasing it
    {prefix}:{<s>}:fence               STRING fencing counter, INCR on every hand-over
    {prefix}:{<s>}:job:<id>            HASH   the job record (see ``records.py``)
    {prefix}:{<s>}:tpl:<tid>           STRING a compact records' template, JSON (``compact.py``):
                                              expires after the latest due time of its
                                              jobs plus the record ttl
    {prefix}:{<s>}:dlq                 ZSET   dead job id -> time it died (epoch ms)
    {prefix}:{<s>}:released            ZSET   released, not started job id -> due time (or
                                              when it was last released again): the
                                              reconciler's candidates
    {prefix}:{<s>}:changes             STREAM state changes for the database mirror
                                              (only with delayed_database_url)
    {prefix}:{<s>}:stats               HASH   counters, gauges and lateness histograms (see
                                              ``lua/includes/ops.lua`` and ``stats.py``; eta_fallbacks:
                                              delayed sends interception sent to the broker); the sum
                                              over shards is the fleet's figure
    {prefix}:{<s>}:ix:<n>:<task>:<q>   ZSET   scheduled jobs of one task and queue: id -> due
                                              (<n>: the task name's length in UTF-8 bytes)
    {prefix}:{<s>}:ixs                 SET    the ``<n>:<task>:<q>`` parts of the shard's ix keys
    {prefix}:{<s>}:paused              HASH   pause flags ("all", "task:<name>", "queue:<name>")
                                              -> since (epoch ms)
    {prefix}:{<s>}:held                ZSET   due jobs a pause holds back: id -> due
    {prefix}:{<s>}:limits              HASH   rate limits set at run time: key -> jobs per second
                                              (0: the app's limit lifted); the same on every shard
    {prefix}:{<s>}:tokens              HASH   the shard's token bucket per limit: key -> "<tokens>:<at ms>"
    {prefix}:{<s>}:lim:<key>           ZSET   due jobs waiting for a token of that limit: id -> due
    {prefix}:{<s>}:lims                SET    the limit keys whose wait set is not empty
    {prefix}:{<s>}:tq:<tenant>         ZSET   a tenant's jobs in the due index: id -> due
    {prefix}:{<s>}:tns                 ZSET   tenants with jobs in the due index -> earliest due
    {prefix}:{<s>}:debounce:<key>      HASH   id, first: the job of a debounce key and when the
                                              key's first call came (``schedule_keyed.lua``)
    {prefix}:{<s>}:throttle:<key>      HASH   id, first: the job of a throttle key; expires
                                              with its window
    {prefix}:{<s>}:scheds              SET    names of the recurring schedules of this shard
                                              (a schedule's shard: crc32(name) % shards)
    {prefix}:{<s>}:sched:<name>        HASH   a recurring schedule (``vocab.ScheduleField``)
    {prefix}:{<s>}:occ:<name>          ZSET   its recent occurrences: job id -> fire time (ms)
    {prefix}:{<s>}:sealed              STRING a shard count writes may no longer place jobs with
                                              (set by ``delayed reshard``; ``placed`` in lua/includes/common.lua)
    {prefix}:{<s>}:moving              SET    ids ``delayed reshard`` took out of the shard and has not
                                              finished moving (``store/reshard.py``)

(the scripts derive stats, ix, ixs, paused and held from the shard's base, ``{prefix}:{<s>}:``,
of a key they are given: ``lua/includes/ops.lua``)

and, outside any shard::

    {prefix}:schedulers                ZSET   scheduler owner token -> membership deadline
    {prefix}:{{prefix}:schedulers}:settings
                                       HASH   scheduler owner token -> the settings every
                                              scheduler must share ("lease_ms=30000")
    {prefix}:layout                    HASH   shards, bucket_ms: recorded when the store is created;
                                              shards changes only by ``delayed reshard`` (and
                                              ``from``, the old count, while it moves jobs);
                                              store_id: the random id a database's rows are
                                              bound to (``sql/binding.py``)
    {prefix}:schedules                 SET    names of every recurring schedule (the schedulers
                                              read it every few seconds instead of each shard's)
    {prefix}:wake                      PUBSUB "<shard>:<due_ms>" when a job is due earlier
                                              than the scheduler knew; "members|<owner>"
                                              when a scheduler joins or leaves
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass


def shard_for(key: str, shards: int) -> int:
    """Return the shard of a job: ``crc32(key) % shards``.

    ``key`` is the job's ``shard_key`` when it has one, else its id. crc32 is
    stable across processes and Python versions (unlike ``hash()``).
    """
    return zlib.crc32(key.encode("utf-8")) % shards


@dataclass(frozen=True)
class Keys:
    """Formats every key of one store (one ``delayed_key_prefix``)."""

    prefix: str

    def shard(self, shard: int) -> ShardKeys:
        """Return the keys of shard ``shard``."""
        return ShardKeys(f"{self.prefix}:{{{shard}}}")

    @property
    def schedulers(self) -> str:
        """Membership of the running schedulers."""
        return f"{self.prefix}:schedulers"

    @property
    def scheduler_settings(self) -> str:
        """The settings of each running scheduler (checked by a new one before it joins).

        Its hash tag is the whole name of :attr:`schedulers`, so both are in one
        Redis Cluster slot (``heartbeat.lua`` writes them together); it starts
        with the prefix, so an ACL key pattern ``~<prefix>:*`` covers it.
        """
        return f"{self.prefix}:{{{self.prefix}:schedulers}}:settings"

    @property
    def layout(self) -> str:
        """HASH ``shards`` and ``bucket_ms`` the store was created with."""
        return f"{self.prefix}:layout"

    @property
    def schedules(self) -> str:
        """Names of every recurring schedule (an index outside the shards, kept beside each shard's own set)."""
        return f"{self.prefix}:schedules"

    @property
    def wake(self) -> str:
        """Pub/sub channel that wakes sleeping schedulers."""
        return f"{self.prefix}:wake"


@dataclass(frozen=True)
class ShardKeys:
    """The keys of one shard; ``base`` is ``{prefix}:{<s>}``."""

    base: str

    @property
    def due(self) -> str:
        return f"{self.base}:due"

    @property
    def buckets(self) -> str:
        return f"{self.base}:buckets"

    @property
    def next(self) -> str:
        return f"{self.base}:next"

    @property
    def inflight(self) -> str:
        return f"{self.base}:inflight"

    @property
    def lease(self) -> str:
        return f"{self.base}:lease"

    @property
    def fence(self) -> str:
        return f"{self.base}:fence"

    @property
    def lease_until(self) -> str:
        """The lease deadline earlier versions of ``shard_lease.lua`` kept (no longer read or written)."""
        return f"{self.base}:lease_until"

    @property
    def dlq(self) -> str:
        return f"{self.base}:dlq"

    @property
    def released(self) -> str:
        return f"{self.base}:released"

    @property
    def moving(self) -> str:
        return f"{self.base}:moving"

    @property
    def changes(self) -> str:
        return f"{self.base}:changes"

    @property
    def stats(self) -> str:
        return f"{self.base}:stats"

    @property
    def job_prefix(self) -> str:
        return f"{self.base}:job:"

    def job(self, job_id: str) -> str:
        return f"{self.base}:job:{job_id}"

    def template(self, tid: str) -> str:
        """A compact records' template (``store/compact.py``)."""
        return f"{self.base}:tpl:{tid}"

    @property
    def paused(self) -> str:
        return f"{self.base}:paused"

    @property
    def held(self) -> str:
        return f"{self.base}:held"

    @property
    def limits(self) -> str:
        """Rate limits set at run time (``lua/includes/shaping.lua``)."""
        return f"{self.base}:limits"

    @property
    def tokens(self) -> str:
        return f"{self.base}:tokens"

    @property
    def limit_waits(self) -> str:
        """The limit keys that hold jobs back on this shard."""
        return f"{self.base}:lims"

    def limit_wait(self, key: str) -> str:
        """Due jobs waiting for a token of limit ``key``."""
        return f"{self.base}:lim:{key}"

    @property
    def tenants(self) -> str:
        """Tenants with jobs in the due index -> their earliest due."""
        return f"{self.base}:tns"

    def tenant_lane(self, tenant: str) -> str:
        """A tenant's jobs in the due index."""
        return f"{self.base}:tq:{tenant}"

    @property
    def index_parts(self) -> str:
        return f"{self.base}:ixs"

    @property
    def schedules(self) -> str:
        """The names of the shard's recurring schedules."""
        return f"{self.base}:scheds"

    def schedule(self, name: str) -> str:
        """A recurring schedule's hash."""
        return f"{self.base}:sched:{name}"

    def occurrences(self, name: str) -> str:
        """A recurring schedule's recent occurrences (job id -> fire time)."""
        return f"{self.base}:occ:{name}"

    def index(self, part: str) -> str:
        """The pending index of one ``index_part(task, queue)``."""
        return f"{self.base}:ix:{part}"

    def keyed(self, mode: str, key: str) -> str:
        """The entry of a debounce or throttle key (``mode``: "debounce" or "throttle")."""
        return f"{self.base}:{mode}:{key}"


def index_part(task: str, queue: str) -> str:
    """``<n>:<task>:<queue>``, n the task name's length in UTF-8 bytes (as ``lua/includes/ops.lua`` forms it)."""
    return f"{len(task.encode('utf-8'))}:{task}:{queue}"


def parse_index_part(part: str) -> tuple[str, str]:
    """(task, queue) of an index part (the inverse of :func:`index_part`)."""
    n, _, rest = part.partition(":")
    raw = rest.encode("utf-8")
    size = int(n)
    return raw[:size].decode("utf-8"), raw[size + 1:].decode("utf-8")
