"""Test code that schedules delayed tasks, in milliseconds and without a worker or scheduler.

:class:`DelayedTestKit` keeps an app's store on a Redis server of the test's
own (a private ``redis-server`` it starts, or a URL it is given, never the
app's configured Redis) under a key prefix of its own, gives the store a
controllable clock (:class:`DelayedClock`, frozen at the start) that every
store operation takes as "now", and runs due jobs in-process as a worker
would::

    with DelayedTestKit(app) as kit:
        remind.apply_later(args=(42,), when=timedelta(hours=1))
        kit.assert_scheduled(remind, args=(42,), at=kit.clock.now() + timedelta(hours=1))
        assert kit.run_due() == []            # nothing is due yet
        kit.clock.advance(hours=1)
        [job] = kit.run_due()                 # runs remind(42) here, now
        assert job.state == "SUCCESS"

A job runs through Celery's own tracer with the request a worker would
build from its message (not eagerly): ``DelayedTask``'s worker side works as
in production (the execution record, cancellation, ``retry``/``retry_later``
and backoff through the store, the dead-letter queue), so a retry is a
scheduled job again, due by the kit's clock. The pytest plugin
(:mod:`celery_delayed.testing.plugin`) wraps this class in fixtures; a
``unittest`` test uses it directly (``setUp``/``tearDown`` or
``enterContext``).

Limits: the store must be Redis-only (no ``delayed_database_url``); the
broker is never used (released jobs stay in the kit until run); code that
reads ``datetime.now()`` itself sees the real clock, not the kit's (combine
with a time-freezing library if it must agree).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.app.trace import trace_task
from kombu.serialization import loads

from ..config import DelayedConfig, set_config
from ..errors import ConfigurationError
from ..store import Pending, Store, set_store
from ..vocab import Field
from ..worker.tracking import track_plain_tasks
from .servers import RedisServer

if TYPE_CHECKING:  # imported when first used: the kit needs the scheduler only for recurring schedules
    from ..schedules.keeper import Recurrer

__all__ = ["DelayedClock", "DelayedTestKit", "RanJob", "ScheduledJob"]

#: The hostname the kit's in-process "worker" gives its requests.
HOSTNAME = "celery-delayed-testkit"
#: The environment variable naming a Redis server that tests may use (the pytest plugin reads it too).
TEST_REDIS_ENV = "DELAYED_TEST_REDIS_URL"
#: The app's settings that describe its own Redis deployment (Sentinels, a cluster, replicas to wait
#: for), not the test server's: the kit leaves them out of its store's config.
_DEPLOYMENT_SETTINGS = {"delayed_redis_options": None, "delayed_redis_cluster": "auto", "delayed_wait_replicas": 0}


def _ms(at: datetime | float | int) -> int:
    """Epoch ms of an aware datetime (naive: UTC) or of epoch seconds."""
    if isinstance(at, datetime):
        if at.tzinfo is None:
            at = at.replace(tzinfo=timezone.utc)
        return round(at.timestamp() * 1000)
    return round(float(at) * 1000)


class DelayedClock:
    """The store's clock in a test: frozen, moved only by :meth:`advance` and :meth:`set`.

    Every store operation (scheduling with a delay, what is due, leases,
    retries' backoff) reads it instead of the Redis server's clock.

    Args:
        start: the initial time (an aware datetime, or epoch seconds);
            default: the real time now, to the millisecond.
    """

    def __init__(self, start: datetime | float | None = None) -> None:
        if start is None:
            start = datetime.now(timezone.utc)
        self._ms = _ms(start)

    def __call__(self) -> int:
        """The time, epoch ms (the store's clock hook)."""
        return self._ms

    def now_ms(self) -> int:
        """The time, epoch ms."""
        return self._ms

    def now(self) -> datetime:
        """The time, an aware datetime in UTC."""
        return datetime.fromtimestamp(self._ms / 1000, timezone.utc)

    def set(self, at: datetime | float) -> None:
        """Set the time (an aware datetime, or epoch seconds); it may go back."""
        self._ms = _ms(at)

    def advance(self, seconds: float | timedelta = 0, **parts: float) -> datetime:
        """Move the time forward by ``seconds`` (or a timedelta, or ``timedelta`` keywords:
        ``advance(hours=1)``); return the new time."""
        delta = seconds if isinstance(seconds, timedelta) else timedelta(seconds=seconds)
        delta += timedelta(**parts)
        if delta < timedelta(0):
            raise ValueError(f"advance() moves forward only, got {delta}; use set() to go back")
        self._ms += round(delta.total_seconds() * 1000)
        return self.now()


@dataclasses.dataclass(frozen=True)
class ScheduledJob:
    """A job waiting in the store, as a test sees it."""

    id: str
    task: str
    #: the positional arguments, a tuple (as given to ``apply_later``; the message's JSON keeps a list)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    due: datetime
    queue: str
    state: str

    @property
    def due_ms(self) -> int:
        """The due time, epoch ms."""
        return _ms(self.due)


@dataclasses.dataclass(frozen=True)
class RanJob:
    """One job run by :meth:`DelayedTestKit.run_due`: Celery's outcome and the job's record state."""

    id: str
    task: str
    #: the positional arguments the task was called with, a tuple
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: Celery's state of the run: SUCCESS, RETRY, FAILURE, IGNORED, REJECTED
    state: str
    #: what the task returned (SUCCESS), else None
    result: Any
    #: the exception of a FAILURE or RETRY, else None
    exception: BaseException | None
    #: the job's state in the store after the run (SUCCEEDED, SCHEDULED for a retry, DEAD, ...)
    job_state: str


def _name(task: Any) -> str:
    """A task's name, from the task or its name."""
    name = task if isinstance(task, str) else getattr(task, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"expected a task or a task name, got {task!r}")
    return name


class DelayedTestKit:
    """Schedule, release and run an app's delayed jobs in a test, by a controllable clock.

    Args:
        app: the Celery app under test (its tasks, its ``delayed_*`` settings).
        redis_url: a Redis server the test may use for the store (the kit
            keeps its keys under its own prefix and deletes them on close).
            None: ``$DELAYED_TEST_REDIS_URL`` when set, else a private
            ``redis-server`` on a free port, started now and stopped on
            close. Never the app's own ``delayed_redis_url`` or broker.
        key_prefix: the store's key prefix (default: a new unique one, so
            tests never see each other's jobs on one server).
        start: the clock's initial time, an aware datetime or epoch seconds
            (default: now).

    Raises:
        ConfigurationError: the app's settings are wrong, it has
            ``delayed_database_url`` (the kit runs on Redis only), or no
            Redis was named and ``redis-server`` is not installed.

    The kit installs its store on the app (so ``apply_later``, ``cancel``,
    handles and the worker side use it) until :meth:`close`; use it as a
    context manager. The app's settings that describe its own Redis
    deployment (``delayed_redis_options``, ``delayed_redis_cluster``,
    ``delayed_wait_replicas``) do not apply to the test server. A server
    takes a few tens of milliseconds to start: many tests share one (the
    pytest fixtures do; or pass a
    :class:`~celery_delayed.testing.servers.RedisServer`'s ``url``).
    """

    def __init__(self, app: Celery, redis_url: str | None = None, *, key_prefix: str | None = None,
                 start: datetime | float | None = None) -> None:
        self.app = app
        url = redis_url or os.environ.get(TEST_REDIS_ENV) or None
        #: The private redis-server the kit started (None: it was given a URL).
        self.server: RedisServer | None = None
        self._stop_server: Callable[[], object] = lambda: None
        if url is None:
            self.server = _private_server()
            # Stopped by close(), or when the kit is collected or the interpreter exits without it.
            self._stop_server = weakref.finalize(self, _discard, self.server)
            url = self.server.url
        try:
            config = _read_config(app, url)
            if config.database_url:
                raise ConfigurationError("DelayedTestKit runs on Redis only: unset delayed_database_url in tests")
        except BaseException:
            self._stop_server()
            raise
        config = dataclasses.replace(config, key_prefix=key_prefix or f"dt{uuid.uuid4().hex[:12]}")
        self.clock = DelayedClock(start)
        self.store = Store(app, config)
        self.store.redis.clock = self.clock
        self._previous_config = set_config(app, config)
        self._previous = set_store(app, self.store)
        track_plain_tasks(app)  # as a worker does at start: plain tasks given to apply_later are tracked too
        #: released and not yet run: (shard, id, envelope, exchange, routing key)
        self.released: list[tuple[int, str, str, str, str]] = []
        self._recurrer: Recurrer | None = None  # made on first use
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Give the app its previous store back and drop this kit's keys, or stop its own server (idempotent)."""
        if self._closed:
            return
        self._closed = True
        set_store(self.app, self._previous)
        set_config(self.app, self._previous_config)
        try:
            if self.server is None:
                self.store.drop_everything()
            self.store.redis.close()
        finally:
            self._stop_server()  # its own server: the data goes with its folder

    def __enter__(self) -> DelayedTestKit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what is scheduled ---------------------------------------------------------------

    def scheduled_jobs(self, task: Any = None) -> list[ScheduledJob]:
        """The jobs waiting in the store (SCHEDULED), earliest due first; of one task when given."""
        name = None if task is None else _name(task)
        rows: list[dict[str, Any]] = []
        page = 0
        while True:
            got = Pending(self.store).page(name, offset=page * 500, limit=500)
            rows += got
            if len(got) < 500:
                break
            page += 1
        messages = self.store.lookup.messages([(int(r["shard"]), str(r["id"])) for r in rows])
        out = []
        for row, msg in zip(rows, messages, strict=True):
            args, kwargs = _arguments(msg)[:2] if msg is not None else ([], {})
            out.append(ScheduledJob(str(row["id"]), str(row["task"]), tuple(args), kwargs,
                                    datetime.fromtimestamp(int(row["due"]) / 1000, timezone.utc),
                                    str(row["queue"]), str(row[Field.STATE])))
        return out

    def _matching(self, task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None,
                  at: datetime | None, tolerance: timedelta) -> tuple[list[ScheduledJob], list[ScheduledJob]]:
        jobs = self.scheduled_jobs(task)
        hits = [j for j in jobs
                if (args is None or j.args == tuple(args))
                and (kwargs is None or j.kwargs == dict(kwargs))
                and (at is None or abs(j.due_ms - _ms(at)) <= tolerance.total_seconds() * 1000)]
        return hits, jobs

    def assert_scheduled(self, task: Any, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
                         at: datetime | None = None, tolerance: timedelta = timedelta(seconds=1)) -> ScheduledJob:
        """Assert that a job of ``task`` waits with these arguments (those given) due ``at``
        (within ``tolerance``); return it (the first one, by due time).

        Raises:
            AssertionError: none does; the message lists what is scheduled.
        """
        hits, jobs = self._matching(task, args, kwargs, at, tolerance)
        if not hits:
            want = ", ".join(f"{k}={v!r}" for k, v in (("args", args), ("kwargs", kwargs), ("at", at))
                             if v is not None)
            raise AssertionError(f"no job of {_name(task)} is scheduled with {want or 'any arguments'}; "
                                 f"scheduled: {_describe(jobs)}")
        return hits[0]

    def assert_not_scheduled(self, task: Any, args: Sequence[Any] | None = None,
                             kwargs: Mapping[str, Any] | None = None) -> None:
        """Assert that no job of ``task`` waits with these arguments (any, when none are given).

        Raises:
            AssertionError: one does.
        """
        hits, _ = self._matching(task, args, kwargs, None, timedelta(0))
        if hits:
            raise AssertionError(f"{len(hits)} job(s) of {_name(task)} scheduled: {_describe(hits)}")

    # -- release and run ---------------------------------------------------------------

    def release_due(self) -> list[str]:
        """Release every job due by the kit's clock (as a scheduler would); return their ids.

        Released jobs are QUEUED in the store and kept in :attr:`released`
        (the kit's broker) until :meth:`run_released` runs them. Jobs whose
        ``expires`` or ``max_lateness`` passed are not released, as in
        production.
        """
        self.tick_schedules()
        ids = []
        for shard in self.store.layout.shard_range():
            while True:
                batch = self.store.release.claim_due(shard)
                if not batch.count and not batch.skipped:  # (a batch of expired jobs only: more may follow)
                    break
                for jid, (msg, ex, rk, _q) in zip(batch.ids, batch.messages, strict=True):
                    self.released.append((shard, str(jid), str(msg), str(ex or ""), str(rk or "")))
                    ids.append(str(jid))
                self.store.release.ack_claimed(shard, batch.ids)
        return ids

    def tick_schedules(self) -> int:
        """Store the recurring schedules' occurrences due soon by the kit's clock, as a scheduler
        would (``delayed_schedule`` and run-time ones); :meth:`release_due` does it first. Returns
        how many occurrences were stored."""
        from ..schedules.keeper import Recurrer  # the scheduler's keeper of recurring schedules

        if self._recurrer is None:
            shards = dict.fromkeys(self.store.layout.shard_range(), "")  # '': no lease to hold
            self._recurrer = Recurrer(self.app, self.store, "", lambda: shards)
        return self._recurrer.tick(fresh=True)

    def run_released(self, propagate: bool = False) -> list[RanJob]:
        """Run the released jobs in this thread, in release order, as a worker would.

        ``propagate``: raise the exception of the first job that failed for
        good (Celery state FAILURE) after running them all.
        """
        ran = []
        while self.released:
            shard, jid, msg, ex, rk = self.released.pop(0)
            ran.append(self._run(shard, jid, msg, ex, rk))
        if propagate:
            for job in ran:
                if job.state == "FAILURE" and job.exception is not None:
                    raise job.exception
        return ran

    def run_due(self, propagate: bool = False, max_rounds: int = 100) -> list[RanJob]:
        """Release what is due by the kit's clock and run it here; again while that made more jobs due
        (a retry with no delay), up to ``max_rounds``. Returns every run, in order.

        The clock does not move: a retry with a backoff runs after
        ``kit.clock.advance(...)`` and another ``run_due()``.
        """
        ran: list[RanJob] = []
        for _ in range(max_rounds):
            if not self.release_due():
                break
            ran += self.run_released(propagate)
        return ran

    def _run(self, shard: int, jid: str, msg: str, ex: str, rk: str) -> RanJob:
        env = json.loads(msg)
        headers, props = dict(env.get("headers") or {}), dict(env.get("properties") or {})
        args, kwargs, embed = _arguments(msg)
        name = str(headers.get("task") or "")
        task = self.app.tasks[name]
        request: dict[str, Any] = {
            **headers,
            "properties": props, "reply_to": props.get("reply_to"), "correlation_id": props.get("correlation_id"),
            "hostname": HOSTNAME,
            "delivery_info": {"exchange": ex, "routing_key": rk, "priority": props.get("priority"),
                              "redelivered": False, "delivery_tag": props.get("delivery_tag")},
            "args": args, "kwargs": kwargs, "is_eager": False, "loglevel": None, "logfile": None,
            **(embed or {}),
        }
        retval, info, _, _ = trace_task(task, headers.get("id") or jid, args, kwargs, request,
                                        hostname=HOSTNAME, loader=self.app.loader, app=self.app)
        self.store.executions.drain_replies()  # a success is recorded without waiting: have it recorded now
        state = info.state if info is not None else "SUCCESS"
        exc = getattr(info, "retval", None) if info is not None else None
        exc = getattr(exc, "exception", exc)
        cause = getattr(exc, "exc", None)
        if state == "RETRY" and isinstance(cause, BaseException):
            exc = cause  # Celery's Retry: the exception that caused it
        rec = self.store.lookup.records(shard, [jid]).get(jid) or {}
        return RanJob(jid, name, tuple(args), kwargs, state, retval if info is None else None,
                      exc if isinstance(exc, BaseException) else None, str(rec.get(Field.STATE, "")))

    # -- conveniences --------------------------------------------------------------------

    def job_state(self, job_id: str) -> str | None:
        """The state of a job's record (None: no record)."""
        try:
            return str(self.store.lookup.get(job_id).get(Field.STATE))
        except LookupError:
            return None


def _private_server() -> RedisServer:
    """A private redis-server on a free port, started; a clear error when the binary is missing."""
    try:
        server = RedisServer(own_session=True)  # a Ctrl-C reaches the test, which stops the server on close
    except FileNotFoundError as exc:
        raise ConfigurationError(
            "DelayedTestKit needs a Redis server of its own and none was given: redis-server is not installed "
            "(Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis). Install it (the kit "
            "then starts one on a free port), or pass redis_url= a Redis server the tests may use, or set "
            f"{TEST_REDIS_ENV}. The kit never uses the app's own Redis unless given its URL") from exc
    return server.start()


def _discard(server: RedisServer) -> None:
    """Stop a private server at once (SIGKILL: it keeps nothing, and SIGTERM waits for its next tick)."""
    server.stop("kill")
    server.close()


def _read_config(app: Celery, redis_url: str) -> DelayedConfig:
    """The app's settings, with the store on ``redis_url`` (its deployment's Redis settings left out)."""
    missing = object()
    overrides: dict[str, Any] = {"delayed_redis_url": redis_url, **_DEPLOYMENT_SETTINGS}
    old = {name: app.conf.get(name, missing) for name in overrides}
    try:
        for name, value in overrides.items():
            app.conf[name] = value
        return DelayedConfig.from_app(app)
    finally:
        for name, value in old.items():
            if value is missing:
                app.conf.pop(name, None)
            else:
                app.conf[name] = value


def _arguments(msg: str) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """(args, kwargs, embed) of a kombu envelope (protocol 2), decoded with its serializer."""
    env = json.loads(msg)
    props = env.get("properties") or {}
    body: Any = env["body"]
    if props.get("body_encoding") == "base64":
        body = base64.b64decode(body)
    payload = loads(body, env.get("content-type"), env.get("content-encoding"), accept=None)
    if isinstance(payload, (list, tuple)) and len(payload) == 3:
        args, kwargs, embed = payload
        return list(args), dict(kwargs), dict(embed or {})
    return [], {}, {}  # protocol 1 bodies are not produced by celery-delayed


def _describe(jobs: Iterable[ScheduledJob]) -> str:
    items = [f"{j.task}(args={j.args!r}, kwargs={j.kwargs!r}) due {j.due.isoformat()} [{j.id}]" for j in jobs]
    return "; ".join(items[:20]) + (" ..." if len(items) > 20 else "") if items else "nothing"
