"""The store's Redis clients and the one place Redis errors become celery-delayed errors.

Every public method of the store layer's classes is wrapped by
:func:`translate_errors` (a class decorator), so a caller sees
:class:`~celery_delayed.errors.StoreUnavailable` (Redis unreachable, loading
or read-only after a failover) or :class:`~celery_delayed.errors.StoreFull`
(``maxmemory`` reached) on reads and writes alike, never a raw redis-py error.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from ..errors import ConfigurationError, DelayedError, StoreFull, StoreUnavailable
from ..redis_urls import is_sentinel_url, redact, sentinel_hosts
from .packer import direct_packer

logger = logging.getLogger("celery_delayed.store")

#: redis-py errors that mean "the store cannot be used right now" (on a cluster: still so after
#: redis-py's own retries, which follow MOVED/ASK and a failover to a replica).
UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ReadOnlyError,
               ClusterDownError, SlotNotCoveredError, TryAgainError, ClusterError)


def translate(exc: Exception, url: str) -> DelayedError | None:
    """The celery-delayed error for a redis-py error, or None when it is not one we translate."""
    if isinstance(exc, OutOfMemoryError):
        return StoreFull(
            f"the celery-delayed store at {redact(url)} is full (Redis maxmemory reached): nothing was "
            f"written ({exc}). Release or purge jobs (`delayed status`, `delayed dlq purge`), raise "
            "maxmemory, or move the store to a larger Redis; keep maxmemory-policy noeviction"
        )
    if isinstance(exc, MasterNotFoundError):  # redis-py's message lists every Sentinel client: say it short
        why = sorted(set(re.findall(r" - [^ ]+?:(\w+)", str(exc))))
        return StoreUnavailable(
            f"cannot reach the celery-delayed store at {redact(url)}: no Sentinel named its master "
            f"({', '.join(why) or str(exc).split(':')[0]}); nothing was written. Check that the Sentinels run "
            "and monitor delayed_redis_options['master_name'], and their password (delayed_redis_options"
            "['sentinel_kwargs'])"
        )
    if not_executed(exc):
        return StoreUnavailable(
            f"the celery-delayed store's Redis Cluster at {redact(url)} kept refusing the command while a slot "
            f"of it migrates (TRYAGAIN or redirections; redis-py: {exc}); nothing was written. Call again once "
            "the resharding has moved the slot (calling again with the same task_id is safe)")
    if isinstance(exc, UNAVAILABLE):
        # Refused or timed out while connecting: the command never left. Lost while
        # reading the reply: it may have run (a frozen server wakes up and runs it).
        sent = "connecting" not in str(exc).lower() and not isinstance(
            exc, (BusyLoadingError, ReadOnlyError, ClusterDownError, SlotNotCoveredError, TryAgainError))
        outcome = (
            "the command may have reached Redis, so it may or may not have been written; calling "
            "again with the same task_id (DuplicateJob: it was) or idempotency_key is safe"
            if sent else "nothing was written"
        )
        return StoreUnavailable(
            f"cannot reach the celery-delayed store at {redact(url)}: {exc}; {outcome}. "
            "Check that Redis is running and delayed_redis_url (or broker_url) points at it"
        )
    return None


C = TypeVar("C", bound=type)


def translate_errors(cls: C) -> C:
    """Class decorator: every public method raises celery-delayed errors instead of redis-py's.

    The instance must have a ``url`` attribute (the store's URL, for the
    message). A method that already raises a celery-delayed error is left
    alone, so store methods may call each other.
    """
    for name, fn in list(vars(cls).items()):
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        setattr(cls, name, _wrap(fn))
    return cls


def translated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Method decorator: :func:`translate_errors` for one method (of an object with a ``url``)."""
    return _wrap(fn)


def _wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except (*UNAVAILABLE, OutOfMemoryError) as exc:
            err = translate(exc, self.url)
            if err is None:  # pragma: no cover - every caught type translates
                raise
            raise err from exc
        except RedisClusterException as exc:
            if not is_unreachable(exc):
                raise
            raise StoreUnavailable(f"cannot reach the celery-delayed store (Redis Cluster at "
                                   f"{redact(self.url)}): {exc}") from exc

    return wrapper


def is_unreachable(exc: RedisClusterException) -> bool:
    """True when redis-py's cluster client gave up finding a reachable node (not a usage error)."""
    return "cannot be connected" in str(exc) or "reachable" in str(exc)


def is_cluster(client: Any) -> bool:
    """True for redis-py's Redis Cluster client."""
    return isinstance(client, RedisCluster)


#: How long a command that a slot migration refused is tried again before it fails, seconds
#: (scheduler threads: :data:`MIGRATION_PATIENCE_FAST_S`; they back off themselves).
MIGRATION_PATIENCE_S = 5.0
MIGRATION_PATIENCE_FAST_S = 2.0

T = TypeVar("T")


def not_executed(exc: BaseException) -> bool:
    """True for a cluster error that says the command did not run, so running it again is safe.

    ``TRYAGAIN`` (a multi-key command, such as a script, whose keys are partly
    on each side of a slot migration), or redis-py's "TTL exhausted" (every
    try was redirected or refused: MOVED, ASK, TRYAGAIN).
    """
    return isinstance(exc, TryAgainError) or (isinstance(exc, ClusterError) and "TTL exhausted" in str(exc))


def retry_unexecuted(call: Callable[[], T], patience_s: float, on_retry: Callable[[], None] | None = None) -> T:
    """``call()``, tried again with back-off while it fails with :func:`not_executed`, for up to ``patience_s``.

    ``on_retry()`` runs before each new try.
    """
    deadline: float | None = None
    delay = 0.05
    while True:
        try:
            return call()
        except (TryAgainError, ClusterError) as exc:
            now = time.monotonic()
            deadline = now + patience_s if deadline is None else deadline
            if not not_executed(exc) or now >= deadline:
                raise
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 0.5)
            if on_retry is not None:
                on_retry()


class StoreCluster(RedisCluster):
    """redis-py's cluster client, patient with a slot migration.

    redis-py follows MOVED and ASK, but tries a command that gets ``TRYAGAIN``
    only for about 0.4 s before it raises "TTL exhausted". While a slot
    migrates (``CLUSTER SETSLOT ... MIGRATING`` until ``... NODE``), Redis
    answers ``TRYAGAIN`` to every script of that slot that names keys it holds
    and keys it does not: a script names keys that do not exist yet (a new
    job's record, a change log), so that is most of them, for as long as the
    migration of the slot lasts. Such a command did not run: it is tried
    again here, with back-off, for up to ``patience_s`` seconds (redis-py's
    pipelines bypass this: the gateway retries their refused calls itself).
    """

    patience_s: float = MIGRATION_PATIENCE_S
    #: Commands tried again so far because a migration refused them (approximate under threads).
    migration_retries: int = 0

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        """Run a command (see the class docstring for what is tried again)."""
        run = super().execute_command
        return retry_unexecuted(lambda: run(*args, **kwargs), self.patience_s,  # type: ignore[no-untyped-call]
                                self._count_retry)

    def _count_retry(self) -> None:
        self.migration_retries += 1


def detect_cluster(client: redis.Redis, url: str) -> bool:
    """Whether the server ``client`` reaches is a node of a Redis Cluster (``delayed_redis_cluster = "auto"``).

    One ``INFO cluster`` (``cluster_enabled:1``), on a connection the client
    keeps. A server that refuses INFO (an ACL user without it) is asked
    ``CLUSTER SLOTS`` instead, which the cluster client needs anyway: "cluster
    support disabled" means a single server. When both are refused the store
    is used as a single server, and a warning says how to decide it.

    Raises:
        ConfigurationError: the URL names a database other than 0 and the
            server is a cluster node (which has database 0 only).
        redis.exceptions.ConnectionError: the server cannot be reached (the
            caller decides again on its next use).
    """
    try:
        return str(client.info("cluster").get("cluster_enabled", "0")) == "1"
    except ResponseError as exc:
        if "not allowed in cluster mode" in str(exc):  # the connection's SELECT <db>: a cluster has db 0 only
            raise ConfigurationError(
                f"delayed_redis_url {redact(url)!r} names a database other than 0, but the server is a node of a "
                "Redis Cluster, which has database 0 only: use /0 or no database in the URL") from exc
        refused = exc
    try:
        client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
        return True
    except ResponseError as exc:
        if "cluster support disabled" in str(exc).lower():
            return False
        logger.warning(
            "celery-delayed: could not tell whether the store's Redis at %s is a node of a Redis Cluster "
            "(INFO: %s; CLUSTER SLOTS: %s): using it as a single server. Set delayed_redis_cluster = False "
            "to skip this check, or True for a cluster (its user needs CLUSTER SLOTS)", redact(url), refused, exc)
        return False


def make_client(
    url: str, *, options: Mapping[str, Any] | None = None, fail_fast: bool = False, health_check_interval: int = 30,
    cluster: bool = False,
) -> redis.Redis:
    """A redis-py client for the store at ``url`` (replies decoded as str).

    ``options`` (``delayed_redis_options``) go to the client's connections;
    with a ``sentinel://`` URL, ``master_name``, ``sentinel_kwargs`` and
    ``min_other_sentinels`` go to :class:`redis.sentinel.Sentinel` (see
    :func:`sentinel_client`).

    ``fail_fast`` is for scheduler threads: redis-py's default retries a
    failed command several times with growing back-off; a scheduler does its
    own back-off and must stay responsive to SIGTERM while Redis is down, so
    a command is retried once, quickly (to replace a connection that a Redis
    restart broke).

    ``cluster``: ``url`` names any node of a Redis Cluster; the client is
    redis-py's :class:`~redis.cluster.RedisCluster` (typed as ``redis.Redis``
    for the store, which calls only commands both have). It follows MOVED and
    ASK and, on a failover, reloads the slot map and retries; a command that
    a slot migration refuses (``TRYAGAIN``) is tried again for a few seconds
    (:class:`StoreCluster`).

    Raises:
        StoreUnavailable: on a cluster, no node of it could be reached (the
            cluster client reads the slot map when it is made).
    """
    if cluster:
        timeouts: dict[str, Any] = {"socket_connect_timeout": 2, "socket_timeout": 10} if fail_fast else {}
        try:
            client = cast(StoreCluster, StoreCluster.from_url(
                url, decode_responses=True, health_check_interval=health_check_interval,
                **{**dict(options or {}), **timeouts}))
            client.patience_s = MIGRATION_PATIENCE_FAST_S if fail_fast else MIGRATION_PATIENCE_S
            return cast(redis.Redis, client)
        except (RedisClusterException, RedisConnectionError, RedisTimeoutError) as exc:
            raise StoreUnavailable(
                f"cannot reach the celery-delayed store (Redis Cluster at {redact(url)}): {exc}; nothing was "
                "written. Check that the cluster is up and delayed_redis_url names one of its nodes") from exc
    kwargs: dict[str, Any] = {"decode_responses": True, "health_check_interval": health_check_interval}
    packer = None if options and "command_packer" in options else direct_packer(dict(options or {}))
    if packer is not None:
        kwargs["command_packer"] = packer
    if fail_fast:
        kwargs.update(socket_connect_timeout=2, socket_timeout=10,
                      retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1))
    if is_sentinel_url(url):
        return sentinel_client(url, dict(options or {}), kwargs)
    return redis.Redis.from_url(url, **{**dict(options or {}), **kwargs})


def close_client(client: redis.Redis) -> None:
    """Close a client made by :func:`make_client` (and its Sentinel connections, for a Sentinel URL)."""
    try:
        client.close()
    finally:
        manager = getattr(client.connection_pool, "sentinel_manager", None)
        if manager is not None:
            manager.close()


def sentinel_client(url: str, options: dict[str, Any], kwargs: dict[str, Any]) -> redis.Redis:
    """A client of the master that the Sentinels of ``url`` name ``options["master_name"]``.

    As kombu's ``SentinelChannel`` for the broker: the URL lists the
    Sentinels (``sentinel://[user:password@]host:port[/db];sentinel://...``);
    the first part's credentials and database are the master's; the
    Sentinels' own (``password``, ``ssl`` ...) go in ``sentinel_kwargs``.
    Every connection of the client's pool (the per-thread lanes and pub/sub
    subscriptions included) asks the Sentinels for the master when it
    connects, and drops itself when the server it reaches answers READONLY
    (a demoted master): after a failover, the next command goes to the
    promoted replica, without a restart.
    """
    first = urlsplit(url.split(";")[0].strip())
    db = (first.path or "/0").lstrip("/") or "0"
    conn: dict[str, Any] = {**options, **kwargs, "db": int(db) if db.isdigit() else 0}
    master_name = conn.pop("master_name")
    sentinel_kwargs = conn.pop("sentinel_kwargs", None)
    min_other = int(conn.pop("min_other_sentinels", 0))
    if first.username:
        conn.setdefault("username", first.username)
    if first.password:
        conn.setdefault("password", first.password)
    # One try per Sentinel and per discovery: the client asks the next Sentinel itself, and the
    # command's own retries ask them all again (redis-py's default of 3 retries with back-off
    # per Sentinel made one failed discovery take about 25 s with three Sentinels).
    ask = {"socket_connect_timeout": 2, "socket_timeout": 5, "retry": Retry(NoBackoff(), 0)}
    sentinels = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        sentinel_hosts(url), min_other_sentinels=min_other, sentinel_kwargs={**ask, **(sentinel_kwargs or {})},
    )
    client: redis.Redis = sentinels.master_for(  # type: ignore[no-untyped-call, unused-ignore]
        master_name, redis_class=redis.Redis, **conn)
    return client
