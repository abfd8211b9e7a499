"""The gateway: the only code that runs the Lua scripts, one method per script.

Every change to the store is one script (``lua/<name>.lua``) called by one
method of :class:`Store`, which formats its keys (:class:`~.keys.Keys`),
passes ``now`` as ``ARGV[1]`` and maps the reply code
(:class:`~celery_delayed.vocab.Reply`) to a result or an exception. Redis
errors become :class:`~celery_delayed.errors.StoreUnavailable` /
:class:`~celery_delayed.errors.StoreFull` in every public method
(:func:`~.client.translate_errors`). Reads that list many jobs live in
:mod:`.views`. The record schema is in :mod:`.records`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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

from ..config import DelayedConfig, get_config
from ..errors import (
    ConfigurationError,
    InvalidOption,
    InvalidState,
    JobNotFound,
    LeaseLost,
    ReplicationTimeout,
    StoreFull,
    StoreUnavailable,
    raise_for,
)
from ..vocab import ETA_FALLBACK_LAST, ETA_FALLBACKS, Field, JobState, Reply
from . import compact
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
    translate_errors,
)
from .compact import Template
from .keys import Keys, ShardKeys, index_part, parse_index_part, shard_for
from .lane import Lanes
from .loader import Arg, Script, Scripts, scripts
from .moves import JobMover
from .records import NEW_JOB_FIELDS, Batch, Membership, NewJob, Outcome, Scheduled, Started, rehome
from .urls import broker_url, is_sentinel_url, redact, same_redis

#: Delay before a job the broker refused is published again, ms (doubled after each refusal).
_REFUSED_DELAY_MS = 1000
#: Payload prefix of a membership notice on the wake channel.
MEMBERS_NOTICE = "members|"
#: The "owner" of the membership notice a reshard sends when it changes the layout.
LAYOUT_NOTICE = "~layout"
#: A call that stores this many jobs or more may keep Redis busy longer than the client's read timeout:
#: its reply is read on a connection of its own, whose timeout grows with the jobs (see _patient_connection).
LONG_CALL_JOBS = 10_000
#: The time a long call's reply is given per job, on top of the client's read timeout (Redis takes
#: ~10-30 µs a job: 100,000 jobs in one MULTI/EXEC held it 2 s).
LONG_CALL_S_PER_JOB = 100e-6


#: Record fields that hold a job's message (full, or a compact record's own part).
_MESSAGE_FIELDS = (Field.MESSAGE, Field.TAG, *(f for f in compact.FIELDS if f != Field.TEMPLATE))


def _now(now_ms: int | None) -> str:
    """ARGV[1] of every script: an explicit time, or '' for the server's clock."""
    return "" if now_ms is None else str(now_ms)


def _triples(reply: Sequence[Any], start: int) -> list[tuple[str, str, str]]:
    """The (id, state, reason) entries at the end of a release reply."""
    return [(str(reply[i]), str(reply[i + 1]), str(reply[i + 2])) for i in range(start, len(reply), 3)]


def _flatten(fields: Mapping[str, str]) -> list[str]:
    """Record fields as the scripts take them: count, names, values."""
    names = list(fields)
    return [str(len(names)), *names, *(str(fields[n]) for n in names)]


@translate_errors
class Store:
    """The delayed-job store of one Celery app: the only gateway to its Redis.

    Args:
        app: the Celery app (its ``delayed_*`` settings and broker options apply).
        config: its config (default: :func:`~celery_delayed.config.get_config`).
        fail_fast: a client that retries a failed command once, quickly (for
            scheduler threads, which back off themselves).
        client: a redis-py client to use instead of making one.
    """

    def __init__(
        self, app: Celery, config: DelayedConfig | None = None, *, fail_fast: bool = False,
        client: redis.Redis | None = None,
    ) -> None:
        self.app = app
        self.config = config or get_config(app)
        self.url = self.config.redis_url
        self._fail_fast = fail_fast
        self._client: redis.Redis | None = client
        self._lock, self._lock_pid = threading.Lock(), os.getpid()  # making the client
        #: Whether the store is a Redis Cluster; None until the server is asked (``"auto"``).
        self._cluster: bool | None = (
            is_cluster(client) if client is not None
            else self.config.redis_cluster if isinstance(self.config.redis_cluster, bool)
            else False if is_sentinel_url(self.url) else None)
        self.keys = Keys(self.config.key_prefix)
        self.broker = BrokerLayout.from_app(app, self.config)
        self._layout_ok = False
        #: The layout's shard count (``delayed_shards`` until the layout is read; a reshard changes it live).
        self._shards = self.config.shards
        #: The count a reshard in progress moves from (None: no reshard is moving jobs).
        self._moving_from: int | None = None
        self._layout_read_at = 0.0
        self._scripts: Scripts | None = None
        self._lanes_of: Lanes | None = None
        #: (shard, template id) this store sent to the server (compact records)
        self._templates_sent: set[tuple[int, str]] = set()
        #: templates read back from the server, by id (a template never changes: its id is its digest)
        self._templates: dict[str, Template] = {}
        #: schedule.lua's keys and leading arguments, by what decides them (:meth:`_call_head`)
        self._heads: dict[tuple[Any, ...], tuple[Mapping[str, str], list[str], list[Arg]]] = {}
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

    def _change_log(self, sk: ShardKeys) -> list[str]:
        """KEYS of the scripts whose change log is optional: the shard's, when a database mirrors the store."""
        return [sk.changes] if self.config.database_url else []

    @property
    def direct(self) -> bool:
        """True on the direct release path (the broker is Redis on the store's server)."""
        return self.broker.direct

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

    @property
    def _lanes(self) -> Lanes:
        if self._lanes_of is None:
            self._lanes_of = Lanes(self.client)
        return self._lanes_of

    @property
    def release_path(self) -> tuple[str, str]:
        """("direct" or "publish", why): the release path this store's scheduler takes (``delayed status``)."""
        mode = self.config.release_mode
        if self.cluster:
            found = " (found by delayed_redis_cluster \"auto\")" if self.config.redis_cluster == "auto" else ""
            return "publish", f"the store is a Redis Cluster{found}: kombu cannot read queues from one"
        if self.direct:
            return "direct", ("the broker is Redis on the store's server" if mode == "auto"
                              else "delayed_release_mode = 'direct'")
        return "publish", ("the broker is not the store's Redis" if mode == "auto"
                           else "delayed_release_mode = 'publish'")

    # -- plumbing ----------------------------------------------------------------

    def _run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        return script(self.client, keys, args)

    def _run_acked(self, script: Script, keys: Sequence[str], args: Sequence[Arg], what: str, jobs: int = 1) -> Any:
        """Run a write the caller is told about: with ``delayed_wait_replicas``, wait for the replicas.

        ``jobs``: how many jobs the call stores (a large call's reply is waited for longer).
        """
        if not self.config.wait_replicas and jobs < LONG_CALL_JOBS:
            return self._run(script, keys, args)
        return self._run_many(script, [(keys, args)], wait=what, jobs=jobs)[0]

    def _run_many(
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
                return [self._lanes.get().call(script, *calls[0], patient=True)]
            return [self._run(script, *calls[0])]
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
                    self._check_replicas(waited, wait)
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
                        self._check_replicas(waited, what)
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

    def _check_replicas(self, acked: Any, what: str) -> None:
        if isinstance(acked, Exception):
            raise acked
        wanted, timeout = self.config.wait_replicas, self.config.wait_replicas_timeout_ms
        if int(acked) < wanted:
            raise ReplicationTimeout(
                f"{what}: done on the master, but only {acked} of the {wanted} replicas of delayed_wait_replicas "
                f"acknowledged it within {timeout} ms, so a failover now could lose it. Check the replicas "
                "(INFO replication: connected_slaves, lag), raise delayed_wait_replicas_timeout_ms, or lower "
                "delayed_wait_replicas; calling again with the same task_id is safe (the job is not doubled)",
                int(acked), wanted)

    def check_layout(self) -> None:
        """Refuse a store created with other ``delayed_shards`` or ``delayed_bucket_ms``.

        Both decide which keys hold a job: a producer and a scheduler that
        disagree would leave jobs where no scheduler looks. The first user of a
        prefix records them; later ones must match (``delayed reshard`` is the
        way to change the shard count). Checked once per Store; after that the
        store follows the layout as a reshard changes it (:meth:`reload_layout`).

        Raises:
            ConfigurationError: the settings differ from the store's.
            StoreUnavailable: Redis cannot be reached.
        """
        if self._layout_ok:
            return
        want = {"shards": str(self.config.shards), "bucket_ms": str(self.config.bucket_ms)}
        got: list[str | None] = self.client.hmget(  # type: ignore[assignment]
            self.keys.layout, [*want, "from"])
        # (a read first: it works on a full Redis too)
        if None in got[:2]:  # the first user of this prefix records the layout
            pipe = self.client.pipeline(transaction=False)
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
        self._layout_read_at = time.monotonic()
        self._check_direct()
        self._layout_ok = True

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
        if not self._layout_read_at:
            self.reload_layout()
        return range(self.span)

    def reload_layout(self, max_age_s: float = 0.0) -> bool:
        """Read the layout again (at most every ``max_age_s``) and follow it; return True when it changed.

        A running producer, scheduler or worker follows a reshard without a
        restart: the scripts refuse a write made with the old count, the
        schedulers re-read the layout when told and every few heartbeats.
        """
        if max_age_s and time.monotonic() - self._layout_read_at < max_age_s:
            return False
        got: list[str | None] = self.client.hmget(self.keys.layout, ["shards", "from"])  # type: ignore[assignment]
        self._layout_read_at = time.monotonic()
        if got[0] is None:
            return False
        before = (self._shards, self._moving_from)
        self._shards, self._moving_from = int(got[0]), (int(got[1]) if got[1] else None)
        return (self._shards, self._moving_from) != before

    def valid_shard(self, shard: int | None) -> bool:
        """Whether ``shard`` (a message's ``delayed_shard`` header) is a shard of this store (the layout read again)."""
        if shard is None or shard < 0:
            return False
        return shard < self.span or (self.reload_layout(1.0) and shard < self.span)

    def _check_direct(self) -> None:
        """Refuse a forced direct path whose broker is not the store's server (and database).

        The release script pushes onto the store server's lists: with the
        broker elsewhere no worker would ever read them. ``auto`` decides by
        the URLs; a forced ``"direct"`` (the same server under another URL,
        e.g. a unix socket) is checked by asking both for their run id.
        """
        if self.config.release_mode != "direct":
            return
        broker = broker_url(self.app.conf)
        if is_sentinel_url(broker):  # the same Sentinels, database and master name, or refused
            theirs = (self.app.conf.broker_transport_options or {}).get("master_name")
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
            ours = self.client.info("server").get("run_id"), self.client.connection_pool.connection_kwargs.get("db", 0)
            return "" if theirs == ours else "a different Redis server or database"
        except (ResponseError, ValueError) as exc:
            return f"not a Redis server this store can verify ({exc})"

    def layout(self) -> dict[str, str]:
        """The ``shards`` and ``bucket_ms`` recorded when the store was created (empty: none yet); reads only."""
        return {str(k): str(v) for k, v in self.client.hgetall(self.keys.layout).items()}

    def shard_of(self, job_id: str, shard_key: str | None = None) -> int:
        """The shard a job lives in: ``crc32(shard_key or job_id) % shards`` (the layout's count)."""
        return shard_for(shard_key or job_id, self._shards)

    def drop_everything(self) -> int:
        """Delete every key under this store's prefix; return how many (the testing kit's clean-up).

        It SCANs the whole server: for a test's own prefix, never a production store.
        """
        n = 0
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self.config.key_prefix)
        for pattern in (f"{escaped}:*",):
            batch: list[Any] = []
            for key in self.client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    n += int(self.client.unlink(*batch))
                    batch = []
            if batch:
                n += int(self.client.unlink(*batch))
        return n

    def close(self) -> None:
        """Close the client's connections (the store can be used again: they reopen)."""
        if self._client is None:
            return
        with contextlib.suppress(Exception):  # closing is best effort
            close_client(self._client)
        if self._cluster:  # a cluster client is made anew (with a fresh slot map)
            self._client = self._lanes_of = None

    def _now(self, now_ms: int | None) -> str:
        """ARGV[1] of every script: an explicit time, the test clock (:attr:`clock`), or '' for the server's."""
        if now_ms is None and self.clock is not None:
            return str(self.clock())
        return _now(now_ms)

    def now_ms(self) -> int:
        """The store's clock, epoch ms: the Redis server's (or the test clock, :attr:`clock`)."""
        if self.clock is not None:
            return self.clock()
        sec, usec = self.client.time()
        return int(sec) * 1000 + int(usec) // 1000

    # -- scheduling and job operations ---------------------------------------------

    def schedule(self, jobs: Sequence[NewJob], now_ms: int | None = None) -> list[Scheduled]:
        """Store jobs (``schedule.lua``): one script call per shard, all shards in one round trip.

        Several calls go in one ``MULTI``/``EXEC`` (not on a Redis Cluster):
        a store reaching ``maxmemory`` part way refuses them all.

        Returns one :class:`Scheduled` per job, in order. A job whose id is
        taken keeps the record that was there (``created`` is False).
        """
        self.check_layout()
        out: list[Scheduled | None] = [None] * len(jobs)
        todo = list(range(len(jobs)))
        for _attempt in range(4):
            if self._shards != self.config.shards or self._moving_from:  # a reshard was seen: place them anew
                jobs = [j if j.shard == self._home(j) else rehome(j, self._home(j)) for j in jobs]
                if self._moving_from:
                    todo = self._held_elsewhere(jobs, todo, out)
            try:
                moved = self._schedule(jobs, todo, out, now_ms)
            except OutOfMemoryError as exc:
                self._refused_part_way(out, exc)
                raise
            if not moved:
                return [s for s in out if s is not None]
            self.reload_layout()  # a reshard sealed their shards: read the new count and place them again
            todo = moved
        raise StoreUnavailable(f"{len(todo)} job(s) could not be placed: the store's layout keeps changing (a reshard)")

    def _refused_part_way(self, out: list[Scheduled | None], exc: OutOfMemoryError) -> None:
        """Raise :class:`StoreFull` naming the jobs stored before Redis refused the rest, if any were.

        A single Redis refuses a batch whole (one ``MULTI``/``EXEC``), unless a
        second round trip was needed: a shard whose template was lost, or jobs a
        reshard moved. A Redis Cluster writes each node's shards on their own.
        """
        written = {i: s for i, s in enumerate(out) if s is not None}
        if not written:
            return  # nothing was written: the caller raises the refusal itself
        where = ", on the other nodes of the Redis Cluster," if self.cluster else ""
        raise StoreFull(
            f"the celery-delayed store at {redact(self.url)} is full (Redis maxmemory reached; {exc}): "
            f"{len(written)} of the {len(out)} jobs were written{where} before it refused the rest "
            "(StoreFull.written: their positions and handles). Release or purge jobs, or raise maxmemory, then "
            "schedule the calls not written (calling again with the same task_ids is safe: a job stored "
            "already is not doubled)", written) from exc

    def _home(self, job: NewJob) -> int:
        """The shard ``job`` belongs in under the layout's count (by its shard key, else its id)."""
        return shard_for(job.fields.get(Field.SHARD_KEY) or job.id, self._shards)

    def _held_elsewhere(self, jobs: Sequence[NewJob], todo: list[int], out: list[Scheduled | None]) -> list[int]:
        """While a reshard moves jobs: a job whose id is held in its old-layout shard is not stored again."""
        old = self._moving_from or self._shards
        where = {i: shard_for(jobs[i].fields.get(Field.SHARD_KEY) or jobs[i].id, old) for i in todo}
        look = [i for i in todo if where[i] != jobs[i].shard]
        if not look:
            return todo
        pipe = self.client.pipeline(transaction=False)
        for i in look:
            pipe.hmget(self.keys.shard(where[i]).job(jobs[i].id), Field.STATE, Field.DUE, Field.GENERATION)
        held = set()
        for i, (state, due, gen) in zip(look, pipe.execute(), strict=True):
            if state is not None:
                held.add(i)
                out[i] = Scheduled(jobs[i].id, where[i], int(float(due or 0)), False, str(state), int(gen or 0))
        return [i for i in todo if i not in held]

    def _schedule(self, jobs: Sequence[NewJob], todo: Sequence[int], out: list[Scheduled | None],
                  now_ms: int | None) -> list[int]:
        """Store ``jobs[i]`` for i in ``todo`` into ``out``; return the indices a reshard's seal refused."""
        # One call per shard and set of shared fields; the shared fields go
        # once per call, the others once per job.
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i in todo:
            groups[(jobs[i].shard, id(jobs[i].common))].append(i)
        calls: list[tuple[list[str], list[Arg]]] = []
        order: list[tuple[int, list[int]]] = []
        compact: list[Template | None] = []
        for (shard, _), idx in groups.items():
            first = jobs[idx[0]]
            common = first.common or {}
            tmpl = first.template
            compact.append(tmpl)
            if len(idx) == 1:
                fields = first.fields
                own = [f for f in NEW_JOB_FIELDS if f not in common and fields.get(f)]
            else:
                present = set().union(*(jobs[i].fields.keys() for i in idx))
                own = [f for f in NEW_JOB_FIELDS
                       if f in present and f not in common and any(jobs[i].fields.get(f) for i in idx)]
            keys, head = self._call_head(shard, common, tmpl, own)
            args: list[Arg] = [self._now(now_ms), *head]
            if own == ["msg"]:
                for i in idx:
                    args += (jobs[i].id, jobs[i].due, jobs[i].fields["msg"])
            else:
                for i in idx:
                    job = jobs[i]
                    args += [job.id, job.due, *(job.fields.get(f, "") for f in own)]
            calls.append((keys, args))
            order.append((shard, idx))
        what = f"scheduling {len(todo)} job{'s' if len(todo) != 1 else ''}"
        try:
            replies = self._run_many(self.scripts.schedule, calls, wait=what, lane=True, atomic=True,
                                     jobs=len(todo))
        except PartlyWritten as part:  # a Redis Cluster with one node full: keep what the others wrote
            _keep(jobs, order, part.results, out)
            raise part.error from None
        _keep(jobs, order, replies, out)
        moved: list[int] = []
        for n, reply in enumerate(replies):
            if reply == ["!moved"]:
                moved += order[n][1]
                continue
            tmpl = compact[n]
            if tmpl is None:
                continue
            shard = order[n][0]
            if reply == ["!tpl"]:  # the server has not got the template (first use, or it was lost): send it
                # (Lost: a week after its last job's due time, or with a restart that lost data. In a batch
                # over several shards, the other shards' jobs are written by now, in the same MULTI/EXEC.)
                keys, args = calls[n]
                at = 6 + 2 * int(args[5])
                args = [*args[:5], int(args[5]) + 1, *args[6:at], "~tpl", tmpl.text, *args[at:]]
                again = self._run_acked(self.scripts.schedule, keys, args, what, jobs=len(order[n][1]))
                _keep(jobs, [order[n]], [again], out)
            self._templates_sent.add((shard, tmpl.tid))
        return moved

    def _call_head(self, shard: int, common: Mapping[str, str], tmpl: Template | None,
                   own: list[str]) -> tuple[list[str], list[Arg]]:
        """schedule.lua's keys, and its arguments after ``now`` up to the jobs' own (see the script).

        Cached per shard, shared fields (one mapping for many jobs), template
        (and whether this store sent it there) and own field names.
        """
        sent = tmpl is not None and (shard, tmpl.tid) in self._templates_sent
        key = (shard, id(common), None if tmpl is None else tmpl.tid, sent, self._shards, *own)
        hit = self._heads.get(key)
        if hit is not None and hit[0] is common:
            return hit[1], hit[2]
        sk = self.keys.shard(shard)
        shared = [x for f in NEW_JOB_FIELDS if common.get(f) for x in (f, common[f])]
        keys = [sk.due, sk.buckets, sk.next]
        if tmpl is not None:  # compact jobs: their template's key, and what the index needs
            keys.append(sk.template(tmpl.tid))
            route = tmpl.fields
            shared += ["~task", route.get(Field.TASK, ""), "~q", route.get(Field.QUEUE, ""),
                       "~keep", str(self.config.record_ttl_ms)]
            if not sent:
                shared += ["~tpl", tmpl.text]
        head: list[Arg] = [sk.job_prefix, self.config.bucket_ms, self.keys.wake, f"{shard}/{self._shards}",
                           len(shared) // 2, *shared, len(own), *own]
        if common and sent:  # (an empty mapping is a new one each time; an unsent template's call is sent once)
            if len(self._heads) >= 1024:
                self._heads.clear()
            self._heads[key] = (common, keys, head)
        return keys, head

    def schedule_keyed(
        self, job: NewJob, mode: str, key: str, limit_ms: int | None, now_ms: int | None = None,
    ) -> Scheduled:
        """Store ``job`` under a debounce or throttle key (``schedule_keyed.lua``), atomically.

        ``mode`` "debounce": a job of ``key`` still waiting is replaced by this
        one (its id kept), due no later than ``limit_ms`` (max_wait, None: no
        limit) after the key's first call. ``mode`` "throttle": a job of
        ``key`` created within the last ``limit_ms`` (the window) is returned
        as it is. Returns the key's job; ``created`` is True when a new one
        was created (then with ``job.id``).
        """
        self.check_layout()
        for _attempt in range(4):
            if job.shard != self._home(job):  # placed before a reshard this process has seen
                job = rehome(job, self._home(job))
            if self._moving_from:  # the key's entry and job may still be in their old shard: move them first
                old = shard_for(job.fields.get(Field.SHARD_KEY) or job.id, self._moving_from)
                if old != job.shard and self.client.exists(self.keys.shard(old).keyed(mode, key)):
                    JobMover(self).move_entry(old, mode, key, self._shards)
            reply = self._schedule_keyed(job, mode, key, limit_ms, now_ms)
            if isinstance(reply, Scheduled):
                return reply
            self.reload_layout()  # a reshard sealed its shard: place it again
        raise StoreUnavailable(f"job {job.id!r} could not be placed: the store's layout keeps changing (a reshard)")

    def _schedule_keyed(
        self, job: NewJob, mode: str, key: str, limit_ms: int | None, now_ms: int | None,
    ) -> Scheduled | None:
        shard = job.shard
        sk = self.keys.shard(shard)
        keys = [sk.due, sk.buckets, sk.next, sk.keyed(mode, key)]
        pairs: list[str] = [x for f in NEW_JOB_FIELDS if job.fields.get(f) for x in (f, job.fields[f])]
        tmpl = job.template
        if tmpl is not None:
            keys.append(sk.template(tmpl.tid))
        head: list[Arg] = [self._now(now_ms), sk.job_prefix, self.config.bucket_ms, self.keys.wake,
                           f"{shard}/{self._shards}", mode,
                           "" if limit_ms is None else limit_ms, self.config.record_ttl_ms, job.id, job.due]
        send_tpl = tmpl is not None and (shard, tmpl.tid) not in self._templates_sent
        for _ in range(2):
            extra = ["~tpl", tmpl.text] if send_tpl and tmpl is not None else []
            reply = self._run_acked(self.scripts.schedule_keyed, keys,
                                    [*head, (len(pairs) + len(extra)) // 2, *pairs, *extra],
                                    f"scheduling job {job.id!r} ({mode} key {key!r})")
            if reply == ["!moved"]:
                return None
            if reply != ["!tpl"]:
                break
            send_tpl = True  # the server has not got the template (first use, or it was lost)
        if tmpl is not None:
            self._templates_sent.add((shard, tmpl.tid))
        created, job_id, state, due = reply
        return Scheduled(str(job_id), shard, int(float(due)), bool(int(created)), str(state))

    def states(self, jobs: Sequence[NewJob]) -> list[str | None]:
        """The state of each job's record (None: there is none), in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        for job in jobs:
            pipe.hget(self.keys.shard(job.shard).job(job.id), Field.STATE)
        return [None if st is None else str(st) for st in pipe.execute()]

    def locate(self, job_id: str, shard: int | None = None) -> int:
        """Return the shard holding ``job_id``; raise :class:`JobNotFound`.

        Tries the given shard, then the id's own shard, then (a job scheduled
        with a ``shard_key``) every shard in one round trip.

        Raises:
            InvalidOption: ``job_id`` is not a non-empty string.
        """
        if not isinstance(job_id, str) or not job_id:
            raise InvalidOption(f"a job id must be a non-empty string, got {type(job_id).__name__} {job_id!r}")
        for _ in range(2):
            tried = []
            for s in (shard, self.shard_of(job_id)):
                if s is not None and s not in tried:
                    tried.append(s)
                    if self.client.exists(self.keys.shard(s).job(job_id)):
                        return s
            pipe = self.client.pipeline(transaction=False)
            for s in self.shard_range():
                pipe.exists(self.keys.shard(s).job(job_id))
            for s, hit in enumerate(pipe.execute()):
                if hit:
                    return s
            if not self.reload_layout(1.0):  # a reshard this process has not seen yet may have moved it
                break
        raise JobNotFound(job_id)

    def locate_many(self, job_ids: Sequence[str]) -> dict[str, int]:
        """The shard of each of ``job_ids`` that has a record, in one round trip (the others are left out)."""
        n = self.span
        pipe = self.client.pipeline(transaction=False)
        for job_id in job_ids:
            for s in range(n):
                pipe.exists(self.keys.shard(s).job(job_id))
        hits = pipe.execute()
        out: dict[str, int] = {}
        for i, job_id in enumerate(job_ids):
            found = next((s for s in range(n) if hits[i * n + s]), None)
            if found is not None:
                out[job_id] = found
        return out

    def get(self, job_id: str, shard: int | None = None) -> dict[str, str]:
        """Return the job's record (without its message) or raise :class:`JobNotFound`."""
        s = self.locate(job_id, shard)
        rec = {str(k): str(v) for k, v in self.client.hgetall(self.keys.shard(s).job(job_id)).items()}
        if not rec:
            raise JobNotFound(job_id)
        for f in _MESSAGE_FIELDS:
            rec.pop(f, None)
        if Field.TEMPLATE in rec and Field.TASK not in rec:  # a compact pending job: its template routes it
            t = self.template(s, rec[Field.TEMPLATE])
            if t is not None:
                rec.update(t.fields)
        rec["id"], rec["shard"] = job_id, str(s)
        return rec

    def message(self, job_id: str, shard: int) -> str | None:
        """The job's stored kombu envelope (JSON), while it has one (until it starts), else None."""
        return self.messages([(shard, job_id)])[0]

    def messages(self, jobs: Sequence[tuple[int, str]]) -> list[str | None]:
        """The stored envelopes of (shard, id) pairs, one round trip (a compact record's rendered)."""
        pipe = self.client.pipeline(transaction=False)
        for shard, job_id in jobs:
            pipe.hmget(self.keys.shard(shard).job(job_id), Field.MESSAGE, Field.TEMPLATE, Field.TAG, Field.DUE,
                       *compact.FIELDS)
        out: list[str | None] = []
        for (shard, job_id), got in zip(jobs, pipe.execute(), strict=True):
            msg, tid, tag = got[0], got[1], got[2]
            if msg is not None:
                out.append(str(msg))
                continue
            rec = {k: str(v) for k, v in zip((Field.DUE, *compact.FIELDS), got[3:], strict=True) if v is not None}
            t = self.template(shard, str(tid)) if tid is not None and "b" in rec else None
            out.append(None if t is None else compact.render(t, job_id, shard, rec, str(tag or "0")))
        return out

    def template(self, shard: int, tid: str) -> Template | None:
        """A compact records' template of ``shard`` (cached: a template never changes), or None."""
        t = self._templates.get(tid)
        if t is None:
            text = self.client.get(self.keys.shard(shard).template(tid))
            if text is None:
                return None
            t = Template.from_text(str(text))
            if len(self._templates) < 1024:
                self._templates[tid] = t
        return t

    def route_of(self, shard: int, task: str | None, queue: str | None, tid: str | None) -> tuple[str, str]:
        """(task, queue) of a record: its own fields, or its template's (a compact pending job)."""
        if task is None and tid:
            t = self.template(shard, tid)
            if t is not None:
                fields = t.fields
                return fields.get(Field.TASK, ""), fields.get(Field.QUEUE, "")
        return task or "", queue or ""

    def _moving_retry(self, operation: Callable[[int | None], Any], shard: int | None) -> Any:
        """Run ``operation(shard)``; while a reshard moves the job (MOVING: milliseconds), find it again and retry."""
        deadline = time.monotonic() + 10.0
        while True:
            try:
                return operation(shard)
            except InvalidState as exc:
                if exc.state != JobState.MOVING or time.monotonic() > deadline:
                    raise
            time.sleep(0.02)
            shard = None  # it is in its new shard now, or soon

    def cancel(
        self, job_id: str, shard: int | None = None, now_ms: int | None = None, running: bool = False,
    ) -> str:
        """Cancel a job (``cancel.lua``); return the state it had (SCHEDULED, CLAIMED or QUEUED).

        ``running=True`` cancels a RUNNING job too (returns "RUNNING"): for a
        caller that also terminates the execution.

        Raises:
            JobNotFound: no such job.
            InvalidState: it is running, finished or cancelled already.
        """
        return str(self._moving_retry(lambda at: self._cancel(job_id, at, now_ms, running), shard))

    def _cancel(self, job_id: str, shard: int | None, now_ms: int | None, running: bool) -> str:
        s = self.locate(job_id, shard)
        sk = self.keys.shard(s)
        code, state = self._run_acked(
            self.scripts.cancel, [sk.due, sk.buckets, sk.inflight, sk.job(job_id), sk.released, sk.changes],
            [self._now(now_ms), job_id, self.config.bucket_ms, self.config.record_ttl_ms, "1" if running else "",
             self.logs_changes], f"cancelling job {job_id!r}",
        )
        raise_for(code, job_id, state, "cancel")
        return str(state)

    def reschedule(self, job_id: str, due: str, shard: int | None = None, now_ms: int | None = None) -> int:
        """Move a scheduled job to ``due`` ('<ms>' or '+<ms>', ``reschedule.lua``); return the new due ms.

        Raises:
            JobNotFound: no such job.
            InvalidState: it is not SCHEDULED any more.
        """
        return int(self._moving_retry(lambda at: self._reschedule(job_id, due, at, now_ms), shard))

    def _reschedule(self, job_id: str, due: str, shard: int | None, now_ms: int | None) -> int:
        s = self.locate(job_id, shard)
        sk = self.keys.shard(s)
        code, state, new_due = self._run_acked(
            self.scripts.reschedule, [sk.due, sk.buckets, sk.next, sk.job(job_id), sk.changes],
            [self._now(now_ms), job_id, due, self.config.bucket_ms, self.keys.wake, s, self.logs_changes,
             self.config.record_ttl_ms], f"rescheduling job {job_id!r}",
        )
        raise_for(code, job_id, state, "reschedule")
        return int(new_due)

    # -- release (scheduler side) ------------------------------------------------------

    def release_due(
        self, shard: int, owner: str = "", fence: str = "", now_ms: int | None = None, limit: int | None = None,
        lookahead_ms: int = 0,
    ) -> Batch:
        """Direct path (``release_due.lua``): push up to ``limit`` due jobs of ``shard`` onto their queues.

        With ``lookahead_ms``, jobs due within that much of now go too, with
        Celery's ``eta`` set to their due time (the scheduler passes
        ``delayed_lookahead_ms``).

        Raises:
            LeaseLost: ``owner`` does not hold the shard's lease with ``fence``.
        """
        self.check_layout()
        sk = self.keys.shard(shard)
        cfg, broker = self.config, self.broker
        reply = self._run(
            self.scripts.release_due, [sk.due, sk.buckets, sk.next, sk.lease, sk.dlq, sk.released, sk.changes],
            [self._now(now_ms), sk.job_prefix, limit or cfg.batch_size, cfg.bucket_ms, owner, fence,
             cfg.record_ttl_ms, broker.global_keyprefix, broker.deadletter_queue, cfg.dlq_max_age_s * 1000,
             cfg.dlq_max_len_per_shard, self.logs_changes, lookahead_ms],
        )
        batch = self._batch(reply, shard)
        end = 5 + 2 * batch.count
        for i in range(5, end, 2):
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
        self.check_layout()
        sk = self.keys.shard(shard)
        cfg = self.config
        reply = self._run(
            self.scripts.claim_due, [sk.due, sk.buckets, sk.next, sk.lease, sk.inflight, sk.dlq, sk.changes],
            [self._now(now_ms), sk.job_prefix, limit or cfg.batch_size, cfg.bucket_ms, owner, fence,
             cfg.claim_lease_ms, cfg.record_ttl_ms, cfg.dlq_max_age_s * 1000, cfg.dlq_max_len_per_shard,
             self.logs_changes, lookahead_ms],
        )
        batch = self._batch(reply, shard)
        end = 5 + 6 * batch.count
        for i in range(5, end, 6):
            jid, msg, ex, rk, q, ev = reply[i:i + 6]
            batch.ids.append(jid)
            batch.messages.append((msg, ex, rk, q))
            batch.events.append(json.loads(ev) if ev else None)
        batch.not_sent = _triples(reply, end)
        return batch

    @staticmethod
    def _batch(reply: Sequence[Any], shard: int) -> Batch:
        if reply[0] == Reply.NOT_OWNER:
            raise LeaseLost(f"the lease of shard {shard} is held by another scheduler")
        nxt = int(reply[3])
        return Batch(int(reply[1]), int(reply[2]), None if nxt < 0 else nxt, int(reply[4]))

    def ack_claimed(self, shard: int, ids: Iterable[str], now_ms: int | None = None) -> int:
        """Publish path (``ack_claimed.lua``): confirm published jobs; return how many were still in flight."""
        ids = list(ids)
        if not ids:
            return 0
        sk = self.keys.shard(shard)
        return int(self._run(
            self.scripts.ack_claimed, [sk.inflight, sk.released, sk.changes],
            [self._now(now_ms), sk.job_prefix, self.config.record_ttl_ms, self.logs_changes, *ids],
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
        sk = self.keys.shard(shard)
        reply = self._run(
            self.scripts.refuse_claimed, [sk.due, sk.buckets, sk.next, sk.inflight, sk.dlq, sk.changes],
            [self._now(now_ms), sk.job_prefix, cfg.bucket_ms, self.keys.wake, shard, cfg.publish_max_refusals,
             _REFUSED_DELAY_MS, cfg.claim_lease_ms, cfg.dlq_max_age_s * 1000, cfg.dlq_max_len_per_shard,
             self.logs_changes,
             *(x for job_id, why, counts in refused for x in (job_id, why, "1" if counts else ""))],
        )
        return [(str(reply[i]), str(reply[i + 1]), int(reply[i + 2])) for i in range(1, len(reply), 3)]

    # -- scheduler membership ----------------------------------------------------------

    def fleet_settings(self) -> str:
        """The settings every scheduler of this store must share, as heartbeat.lua records them."""
        return f"lease_ms={self.config.lease_ms}"

    def heartbeat(self, owner: str, leave: bool = False, now_ms: int | None = None) -> Membership:
        """Renew (or give up) ``owner``'s membership (``heartbeat.lua``); return what it saw."""
        reply = self._run(
            self.scripts.heartbeat, [self.keys.schedulers, self.keys.scheduler_settings],
            [self._now(now_ms), owner, self.config.lease_ms, "1" if leave else "", self.fleet_settings()],
        )
        deadlines = {str(reply[i]): int(float(reply[i + 1])) for i in range(2, len(reply), 2)}
        return Membership(int(reply[0]), list(deadlines), deadlines, int(reply[1]) == 1)

    def check_fleet(self) -> None:
        """Refuse to join a fleet of schedulers that run with other shared settings.

        Checks the store's layout (``delayed_shards``, ``delayed_bucket_ms``)
        and that every live scheduler has this one's ``delayed_lease_ms`` (a
        member with a shorter lease would be counted dead by the others, and
        its shards taken over while it still releases them).

        Raises:
            ConfigurationError: what differs, from which scheduler, and what to do.
        """
        self.check_layout()
        live = set(self.live_members())
        mine = self.fleet_settings()
        settings: dict[str, str] = self.client.hgetall(self.keys.scheduler_settings)  # type: ignore[assignment]
        for owner, theirs in settings.items():
            if owner in live and theirs != mine:
                raise ConfigurationError(
                    f"this scheduler runs with {mine.replace(';', ', ')}, but scheduler {owner} of the store "
                    f"under prefix {self.config.key_prefix!r} runs with {theirs.replace(';', ', ')}: every "
                    "scheduler of one store must use the same delayed_lease_ms (stop the others first to change it)"
                )

    def hold_shards(
        self, owner: str, take: Iterable[int], give: Iterable[int] = (), live: Iterable[str] = (),
    ) -> tuple[dict[int, str], dict[int, str]]:
        """Take (or check) the leases of shards ``take``, give up those of ``give`` (``shard_lease.lua`` per shard).

        One script call per shard (one slot each: this runs on Redis Cluster),
        all in one round trip. A lease has no deadline: it is its holder's
        while the holder is among the ``live`` members (the caller's last
        heartbeat), so a held shard needs no renewal, and a shard another
        live member holds is not taken.

        Returns ({shard: fence} of the ``take`` shards the caller holds now,
        {shard: holder} of the others).
        """
        wanted, dropped = sorted(set(take)), sorted(set(give) - set(take))
        members = list(live)
        calls: list[tuple[Sequence[str], Sequence[Arg]]] = []
        for shard, arg in [(s, "") for s in wanted] + [(s, "1") for s in dropped]:
            sk = self.keys.shard(shard)
            calls.append(([sk.lease, sk.fence], ["", owner, arg, *([] if arg else members)]))
        held: dict[int, str] = {}
        waits: dict[int, str] = {}
        replies = self._run_many(self.scripts.shard_lease, calls) if calls else []
        for shard, (code, fence, holder) in zip(wanted, replies, strict=False):
            if int(code) == Reply.OK:
                held[shard] = str(fence)
            else:
                waits[shard] = str(holder)
        return held, waits

    def member_deadlines(self) -> list[tuple[str, float]]:
        """Every scheduler's membership deadline, epoch ms (expired ones included until a heartbeat drops them)."""
        rows: list[tuple[str, float]] = self.client.zrange(  # type: ignore[assignment]
            self.keys.schedulers, 0, -1, withscores=True
        )
        return [(str(m), float(d)) for m, d in rows]

    def live_members(self) -> list[str]:
        """The schedulers whose membership lease has not run out."""
        return [str(m) for m in self.client.zrangebyscore(self.keys.schedulers, self.now_ms(), "+inf")]

    def announce_members(self, owner: str) -> None:
        """Tell the other schedulers that the membership changed (on the wake channel)."""
        self.client.publish(self.keys.wake, MEMBERS_NOTICE + owner)

    def subscribe_wake(self) -> WakeSubscription:
        """A new subscription to the wake channel (its own connection; see :class:`WakeSubscription`)."""
        return WakeSubscription(
            make_client(self.url, options=self.config.redis_options, fail_fast=True, cluster=self.cluster),
            self.keys.wake)

    # -- worker side: the execution ledger ----------------------------------------------

    def start(
        self, job_id: str, shard: int, owner: str, hostname: str = "", now_ms: int | None = None,
        generation: int = 0,
    ) -> Started:
        """Take the job's execution lease if it may run now (``start.lua``).

        ``generation`` is the delivered message's (its ``delayed_gen`` header).
        """
        sk = self.keys.shard(shard)
        code, state, attempt, until, why = self._lanes.get().call(
            self.scripts.start, [sk.job(job_id), sk.released, sk.changes],
            [self._now(now_ms), owner, self.config.exec_lease_ms, hostname, generation or "", job_id,
             self.logs_changes],
        )
        if int(code) == Reply.NOT_FOUND:
            moved = self._moved_record(job_id, shard)
            if moved is not None:  # an old message of a job a reshard moved: not this delivery's to run
                return Started(Reply.WRONG_STATE, moved, 0, 0, "moved")
        return Started(Reply(int(code)), str(state), int(attempt), int(until), str(why))

    def _moved_record(self, job_id: str, shard: int) -> str | None:
        """The state of ``job_id``'s record in a shard other than ``shard`` (a reshard moved it), or None.

        A job moves only while it is scheduled or finished, and a moved job is
        released again from its new shard with a message that names it: so a
        message naming the old shard is never the one to run.
        """
        try:
            found = self.locate(job_id)
        except JobNotFound:
            return None
        if found == shard:
            return None
        state = self.client.hget(self.keys.shard(found).job(job_id), Field.STATE)
        return None if state is None else str(state)

    def extend_lease(
        self, job_id: str, shard: int, owner: str, delivery_tag: str = "", now_ms: int | None = None,
    ) -> bool:
        """Push a running job's lease deadline on (``extend_lease.lua``); False when the lease is lost.

        On the direct path it also refreshes the message's entry in kombu's
        unacked index, so a task running longer than ``visibility_timeout`` is
        not redelivered while its lease is alive.
        """
        keys = [self.keys.shard(shard).job(job_id)]
        args: list[Arg] = [self._now(now_ms), owner, self.config.exec_lease_ms]
        if self.broker.unacked_index and delivery_tag:
            keys.append(self.broker.unacked_index)
            args += [delivery_tag, repr(time.time())]  # kombu scores with the worker's own clock
        code, _state, _until = self._run(self.scripts.extend_lease, keys, args)
        return int(code) == Reply.OK

    def finish(
        self, job_id: str, shard: int, owner: str, outcome: str, reason: str = "", now_ms: int | None = None,
    ) -> Outcome:
        """Record an execution's ``outcome`` (SUCCEEDED, FAILED or QUEUED) and give the lease back (``finish.lua``).

        The outcome's code is OK, NOT_FOUND (no record) or NOT_OWNER (the
        lease is not this owner's any more; state = the job's state).
        """
        code, state = self._run(self.scripts.finish, *self._finish_call(job_id, shard, owner, outcome, reason, now_ms))
        return Outcome(Reply(int(code)), str(state))

    def finish_later(
        self, job_id: str, shard: int, owner: str, outcome: str, reason: str = "",
        on_outcome: Callable[[Outcome | Exception], None] | None = None,
    ) -> None:
        """:meth:`finish` without waiting for the reply: the script is sent at once (Redis runs it
        as it reads it), its reply is read with this thread's next store call and passed
        to ``on_outcome`` (an :class:`Outcome`, or the exception the call raised)."""
        def reply(raw: Any) -> None:
            if on_outcome is None:
                return
            if isinstance(raw, Exception):
                on_outcome(raw)
            else:
                on_outcome(Outcome(Reply(int(raw[0])), str(raw[1])))

        self._lanes.get().send(self.scripts.finish, *self._finish_call(job_id, shard, owner, outcome, reason, None),
                               on_reply=reply)

    def drain_replies(self) -> None:
        """Read the replies of this thread's :meth:`finish_later` calls now."""
        self._lanes.get().drain()

    def _finish_call(
        self, job_id: str, shard: int, owner: str, outcome: str, reason: str, now_ms: int | None,
    ) -> tuple[list[str], list[Arg]]:
        cfg = self.config
        sk = self.keys.shard(shard)
        return ([sk.job(job_id), sk.changes],
                [self._now(now_ms), owner, outcome, cfg.done_ttl_s * 1000, cfg.idempotency_ttl_s * 1000, reason, job_id,
                 self.logs_changes])

    # -- failures and the dead-letter queue ------------------------------------------------

    def retry(
        self, job_id: str, shard: int, due: str, retries: int, fields: Mapping[str, str], *,
        owner: str = "", started_ms: int | None = None, now_ms: int | None = None,
    ) -> Outcome:
        """Store the next attempt and index it at ``due`` ('<ms>' or '+<ms>', ``retry.lua``).

        The outcome's code is OK, UNCHANGED (scheduled already), WRONG_STATE
        (cancelled or finished) or NOT_OWNER (running under another lease).
        """
        sk = self.keys.shard(shard)
        code, state, due_ms = self._run(
            self.scripts.retry, [sk.due, sk.buckets, sk.next, sk.inflight, sk.job(job_id), sk.released, sk.changes],
            [self._now(now_ms), job_id, due, self.config.bucket_ms, self.keys.wake, shard, retries,
             self._now(started_ms), owner, self.logs_changes, *_flatten(fields)],
        )
        return Outcome(Reply(int(code)), str(state), due_ms=int(due_ms))

    def fail(
        self, job_id: str, shard: int, fields: Mapping[str, str], *,
        owner: str = "", started_ms: int | None = None, now_ms: int | None = None,
    ) -> Outcome:
        """Mark the job FAILED (``fail.lua``); its record expires after the record ttl."""
        sk = self.keys.shard(shard)
        code, state = self._run(
            self.scripts.fail, [sk.inflight, sk.job(job_id), sk.released, sk.changes],
            [self._now(now_ms), job_id, self.config.record_ttl_ms, self._now(started_ms), owner, self.logs_changes,
             *_flatten(fields)],
        )
        return Outcome(Reply(int(code)), str(state))

    def dead(
        self, job_id: str, shard: int, fields: Mapping[str, str], *,
        owner: str = "", started_ms: int | None = None, now_ms: int | None = None,
    ) -> Outcome:
        """Move the job to the dead-letter queue (``dead.lua``), trimmed by age and count."""
        cfg = self.config
        sk = self.keys.shard(shard)
        code, state, dropped = self._run(
            self.scripts.dead, [sk.job(job_id), sk.dlq, sk.inflight, sk.released, sk.changes],
            [self._now(now_ms), job_id, sk.job_prefix, cfg.dlq_max_age_s * 1000, cfg.dlq_max_len_per_shard,
             self._now(started_ms), owner, self.logs_changes, *_flatten(fields)],
        )
        return Outcome(Reply(int(code)), str(state), dropped=int(dropped))

    def requeue(
        self, shard: int, ids: Sequence[str], due: str, now_ms: int | None = None,
    ) -> tuple[int, list[Outcome]]:
        """Schedule dead letters of one shard again at ``due`` (``requeue.lua``).

        Returns the due time (epoch ms) and one outcome per id: OK,
        NOT_FOUND, WRONG_STATE (not DEAD) or NO_MESSAGE.
        """
        sk = self.keys.shard(shard)
        reply = self._run(
            self.scripts.requeue, [sk.due, sk.buckets, sk.next, sk.dlq, sk.changes],
            [self._now(now_ms), sk.job_prefix, due, self.config.bucket_ms, self.keys.wake, shard, self.logs_changes,
             *ids],
        )
        rest = reply[1:]
        return int(reply[0]), [Outcome(Reply(int(rest[i])), str(rest[i + 1])) for i in range(0, len(rest), 2)]

    def purge_dead(self, shard: int, older_than_ms: int | None = None, limit: int = 1000) -> int:
        """Delete up to ``limit`` dead letters of one shard older than ``older_than_ms`` (``purge_dead.lua``).

        ``older_than_ms`` None deletes them regardless of age.
        """
        sk = self.keys.shard(shard)
        return int(self._run(
            self.scripts.purge_dead, [sk.dlq],
            ["", sk.job_prefix, "" if older_than_ms is None else older_than_ms, limit],
        ))

    # -- the reconciler and the database mirror ----------------------------------------------

    def any_released(self) -> bool:
        """True when some shard has a released job not started yet (one ``EXISTS`` over every shard's set).

        The reconciler's pass reads no shard when none has (an idle fleet);
        on Redis Cluster the client splits the command by slot.
        """
        return bool(self.client.exists(*(self.keys.shard(s).released for s in self.shard_range())))

    def release_candidates(self, shard: int, older_than_ms: int, after: float = 0.0,
                           limit: int = 1000) -> list[tuple[str, float]]:
        """Released jobs not started, due (or last released again) at or before ``older_than_ms``: (id, score).

        Scores greater than ``after`` only, lowest first (a page).
        """
        rows: list[tuple[str, float]] = self.client.zrangebyscore(  # type: ignore[assignment]
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
        sk = self.keys.shard(shard)
        b = self.broker
        keys = [sk.released, sk.due, sk.buckets, sk.next, sk.changes]
        if b.direct:
            keys += [b.unacked_hash, b.unacked_index]
        reply = self._run(
            self.scripts.rerelease, keys,
            [self._now(now_ms), sk.job_prefix, "direct" if b.direct else "publish", max_copies, b.global_keyprefix,
             b.deadletter_queue, self.config.key_prefix, self.config.bucket_ms, self.keys.wake, shard,
             self.logs_changes, int(self.config.requeue_after_s * 1000), *ids],
        )
        return [(str(reply[i]), str(reply[i + 1])) for i in range(1, len(reply), 2)]

    def records(self, shard: int, ids: Sequence[str]) -> dict[str, dict[str, str]]:
        """The records of ``ids`` in one shard (message included; {} for a job without one), one round trip.

        A compact record comes back as a full one (its routing fields and its
        rendered message): what a database row keeps.
        """
        sk = self.keys.shard(shard)
        pipe = self.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(sk.job(job_id))
        out = {j: {str(k): str(v) for k, v in rec.items()} for j, rec in zip(ids, pipe.execute(), strict=True)}
        for job_id, rec in out.items():
            if Field.MESSAGE not in rec and "b" in rec and Field.TEMPLATE in rec:
                t = self.template(shard, rec[Field.TEMPLATE])
                if t is None:
                    continue
                msg = compact.render(t, job_id, shard, rec, rec.get(Field.TAG) or compact.fast_uuid4())
                for f in _MESSAGE_FIELDS:
                    rec.pop(f, None)
                rec.update({k: v for k, v in t.fields.items() if k not in rec})
                rec[Field.MESSAGE] = msg
        return out

    def record_states(self, shard: int, ids: Sequence[str]) -> dict[str, str | None]:
        """The state of each job's record in one shard (None: no record), one round trip."""
        return dict(zip(ids, self.field_of(shard, ids, Field.STATE).values(), strict=True))

    def field_of(self, shard: int, ids: Sequence[str], name: str) -> dict[str, str | None]:
        """One field of each job's record in one shard (None: absent), one round trip."""
        sk = self.keys.shard(shard)
        pipe = self.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(sk.job(job_id), name)
        return {j: (None if v is None else str(v)) for j, v in zip(ids, pipe.execute(), strict=True)}

    def scheduled_pages(self, shard: int, size: int = 1000) -> Iterator[list[str]]:
        """The scheduled job ids of one shard, a page at a time (due order)."""
        for key in ([self.keys.shard(shard).due] if self.config.bucket_ms <= 0
                    else [str(k) for k in self.client.zrange(self.keys.shard(shard).buckets, 0, -1)]):
            start = 0
            while True:
                page = [str(j) for j in self.client.zrange(key, start, start + size - 1)]
                if not page:
                    break
                yield page
                start += len(page)

    def drop(self, job_id: str, shard: int) -> None:
        """Take a job out of the schedule without reporting it (its transaction never committed): CANCELLED."""
        with contextlib.suppress(JobNotFound, InvalidState):
            self.cancel(job_id, shard)

    def read_changes(self, shard: int, count: int = 1000) -> list[tuple[str, str, list[str]]]:
        """The oldest entries of a shard's change log: (entry id, state, job ids)."""
        entries: list[Any] = self.client.xrange(  # type: ignore[assignment]
            self.keys.shard(shard).changes, "-", "+", count=count)
        return [(str(eid), str(f.get("st", "")), str(f.get("ids", "")).split("\n")) for eid, f in entries]

    def trim_changes(self, shard: int, upto: str) -> None:
        """Drop the entries of a shard's change log up to and including ``upto`` (applied)."""
        ms, _, seq = upto.partition("-")
        self.client.xtrim(self.keys.shard(shard).changes, minid=f"{ms}-{int(seq or 0) + 1}")

    def changes_lag(self, shard: int) -> tuple[int, int | None]:
        """(entries not yet applied, epoch ms of the oldest) of a shard's change log."""
        key = self.keys.shard(shard).changes
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(key)
        pipe.xrange(key, "-", "+", count=1)
        n, first = pipe.execute()
        return int(n), (int(str(first[0][0]).split("-")[0]) if first else None)


    # -- interception --------------------------------------------------------------------

    def note_fallback(self, shard: int, task: str, reason: str, now_ms: int | None = None) -> int:
        """Count a delayed send that went to the broker as an ETA message (``note_fallback.lua``).

        Returns the shard's count; the fleet's is the sum over the shards
        (:func:`~celery_delayed.store.views.eta_fallbacks`).
        """
        what = f"{task}|{' '.join(reason.split())}"[:500]
        return int(self._run(
            self.scripts.note_fallback, [self.keys.shard(shard).stats],
            [self._now(now_ms), ETA_FALLBACKS, ETA_FALLBACK_LAST, what],
        ))

    # -- operators' controls (pause, resume, promote, cancel matching) ------------------------

    def _pause_call(self, shard: int, now_ms: int | None, args: Sequence[Arg]) -> tuple[list[str], list[Arg]]:
        sk = self.keys.shard(shard)
        return ([sk.paused, sk.held, sk.due, sk.buckets, sk.next],
                [self._now(now_ms), sk.job_prefix, self.config.bucket_ms, self.keys.wake, shard, *args])

    def pause(self, flags: Sequence[str], now_ms: int | None = None) -> None:
        """Set pause flags on every shard (``pause.lua``): ``all``, ``task:<name>``, ``queue:<name>``."""
        self.check_layout()
        self._run_many(self.scripts.pause, [self._pause_call(s, now_ms, ["pause", 0, 0, *flags])
                                            for s in self.shard_range()])

    def resume(self, flags: Sequence[str] = (), now_ms: int | None = None, batch: int = 1000) -> int:
        """Clear pause flags on every shard (none given: all of them) and put back the jobs they held.

        Returns how many held jobs went back to the due set (released at
        once, the misfire policy applying to them as to any late job).
        """
        self.check_layout()
        moved = 0
        for s in self.shard_range():
            at = 0
            while at >= 0:
                n, at = self._run(self.scripts.pause, *self._pause_call(s, now_ms, ["resume", batch, at, *flags]))
                moved += int(n)
        return moved

    def pauses(self) -> dict[str, int]:
        """The pause flags in force (any shard's), each with when it was set (epoch ms)."""
        pipe = self.client.pipeline(transaction=False)
        for s in self.shard_range():
            pipe.hgetall(self.keys.shard(s).paused)
        out: dict[str, int] = {}
        for flags in pipe.execute():
            for flag, since in flags.items():
                out[str(flag)] = min(int(float(since)), out.get(str(flag), 1 << 62))
        return out

    def index_parts(self, shard: int, task: str | None = None, queue: str | None = None) -> list[str]:
        """The pending-index parts of a shard (``<n>:<task>:<queue>``), of one task and/or queue if given."""
        parts = [str(p) for p in self.client.smembers(self.keys.shard(shard).index_parts)]
        if task is not None and queue is not None:
            return [p for p in parts if p == index_part(task, queue)]
        return [p for p in parts if _part_matches(p, task, queue)]

    def promote(self, job_id: str, shard: int | None = None, now_ms: int | None = None) -> int:
        """Make a scheduled job due now ("run now", ``promote.lua``); return its due time (epoch ms).

        Raises:
            JobNotFound: no such job.
            InvalidState: it is not SCHEDULED any more.
        """
        return int(self._moving_retry(lambda at: self._promote(job_id, at, now_ms), shard))

    def _promote(self, job_id: str, shard: int | None, now_ms: int | None) -> int:
        s = self.locate(job_id, shard)
        sk = self.keys.shard(s)
        _n, now, state = self._run(
            self.scripts.promote, [sk.due, sk.buckets, sk.next, *self._change_log(sk)],
            [self._now(now_ms), sk.job_prefix, self.config.bucket_ms, self.keys.wake, s, 1, "ids", job_id],
        )
        if not state:
            raise JobNotFound(job_id)
        if state != JobState.SCHEDULED:
            raise InvalidState(job_id, str(state), "promote")
        return int(now)

    def promote_matching(self, task: str | None = None, queue: str | None = None, now_ms: int | None = None,
                         batch: int = 1000) -> int:
        """Make every scheduled job of a task and/or queue due now, a batch per call; return how many.

        Raises:
            InvalidOption: neither a task nor a queue.
        """
        _need_match(task, queue)
        total = 0
        for s in self.shard_range():
            parts = self.index_parts(s, task, queue)
            sk = self.keys.shard(s)
            while parts:
                n = int(self._run(
                    self.scripts.promote, [sk.due, sk.buckets, sk.next, *self._change_log(sk)],
                    [self._now(now_ms), sk.job_prefix, self.config.bucket_ms, self.keys.wake, s, batch, "index",
                     *parts],
                )[0])
                total += n
                if n < batch:
                    break
        return total

    def cancel_matching(self, task: str | None = None, queue: str | None = None, due_from_ms: int | None = None,
                        due_to_ms: int | None = None, now_ms: int | None = None, batch: int = 1000) -> list[str]:
        """Cancel the scheduled jobs of a task and/or queue due in a window (``cancel_matching.lua``).

        Bounded by what matches (read from the pending index), a batch per
        call, each call atomic on its shard. Returns the ids cancelled.

        Raises:
            InvalidOption: neither a task nor a queue.
        """
        _need_match(task, queue)
        lo = "-inf" if due_from_ms is None else str(int(due_from_ms))
        hi = "+inf" if due_to_ms is None else str(int(due_to_ms))
        out: list[str] = []
        for s in self.shard_range():
            parts = self.index_parts(s, task, queue)
            sk = self.keys.shard(s)
            while parts:
                ids = [str(i) for i in self._run(
                    self.scripts.cancel_matching, [sk.due, sk.buckets, *self._change_log(sk)],
                    [self._now(now_ms), sk.job_prefix, self.config.bucket_ms, self.config.record_ttl_ms, lo, hi, batch,
                     *parts],
                )]
                out += ids
                if len(ids) < batch:
                    break
        return out


class PartlyWritten(Exception):
    """Some calls of an ``atomic`` :meth:`Store._run_many` on a Redis Cluster ran, others were refused.

    ``results``: each call's reply, None for one that did not run; ``error``:
    the refusal (one node of the cluster at ``maxmemory``).
    """

    def __init__(self, results: list[Any], error: Exception) -> None:
        super().__init__(str(error))
        self.results = results
        self.error = error


def _keep(jobs: Sequence[NewJob], order: Sequence[tuple[int, list[int]]], replies: Sequence[Any],
          out: list[Scheduled | None]) -> None:
    """Put the outcome of each job of the ``schedule.lua`` calls that stored their jobs into ``out``.

    ``order[n]``: call n's shard and the positions of its jobs; ``replies[n]``:
    its reply (None if it did not run; ``!moved`` and ``!tpl`` stored nothing).
    """
    for (shard, idx), reply in zip(order, replies, strict=True):
        if not isinstance(reply, list) or reply in (["!moved"], ["!tpl"]):
            continue
        for i, entry in zip(idx, reply, strict=True):
            if entry.startswith("="):
                out[i] = Scheduled(jobs[i].id, shard, int(entry[1:]), True, JobState.SCHEDULED)
            else:
                state, due, gen = [*entry.split("|"), "", ""][:3]
                out[i] = Scheduled(jobs[i].id, shard, int(float(due or 0)), False, state, int(gen or 0))


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


def _need_match(task: str | None, queue: str | None) -> None:
    if not task and not queue:
        raise InvalidOption("give a task name or a queue (or both) to match jobs by")


def _part_matches(part: str, task: str | None, queue: str | None) -> bool:
    t, q = parse_index_part(part)
    return (task is None or t == task) and (queue is None or q == queue)


class WakeSubscription:
    """A subscription to the store's wake channel, on a connection of its own.

    ``schedule.lua`` (and the other scripts that index a job) publish
    ``"<shard>:<due_ms>"`` there when a job is due earlier than the shard's
    known next due time; schedulers publish ``"members|<owner>"`` when they
    join or leave (:meth:`Store.announce_members`).
    """

    def __init__(self, client: redis.Redis, channel: str) -> None:
        self._client = client
        self._pubsub: Any = client.pubsub()  # type: ignore[no-untyped-call, unused-ignore]
        self._pubsub.subscribe(channel)

    def get(self, timeout: float) -> tuple[str, str] | None:
        """The next event, waiting up to ``timeout`` seconds: ``("subscribed", "")``,
        ``("members", owner)``, ``("due", "<shard>:<due_ms>")`` or None.

        Raises redis-py's errors when the connection is lost (the caller
        resubscribes).
        """
        msg = self._pubsub.get_message(timeout=timeout)
        if msg is None:
            return None
        kind = msg.get("type")
        if kind == "subscribe":
            return ("subscribed", "")
        if kind != "message":
            return None
        data = str(msg["data"])
        if data.startswith(MEMBERS_NOTICE):
            return ("members", data[len(MEMBERS_NOTICE):])
        return ("due", data)

    def close(self) -> None:
        """Unsubscribe and close the connection."""
        try:
            self._pubsub.close()
        finally:
            close_client(self._client)

