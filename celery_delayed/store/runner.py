"""The runner: the store's only transport to Redis (imported by nothing outside the store layer).

It owns the redis-py client (made on first use, fork-safe; a cluster client
when the server is a Redis Cluster node), each thread's own connection
(:mod:`.lane`), and the ways a script is run: one call (:meth:`Runner.run`),
a call the caller is told about, with ``WAIT`` for replicas
(:meth:`Runner.run_acked`), and many calls in one round trip, in one
``MULTI``/``EXEC`` when asked, with a connection of its own for a call that
keeps Redis busy past the read timeout (:meth:`Runner.run_many`). The facets
(:mod:`.jobs`, :mod:`.lookup`, :mod:`.release`, ...) build each script's keys
and arguments and read its reply; the runner only carries them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import redis
from celery import Celery
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    OutOfMemoryError,
    ResponseError,
    TryAgainError,
)

from ..config import DelayedConfig
from ..errors import ConfigurationError, ReplicationTimeout, StoreUnavailable
from ..redis_urls import broker_url, is_sentinel_url, redact
from .broker_layout import BrokerLayout
from .client import (
    MIGRATION_PATIENCE_FAST_S,
    MIGRATION_PATIENCE_S,
    UNAVAILABLE,
    close_client,
    detect_cluster,
    is_cluster,
    make_client,
    not_executed,
    translate,
    translated,
)
from .keys import Keys, ShardKeys
from .lane import ClusterLane, Lane, Lanes
from .loader import Arg, Script, Scripts, scripts

#: A call that stores this many jobs or more may keep Redis busy longer than the client's read timeout:
#: its reply is read on a connection of its own, whose timeout grows with the jobs (see Runner._patient_connection).
LONG_CALL_JOBS = 10_000
#: The time a long call's reply is given per job, on top of the client's read timeout (Redis takes
#: ~10-30 µs a job: 100,000 jobs in one MULTI/EXEC held it 2 s).
LONG_CALL_S_PER_JOB = 100e-6


Call = tuple[Sequence[str], Sequence[Arg]]


class Runner:
    """The Redis transport of one store: its client, its threads' connections, and how scripts run.

    Its calls raise redis-py's errors: the facets translate them at their
    boundary (a facet decides, e.g., which jobs a refused batch had written).

    Args:
        app: the Celery app (its broker settings decide what a Redis Cluster refuses).
        config: the store's config.
        keys: the store's key schema.
        broker: the broker's layout (the direct path cannot run on a Redis Cluster).
        fail_fast: a client that retries a failed command once, quickly (for
            scheduler threads, which back off themselves).
        client: a redis-py client to use instead of making one.
    """

    def __init__(
        self, app: Celery, config: DelayedConfig, keys: Keys, broker: BrokerLayout, *, fail_fast: bool = False,
        client: redis.Redis | None = None,
    ) -> None:
        self.app = app
        self.config = config
        self.keys = keys
        self.broker = broker
        self.url = config.redis_url
        self._fail_fast = fail_fast
        self._client: redis.Redis | None = client
        self._lock, self._lock_pid = threading.Lock(), os.getpid()  # making the client
        #: Whether the store is a Redis Cluster; None until the server is asked (``"auto"``).
        self._cluster: bool | None = (
            is_cluster(client) if client is not None
            else config.redis_cluster if isinstance(config.redis_cluster, bool)
            else False if is_sentinel_url(self.url) else None)
        self._scripts: Scripts | None = None
        self._lanes: Lanes | None = None
        #: A test clock (epoch ms) that every script takes as its "now" instead of the Redis
        #: server's (``celery_delayed.testing``); None in production.
        self.clock: Callable[[], int] | None = None

    @property
    def scripts(self) -> Scripts:
        """The script table for this server: with Redis 7's script flags when it has them (asked once)."""
        if self._scripts is None:
            flagged = scripts(flags=True)
            try:  # a server before Redis 7.0 refuses a script with a flags line
                flagged.heartbeat.ensure_loaded(self.client)
                self._scripts = flagged
            except ResponseError:
                self._scripts = scripts(flags=False)
        return self._scripts

    @property
    def logs_changes(self) -> str:
        """ARGV of the scripts that change a job: '1' when a database mirrors the store (the change log)."""
        return "1" if self.config.database_url else ""

    def change_log(self, shard_keys: ShardKeys) -> list[str]:
        """KEYS of the scripts whose change log is optional: the shard's, when a database mirrors the store."""
        return [shard_keys.changes] if self.config.database_url else []

    @property
    def client(self) -> redis.Redis:
        """The redis-py client, made on first use (a cluster client reads the slot map then).

        With ``delayed_redis_cluster = "auto"`` the server is asked once, on
        the connection of the single-server client it keeps otherwise, whether
        it is a cluster node (:func:`~.client.detect_cluster`).

        Raises:
            StoreUnavailable: the server (on Redis Cluster: every node) could not be reached
                while the client was made (tried again on the next use).
            ConfigurationError: the server is a cluster node and a setting cannot work on a cluster.
        """
        if self._client is None:
            if self._lock_pid != os.getpid():  # a forked child: the parent's lock may have been held
                self._lock, self._lock_pid = threading.Lock(), os.getpid()
            with self._lock:  # threads that come at once make one client (and ask the server once)
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self) -> redis.Redis:
        cluster = self._cluster
        if cluster is None:
            plain = make_client(self.url, options=self.config.redis_options, fail_fast=self._fail_fast)
            try:
                cluster = detect_cluster(plain, self.url)
            except UNAVAILABLE as exc:
                close_client(plain)
                raise (translate(exc, self.url) or exc) from exc
            except BaseException:
                close_client(plain)
                raise
            if not cluster:
                self._cluster = False
                return plain
            close_client(plain)
            self._check_cluster()
            self._cluster = True
        return make_client(self.url, options=self.config.redis_options, fail_fast=self._fail_fast, cluster=cluster)

    @property
    def cluster(self) -> bool:
        """Whether the store is a Redis Cluster (``"auto"``: asks the server when the client is made).

        Raises:
            StoreUnavailable: ``"auto"``, and the server cannot be reached to ask it.
        """
        if self._cluster is None:
            _ = self.client
        return bool(self._cluster)

    def _check_cluster(self) -> None:
        """Refuse what cannot work on the Redis Cluster that ``"auto"`` found (as ``True`` refuses it at start)."""
        where = (f"the store's Redis at {redact(self.url)} is a node of a Redis Cluster (found by "
                 "delayed_redis_cluster \"auto\")")
        if not self.url.startswith(("redis://", "rediss://")):
            raise ConfigurationError(f"{where}: name one of its nodes as redis://host:port (or rediss://)")
        if self.broker.direct:
            why = ("delayed_release_mode is 'direct'" if self.config.release_mode == "direct" else
                   f"the broker {redact(broker_url(self.app.conf))!r} is that node too, and kombu cannot use a "
                   "cluster")
            raise ConfigurationError(
                f"{where}, but {why}: release must publish to a broker that is not the cluster. Use RabbitMQ or a "
                "separate plain Redis as broker_url (and delayed_release_mode 'auto' or 'publish')")

    def lane(self) -> Lane | ClusterLane:
        """This thread's own connection (:mod:`.lane`): a call on it skips the pool's bookkeeping."""
        if self._lanes is None:
            self._lanes = Lanes(self.client)
        return self._lanes.get()

    def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        return script(self.client, keys, args)

    def run_acked(self, script: Script, keys: Sequence[str], args: Sequence[Arg], what: str, jobs: int = 1) -> Any:
        """Run a write the caller is told about: with ``delayed_wait_replicas``, wait for the replicas.

        ``jobs``: how many jobs the call stores (a large call's reply is waited for longer).
        """
        if not self.config.wait_replicas and jobs < LONG_CALL_JOBS:
            return self.run(script, keys, args)
        return self.run_many(script, [(keys, args)], wait=what, jobs=jobs)[0]

    def run_many(
        self, script: Script, calls: Sequence[tuple[Sequence[str], Sequence[Arg]]], wait: str = "",
        lane: bool = False, atomic: bool = False, jobs: int = 0,
    ) -> list[Any]:
        """Run one script several times in one round trip (a pipeline), loading it if needed.

        ``wait`` (what the calls do, for the error message): with
        ``delayed_wait_replicas``, the pipeline ends with ``WAIT`` on the same
        connection, so the reply comes once that many replicas have the writes
        (:class:`~celery_delayed.errors.ReplicationTimeout` when they have
        not within ``delayed_wait_replicas_timeout_ms``). ``lane``: one call
        goes on this thread's own connection (:class:`~.lane.Lane`).
        ``atomic``: several calls go in one ``MULTI``/``EXEC`` (not on a Redis
        Cluster, whose transactions hold one slot), so a store reaching
        ``maxmemory`` part way refuses all of them: Redis decides a
        transaction's out-of-memory state once, when ``EXEC`` starts (and
        refuses to queue a command while full), where a pipeline's scripts
        are each judged as they come. ``jobs``: how many jobs the calls store
        (at :data:`LONG_CALL_JOBS` or more, the reply is read on a connection
        of its own with a longer timeout: :meth:`_patient_connection`).
        """
        replicas = self.config.wait_replicas if wait else 0
        long_call = jobs >= LONG_CALL_JOBS and not self.cluster
        if len(calls) == 1 and not replicas and not long_call:
            if lane:  # this thread's own connection: redis-py's pool and retry bookkeeping cost more than a call
                return [self.lane().call(script, *calls[0], patient=True)]
            return [self.run(script, *calls[0])]
        if replicas and self.cluster:
            return self._run_waited_on_cluster(script, calls, wait)
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        waits: list[Any] = []  # the WAIT reply of each attempt that wrote something
        loads, deadline, delay = 0, 0.0, 0.05
        while True:
            pipe = self.client.pipeline(transaction=False)  # (MULTI by hand: WAIT must follow EXEC, not join it)
            tx = atomic and len(todo) > 1 and not self.cluster
            if tx:
                pipe.execute_command("MULTI")  # type: ignore[no-untyped-call]
            for i in todo:
                script.queue(pipe, *calls[i])
            if tx:
                pipe.execute_command("EXEC")  # type: ignore[no-untyped-call]
            if replicas:
                pipe.execute_command(  # type: ignore[no-untyped-call]
                    "WAIT", replicas, self.config.wait_replicas_timeout_ms)
            replies = self._run_patiently(pipe, jobs, replicas) if long_call else pipe.execute(raise_on_error=False)
            waited = replies.pop() if replicas else None
            if tx:
                replies = _executed(replies)
            retry, missing, refused, full = [], False, None, None
            for i, reply in zip(todo, replies, strict=True):
                if isinstance(reply, NoScriptError):
                    retry.append(i)
                    missing = True
                elif isinstance(reply, Exception) and not_executed(reply):
                    # A slot migration refused it (redis-py's pipeline gave up): it did not run.
                    retry.append(i)
                    refused = reply
                elif isinstance(reply, OutOfMemoryError) and atomic:
                    full = full or reply  # (a cluster: one full node refuses only its own calls)
                elif isinstance(reply, Exception):
                    raise reply
                else:
                    results[i] = reply
            if full is not None:
                if any(r is not None for r in results):
                    raise PartlyWritten(results, full)
                raise full
            if replicas and len(retry) < len(todo):
                waits.append(waited)
            if not retry:
                for waited in waits:
                    self._check_replicas(waited, wait, results)
                return results
            if missing:
                if loads == 2:
                    raise RuntimeError(f"script {script.name} could not be loaded")
                script.ensure_loaded(self.client)
                loads += 1
            if refused is not None:  # tried again as StoreCluster tries a single command
                now = time.monotonic()
                deadline = deadline or now + (MIGRATION_PATIENCE_FAST_S if self._fail_fast else MIGRATION_PATIENCE_S)
                if now >= deadline:
                    raise refused
                time.sleep(min(delay, deadline - now))
                delay = min(delay * 2, 0.5)
            todo = retry

    def _run_patiently(self, pipe: Any, jobs: int, replicas: int) -> list[Any]:
        """The replies of ``pipe``'s commands, sent on a connection of its own (:meth:`_patient_connection`).

        The commands go down in one write and each reply is read as redis-py's
        pipeline reads it (the client's reply callbacks; an error reply kept
        in its place). The connection is closed after: it never joins the pool.
        """
        conn = self._patient_connection(jobs, replicas)
        if conn is None:
            return list(pipe.execute(raise_on_error=False))
        commands = [args for args, _options in pipe.command_stack]
        pipe.reset()
        try:
            conn.send_packed_command(conn.pack_commands(commands))
            replies: list[Any] = []
            for args in commands:
                try:
                    replies.append(self.client.parse_response(conn, args[0]))  # type: ignore[no-untyped-call]
                except ResponseError as exc:
                    replies.append(exc)
            return replies
        finally:
            conn.disconnect()

    def _patient_connection(self, jobs: int, replicas: int) -> Any:
        """A connection of its own for a call storing ``jobs`` jobs, whose reply may outlast the read timeout.

        Redis runs a batch's ``MULTI``/``EXEC``, and each shard's script, as
        one command. redis-py reads every reply within the client's
        ``socket_timeout`` (5 s by default since redis-py 8), so a large batch
        timed out while Redis went on writing it whole. This connection (made
        like the pool's, never handed to it) waits that timeout plus
        :data:`LONG_CALL_S_PER_JOB` a job, and the ``WAIT`` bound with
        ``delayed_wait_replicas``. None when the client has no read timeout.
        A Redis Cluster's pipeline uses its nodes' own connections: there each
        shard's script is read in turn, and only a single shard's part must
        fit the timeout.
        """
        pool = self.client.connection_pool
        conn = pool.connection_class(**pool.connection_kwargs)
        if conn.socket_timeout is None:
            return None
        timeout = conn.socket_timeout + jobs * LONG_CALL_S_PER_JOB
        if replicas:
            timeout += self.config.wait_replicas_timeout_ms / 1000
        conn.socket_timeout = timeout  # (read when it connects, by the socket and the reply parser)
        if hasattr(conn, "orig_socket_timeout"):  # redis-py 8 puts socket_timeout back from it after maintenance
            conn.orig_socket_timeout = timeout
        # Connect now, through connect(): a Sentinel-managed connection asks the Sentinels for the
        # master there (a send on a connection never connected goes to its default host instead).
        conn.connect()
        return conn

    def _run_waited_on_cluster(
        self, script: Script, calls: Sequence[tuple[Sequence[str], Sequence[Arg]]], what: str,
    ) -> list[Any]:
        """:meth:`_run_many` with ``WAIT`` on a Redis Cluster: per master, its calls then ``WAIT`` on one connection.

        ``WAIT`` counts the replicas that have every write made before it *on
        that connection*, so each master's calls go down one connection of
        that master's own client (in one round trip), followed by ``WAIT``.
        A call the cluster refused as not run (MOVED or ASK after a failover
        or a slot migration, TRYAGAIN) is sent again once the slot map is
        read again, for up to the migration patience.
        """
        cluster: Any = self.client
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        deadline, delay = 0.0, 0.05
        while True:
            by_node: dict[str, list[int]] = defaultdict(list)
            nodes: dict[str, Any] = {}
            for i in todo:
                node = cluster.get_node_from_key(calls[i][0][0])
                by_node[node.name].append(i)
                nodes[node.name] = node
            retry: list[int] = []
            full: Exception | None = None
            for name, idx in by_node.items():
                conn = cluster.get_redis_connection(nodes[name])
                pending = idx
                for attempt in range(3):
                    pipe = conn.pipeline(transaction=False)
                    for i in pending:
                        script.queue(pipe, *calls[i])
                    pipe.execute_command("WAIT", self.config.wait_replicas, self.config.wait_replicas_timeout_ms)
                    replies = pipe.execute(raise_on_error=False)
                    waited = replies.pop()
                    missing = [i for i, r in zip(pending, replies, strict=True) if isinstance(r, NoScriptError)]
                    wrote = False
                    for i, reply in zip(pending, replies, strict=True):
                        if isinstance(reply, OutOfMemoryError):  # this node is full; the others go on
                            full = full or reply
                        elif not isinstance(reply, NoScriptError):
                            wrote |= _record(results, i, reply, retry)
                    if wrote:
                        self._check_replicas(waited, what, results)
                    if not missing:
                        break
                    if attempt == 2:
                        raise RuntimeError(f"script {script.name} could not be loaded")
                    script.ensure_loaded(conn)  # a master that never ran it
                    pending = missing
            if full is not None:
                if any(r is not None for r in results):
                    raise PartlyWritten(results, full)
                raise full
            if not retry:
                return results
            now = time.monotonic()
            deadline = deadline or now + (MIGRATION_PATIENCE_FAST_S if self._fail_fast else MIGRATION_PATIENCE_S)
            if now >= deadline:
                raise StoreUnavailable(f"{what}: the cluster kept redirecting the call (a failover or a slot "
                                       "migration in progress); nothing was written. Call again")
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 0.5)
            with contextlib.suppress(Exception):  # read the slot map again (who owns each slot now)
                cluster.nodes_manager.initialize()
            todo = retry

    def _check_replicas(self, acked: Any, what: str, results: list[Any] | None = None) -> None:
        """Raise :class:`ReplicationTimeout` (carrying the calls' ``results``) when too few replicas acked."""
        if isinstance(acked, Exception):
            raise acked
        wanted, timeout = self.config.wait_replicas, self.config.wait_replicas_timeout_ms
        if int(acked) < wanted:
            exc = ReplicationTimeout(
                f"{what}: done on the master, but only {acked} of the {wanted} replicas of delayed_wait_replicas "
                f"acknowledged it within {timeout} ms, so a failover now could lose it. Check the replicas "
                "(INFO replication: connected_slaves, lag), raise delayed_wait_replicas_timeout_ms, or lower "
                "delayed_wait_replicas; calling again with the same task_id is safe (the job is not doubled)",
                int(acked), wanted)
            exc.results = results
            raise exc

    def close(self) -> None:
        """Close the client's connections (the store can be used again: they reopen)."""
        if self._client is None:
            return
        with contextlib.suppress(Exception):  # closing is best effort
            close_client(self._client)
        if self._cluster:  # a cluster client is made anew (with a fresh slot map)
            self._client, self._lanes = None, None

    def now_arg(self, now_ms: int | None) -> str:
        """ARGV[1] of every script: an explicit time, the test clock (:attr:`clock`), or '' for the server's."""
        if now_ms is not None:
            return str(now_ms)
        return "" if self.clock is None else str(self.clock())

    @translated
    def now_ms(self) -> int:
        """The store's clock, epoch ms: the Redis server's (or the test clock, :attr:`clock`)."""
        if self.clock is not None:
            return self.clock()
        sec, usec = self.client.time()
        return int(sec) * 1000 + int(usec) // 1000

class PartlyWritten(Exception):
    """Some calls of an ``atomic`` :meth:`Runner.run_many` on a Redis Cluster ran, others were refused.

    ``results``: each call's reply, None for one that did not run; ``error``:
    the refusal (one node of the cluster at ``maxmemory``).
    """

    def __init__(self, results: list[Any], error: Exception) -> None:
        super().__init__(str(error))
        self.results = results
        self.error = error


def _executed(replies: list[Any]) -> list[Any]:
    """The replies of the commands of a pipelined ``MULTI`` ... ``EXEC``, from the pipeline's replies.

    A transaction Redis refused (a command refused while queued, such as one
    refused at ``maxmemory``: ``EXECABORT``) ran nothing: the refusal is raised.
    """
    started, *queued, done = replies
    if isinstance(done, Exception):
        for reply in (started, *queued):
            if isinstance(reply, Exception):
                raise reply
        if "OOM" in str(done):  # EXEC itself refused ("EXECABORT ... because of: OOM ..."): nothing ran
            raise OutOfMemoryError(str(done)) from done
        raise done
    return list(done)


def _record(results: list[Any], i: int, reply: Any, retry: list[int]) -> bool:
    """Keep call ``i``'s reply; a redirect or TRYAGAIN (the call did not run) goes to ``retry``. True: it ran."""
    if isinstance(reply, (AskError, TryAgainError, ClusterDownError)):  # MOVED is an AskError too
        retry.append(i)
        return False
    if isinstance(reply, Exception):
        raise reply
    results[i] = reply
    return True

