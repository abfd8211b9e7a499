"""The shard layout: how many shards hold jobs, read from the store and followed through a reshard.

The store records its ``shards`` and ``bucket_ms`` when it is first used
(and, with a database, the ``store_id`` the database is bound to:
:mod:`celery_delayed.sql.binding`);
every producer, scheduler and worker of one store must agree with it
(:meth:`ShardLayout.check`), and follows a reshard without a restart
(:meth:`ShardLayout.reload`). It also decides the release path (direct or
publish) this store's scheduler takes.
"""

from __future__ import annotations

import time

import redis
from redis.exceptions import ResponseError

from ..errors import ConfigurationError
from ..redis_urls import broker_url, is_sentinel_url, redact, same_redis
from ..vocab import Field
from .client import translate_errors
from .keys import shard_for
from .records import NewJob
from .runner import Runner


@translate_errors
class ShardLayout:
    """The store's shard count (as recorded in Redis, followed through a reshard) and release path."""

    def __init__(self, redis_: Runner) -> None:
        self.redis = redis_
        self.config = redis_.config
        self.keys = redis_.keys
        self.broker = redis_.broker
        self.url = redis_.url
        self._checked = False
        #: The layout's shard count (``delayed_shards`` until the layout is read; a reshard changes it live).
        self._shards = self.config.shards
        #: The count a reshard in progress moves from (None: no reshard is moving jobs).
        self._moving_from: int | None = None
        self._read_at = 0.0

    @property
    def release_path(self) -> tuple[str, str]:
        """("direct" or "publish", why): the release path this store's scheduler takes (``delayed status``)."""
        mode = self.config.release_mode
        if self.redis.cluster:
            found = " (found by delayed_redis_cluster \"auto\")" if self.config.redis_cluster == "auto" else ""
            return "publish", f"the store is a Redis Cluster{found}: kombu cannot read queues from one"
        if self.broker.direct:
            return "direct", ("the broker is Redis on the store's server" if mode == "auto"
                              else "delayed_release_mode = 'direct'")
        return "publish", ("the broker is not the store's Redis" if mode == "auto"
                           else "delayed_release_mode = 'publish'")


    def check(self) -> None:
        """Refuse a store created with other ``delayed_shards`` or ``delayed_bucket_ms``.

        Both decide which keys hold a job: a producer and a scheduler that
        disagree would leave jobs where no scheduler looks. The first user of a
        prefix records them; later ones must match (``delayed reshard`` is the
        way to change the shard count). Checked once per Store; after that the
        store follows the layout as a reshard changes it (:meth:`reload`).

        Raises:
            ConfigurationError: the settings differ from the store's.
            StoreUnavailable: Redis cannot be reached.
        """
        if self._checked:
            return
        want = {"shards": str(self.config.shards), "bucket_ms": str(self.config.bucket_ms)}
        got: list[str | None] = self.redis.client.hmget(  # type: ignore[assignment]
            self.keys.layout, [*want, "from"])
        # (a read first: it works on a full Redis too)
        if None in got[:2]:  # the first user of this prefix records the layout
            pipe = self.redis.client.pipeline(transaction=False)
            for name, value in want.items():
                pipe.hsetnx(self.keys.layout, name, value)
            pipe.hmget(self.keys.layout, [*want, "from"])
            got = pipe.execute()[-1]
        for (name, value), held in zip(want.items(), got, strict=False):
            if held != value:
                moving = f" (a reshard from {got[2]} shards is in progress)" if got[2] else ""
                fix = (f"set delayed_shards = {held}, the store's count; `celery -A proj delayed reshard --shards N` "
                       "changes it" if name == "shards" else "use another delayed_key_prefix to change it")
                raise ConfigurationError(
                    f"delayed_{name} is {value}, but the store under prefix {self.config.key_prefix!r} "
                    f"has {held}{moving}: every producer and scheduler of one store must use the "
                    f"same delayed_shards and delayed_bucket_ms ({fix})"
                )
        self._moving_from = int(got[2]) if got[2] else None
        self._read_at = time.monotonic()
        self._check_direct()
        self._checked = True

    @property
    def shards(self) -> int:
        """The number of shards new jobs are spread over: the store's layout (``delayed_shards`` at creation)."""
        return self._shards

    @property
    def moving_from(self) -> int | None:
        """The shard count a reshard in progress moves jobs from (None: no reshard in progress)."""
        return self._moving_from

    @property
    def span(self) -> int:
        """How many shards may hold jobs: :attr:`shards`, or more while a reshard moves jobs out of the others."""
        return max(self._shards, self._moving_from or 0)

    def shard_range(self) -> range:
        """Every shard that may hold jobs (``range(span)``): what a scan of the whole store visits.

        The layout is read first if this store has not read it yet (a reshard may have changed the count).
        """
        if not self._read_at:
            self.reload()
        return range(self.span)

    def reload(self, max_age_s: float = 0.0) -> bool:
        """Read the layout again (at most every ``max_age_s``) and follow it; return True when it changed.

        A running producer, scheduler or worker follows a reshard without a
        restart: the scripts refuse a write made with the old count, the
        schedulers re-read the layout when told and every few heartbeats.
        """
        if max_age_s and time.monotonic() - self._read_at < max_age_s:
            return False
        got: list[str | None] = self.redis.client.hmget(self.keys.layout, ["shards", "from"])  # type: ignore[assignment]
        self._read_at = time.monotonic()
        if got[0] is None:
            return False
        before = (self._shards, self._moving_from)
        self._shards, self._moving_from = int(got[0]), (int(got[1]) if got[1] else None)
        return (self._shards, self._moving_from) != before

    def valid_shard(self, shard: int | None) -> bool:
        """Whether ``shard`` (a message's ``delayed_shard`` header) is a shard of this store.

        A shard beyond the span this process knows makes it read the layout
        again, at once: the first messages released from the new shards of a
        reshard name them, and a worker that read the layout a moment before
        the switch (or whose other thread is reading it right now) must take
        them. Refused, the worker would guess the shard from the job's id,
        miss a shard-key job's record and skip it as moved (it stayed QUEUED,
        never run). The answer is the span as it is after the read, whoever's
        read saw the change.
        """
        if shard is None or shard < 0:
            return False
        if shard < self.span:
            return True
        self.reload()
        return shard < self.span

    def _check_direct(self) -> None:
        """Refuse a forced direct path whose broker is not the store's server (and database).

        The release script pushes onto the store server's lists: with the
        broker elsewhere no worker would ever read them. ``auto`` decides by
        the URLs; a forced ``"direct"`` (the same server under another URL,
        e.g. a unix socket) is checked by asking both for their run id.
        """
        if self.config.release_mode != "direct":
            return
        broker = broker_url(self.redis.app.conf)
        if is_sentinel_url(broker):  # the same Sentinels, database and master name, or refused
            theirs = (self.redis.app.conf.broker_transport_options or {}).get("master_name")
            same = same_redis(broker, self.url) and theirs == self.config.redis_options.get("master_name")
            why = "" if same else "another Sentinel master (other Sentinels, database or master_name)"
        elif not broker or same_redis(broker, self.url):
            return
        else:
            why = self._other_server(broker)
        if why:
            raise ConfigurationError(
                f"delayed_release_mode is 'direct', but the broker {redact(broker)!r} is {why} than "
                f"the store's: the release script pushes onto the store server's lists, which no worker of this "
                "broker reads. Use delayed_release_mode 'auto' or 'publish'")

    def _other_server(self, broker: str) -> str:
        """Why the Redis broker at ``broker`` is not the store's server and database ('' when it is)."""
        try:
            other = redis.Redis.from_url(broker, socket_connect_timeout=2, socket_timeout=5)
            try:
                theirs = other.info("server").get("run_id"), other.connection_pool.connection_kwargs.get("db", 0)
            finally:
                other.close()
            client = self.redis.client
            ours = client.info("server").get("run_id"), client.connection_pool.connection_kwargs.get("db", 0)
            return "" if theirs == ours else "a different Redis server or database"
        except (ResponseError, ValueError) as exc:
            return f"not a Redis server this store can verify ({exc})"

    def identity(self) -> str | None:
        """The store's id: a random id written once into its layout record (with a database, which is
        bound to it); None when it has none (a store never bound to a database, or one that lost its data)."""
        got: str | None = self.redis.client.hget(self.keys.layout, "store_id")  # type: ignore[assignment]
        return got

    def claim_identity(self, store_id: str) -> str:
        """Make ``store_id`` the store's id unless it has one already; return the id it has."""
        pipe = self.redis.client.pipeline(transaction=False)
        pipe.hsetnx(self.keys.layout, "store_id", store_id)
        pipe.hget(self.keys.layout, "store_id")
        got: str = pipe.execute()[-1]
        return got

    def recorded(self) -> dict[str, str]:
        """The ``shards`` and ``bucket_ms`` recorded when the store was created (empty: none yet); reads only."""
        return {str(k): str(v) for k, v in self.redis.client.hgetall(self.keys.layout).items()}

    def shard_of(self, job_id: str, shard_key: str | None = None) -> int:
        """The shard a job lives in: ``crc32(shard_key or job_id) % shards`` (the layout's count)."""
        return shard_for(shard_key or job_id, self._shards)

    def home(self, job: NewJob) -> int:
        """The shard ``job`` belongs in under the layout's count (by its shard key, else its id)."""
        return shard_for(job.fields.get(Field.SHARD_KEY) or job.id, self._shards)
