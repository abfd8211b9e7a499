"""A thread's own connection: the execution record's writes sent at once, their replies read later.

A worker records two things per job: ``start.lua`` before the body runs (its
reply decides whether the body runs, so the worker waits for it) and
``finish.lua`` after (nothing waits on its reply). Waiting for a reply costs
a round trip; sending does not: Redis runs the command as soon as it reads
it, in order with everything else the connection sends. So a :class:`Lane`
sends a finish and returns; its reply is read when the lane is next used
(typically with the next job's start, in the same read) or by :meth:`drain`.
The outcome is in the store as soon as without the lane; only the worker's
knowledge of the reply comes later (a "finished but the record says ..."
warning is logged then).

A producer's ``apply_later`` (one shard's ``schedule.lua``) goes on the
thread's lane too: a call on a connection of its own skips redis-py's pool
and retry bookkeeping (~20 µs of a ~220 µs call). Its connection lost, that
call is made on the client's pool (``patient``), whose retry policy rides out
a failover as before.

One lane per thread (a connection carries one conversation at a time), held
apart from the client's pool. A reply lost with the connection (Redis
restarted) is retried once on a new connection: ``finish.lua`` run twice by
the same owner answers NOT_OWNER with the outcome already recorded, which the
caller treats as done.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .client import is_cluster
from .loader import Arg, Script

logger = logging.getLogger("celery_delayed.store")

OnReply = Callable[[Any], None]

#: Pending replies a lane lets build up before it reads them all.
MAX_PENDING = 64


class _Sent:
    __slots__ = ("args", "keys", "on_reply", "script")

    def __init__(self, script: Script, keys: Sequence[str], args: Sequence[Arg], on_reply: OnReply) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.on_reply = on_reply


class Lane:
    """One connection of one thread: :meth:`call` waits for its reply, :meth:`send` does not."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.conn: Any = None
        self.pending: list[_Sent] = []
        self.loaded: set[str] = set()  # scripts loaded on this connection's server, by sha

    def call(self, script: Script, keys: Sequence[str], args: Sequence[Arg], patient: bool = False) -> Any:
        """Run ``script`` and return its reply (pending replies are read first, in the same read).

        A lost connection is replaced and the script sent again once; with
        ``patient`` it goes to the client's pool instead, whose retry policy
        rides out a failover (a producer's call, which nothing else retries).
        """
        for attempt in range(2):
            try:
                self._send(script, keys, args)
                self._read_pending()
                return self._read(script, keys, args)
            except (RedisConnectionError, RedisTimeoutError):
                self._reset()
                if patient:
                    return script(self.client, keys, args)
                if attempt:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def send(self, script: Script, keys: Sequence[str], args: Sequence[Arg], on_reply: OnReply) -> None:
        """Send ``script`` now; ``on_reply(reply or exception)`` runs when its reply is read.

        The script is loaded first (once per connection): a NOSCRIPT reply read
        later would mean the write was not made when this returned.
        """
        for attempt in range(2):
            try:
                if script.sha not in self.loaded:
                    self._read_pending()
                    self._connection().send_command("SCRIPT", "LOAD", script.source)
                    self.conn.read_response()
                    self.loaded.add(script.sha)
                self._send(script, keys, args)
                break
            except (RedisConnectionError, RedisTimeoutError):
                self._reset()
                if attempt:
                    raise  # the store is down
        self.pending.append(_Sent(script, keys, args, on_reply))
        if len(self.pending) >= MAX_PENDING:
            self.drain()

    def drain(self) -> None:
        """Read every pending reply."""
        try:
            self._read_pending()
        except (RedisConnectionError, RedisTimeoutError):
            self._reset()

    # -- internals ---------------------------------------------------------------------

    def _connection(self) -> Any:
        if self.conn is None:
            # Made as the pool makes its own, but not counted by it: the pool would count every
            # connection a reset drops for good (redis-py 8 refuses more than 100 by default).
            pool = self.client.connection_pool
            conn: Any = pool.connection_class(**pool.connection_kwargs)
            # A health check would read a pending reply as its PONG: the lane reconnects on errors instead.
            conn.health_check_interval = 0
            # Connect now, through connect(): a Sentinel-managed connection asks the
            # Sentinels for the master there (redis-py's send_command would connect
            # to its default host instead).
            conn.connect()
            self.conn = conn
        return self.conn

    def _send(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> None:
        self._connection().send_command("EVALSHA", script.sha, len(keys), *keys, *args)

    def _read(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        try:
            return self.conn.read_response()
        except NoScriptError:
            script.ensure_loaded(self.client)
            self._send(script, keys, args)
            return self.conn.read_response()

    def _read_pending(self) -> None:
        while self.pending:
            sent = self.pending[0]
            try:
                reply: Any = self.conn.read_response()
            except NoScriptError:  # the server's scripts were flushed: run it again, on the pool
                reply = self._again(sent)
            except ResponseError as exc:
                reply = exc
            self.pending.pop(0)
            sent.on_reply(reply)

    def _again(self, sent: _Sent) -> Any:
        self.loaded.discard(sent.script.sha)
        try:
            return sent.script(self.client, sent.keys, sent.args)
        except Exception as exc:  # the caller logs what could not be recorded
            return exc

    def _reset(self) -> None:
        """Drop the connection; run again, on a new one, what was sent without a reply read."""
        if self.conn is not None:
            self.conn.disconnect()
            self.conn = None
        self.loaded.clear()  # a restarted server has forgotten its scripts
        lost, self.pending = self.pending, []
        for sent in lost:
            try:
                reply: Any = self.call(sent.script, sent.keys, sent.args)
            except Exception as exc:  # the store is down: the caller logs it
                reply = exc
            sent.on_reply(reply)


class ClusterLane:
    """A lane on Redis Cluster: each script waits for its reply on the cluster client.

    A lane's own connection reaches one server; a cluster's shards live on
    several, so :meth:`send` runs the script at once and hands its reply over
    before returning (a round trip per finish, the price of a cluster).
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def call(self, script: Script, keys: Sequence[str], args: Sequence[Arg], patient: bool = False) -> Any:
        """Run ``script`` and return its reply."""
        return script(self.client, keys, args)

    def send(self, script: Script, keys: Sequence[str], args: Sequence[Arg], on_reply: OnReply) -> None:
        """Run ``script``; ``on_reply(reply or ResponseError)`` runs before this returns."""
        try:
            reply: Any = script(self.client, keys, args)
        except ResponseError as exc:
            reply = exc
        on_reply(reply)

    def drain(self) -> None:
        """Nothing is ever pending."""


class Lanes:
    """The lanes of one client: one per thread, and new ones in a forked child."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.local = threading.local()

    def get(self) -> Lane | ClusterLane:
        """This thread's lane."""
        lane: Lane | ClusterLane | None = getattr(self.local, "lane", None)
        pid = os.getpid()
        if lane is None or getattr(self.local, "pid", None) != pid:
            lane = ClusterLane(self.client) if is_cluster(self.client) else Lane(self.client)
            self.local.lane = lane
            self.local.pid = pid
        return lane
