"""``delayed doctor``: check what silently breaks a deployment, and say what to do.

Each check gives a :class:`Finding`: ``ok``, ``warning``, ``problem`` (the
command exits non-zero, so it can be a probe) or ``unchecked`` (it could not
look; not a failure). The store-side checks (:func:`store_findings`) are also
logged by every scheduler at start.

Checks: the store's Redis ``maxmemory-policy`` (anything but ``noeviction``
can evict jobs) and fullness; persistence (AOF); Celery's
``visibility_timeout`` (Redis broker) against the done-marker TTL;
RabbitMQ's ``consumer_timeout`` on the publish path (through the management
API, when reachable); clock skew between this host and Redis; schedulers
alive and holding every shard; settings that disagree with the store's
layout or with the running schedulers; pauses in force; with a database,
its schema and whether it holds this store's jobs or another store's.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from celery import Celery

from .errors import ConfigurationError, DatabaseUnavailable
from .redis_urls import broker_url, is_redis_url
from .store import ServerHealth, Store, get_store
from .store.health import UNCHECKED
from .store.stats import FleetStats

OK, WARNING, PROBLEM, UNCHECKED_LEVEL = "ok", "warning", "problem", "unchecked"
#: Clock skew (host vs the store's Redis) that is worth a warning, and one that is a problem, seconds.
SKEW_WARNING_S, SKEW_PROBLEM_S = 0.5, 2.0
#: Kombu's default visibility_timeout on the Redis transport, seconds.
DEFAULT_VISIBILITY_TIMEOUT_S = 3600
#: RabbitMQ's default consumer_timeout, ms (rabbitmq.conf).
RABBITMQ_DEFAULT_CONSUMER_TIMEOUT_MS = 1_800_000


@dataclass(frozen=True)
class Finding:
    """One check's outcome: its level, what was found, and what to do."""

    level: str
    check: str
    message: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def findings(app: Celery, store: Store | None = None, *, schedulers: bool = True,
             http_timeout_s: float = 2.0) -> list[Finding]:
    """Every check, in order. ``schedulers`` False leaves out the fleet's liveness (a scheduler starting)."""
    store = store or get_store(app)
    out = [*settings_findings(store), *database_findings(store), *store_findings(store, http_timeout_s=http_timeout_s)]
    if schedulers:
        out += fleet_findings(store)
    return out


def failed(found: list[Finding]) -> bool:
    """True when a finding is a problem (``doctor`` then exits 1)."""
    return any(f.level == PROBLEM for f in found)


def settings_findings(store: Store) -> list[Finding]:
    """This app's settings against the store's layout and the running schedulers' settings."""
    try:
        recorded = store.layout.recorded()
        if not recorded:
            return [Finding(OK, "layout", f"no layout recorded under prefix {store.config.key_prefix!r} yet "
                                          "(the first producer or scheduler records it)")]
        store.fleet.check()
    except ConfigurationError as exc:
        return [Finding(PROBLEM, "layout", str(exc), "use the store's settings, or another delayed_key_prefix")]
    return [Finding(OK, "layout", f"delayed_shards={store.layout.shards} and delayed_bucket_ms="
                                  f"{store.config.bucket_ms} match the store; the schedulers' settings agree")]


def database_findings(store: Store) -> list[Finding]:
    """With ``delayed_database_url``: its schema, and whether it holds this store's jobs (not another's)."""
    if not store.config.database_url:
        return []
    from .sql.binding import binding_problem, describe  # SQLAlchemy is an optional extra
    from .sql.rows import get_rows

    try:
        rows = get_rows(store.app)
        assert rows is not None
        rows.check_schema()
        held, problem = binding_problem(store, rows)
    except (ConfigurationError, DatabaseUnavailable) as exc:
        return [Finding(PROBLEM, "database", str(exc))]
    if problem is not None:
        return [Finding(PROBLEM, "database", problem)]
    bound = (f"bound to {describe(held)}" if held
             else "not bound to a store yet (the first producer or scheduler binds it)")
    return [Finding(OK, "database", f"{rows.url_shown}: schema current, {bound}")]


def store_findings(store: Store, *, http_timeout_s: float = 2.0) -> list[Finding]:
    """The store's server, persistence, the clocks, and the broker's timeouts."""
    health = ServerHealth(store)
    out: list[Finding] = []
    for w in health.warnings():
        out.append(Finding(UNCHECKED_LEVEL if w.startswith(UNCHECKED) else PROBLEM, "memory", w))
    try:
        info = health.info()
    except Exception as exc:  # an ACL user without INFO: said above
        info = {}
        out.append(Finding(UNCHECKED_LEVEL, "persistence", f"{UNCHECKED}: {exc}"))
    if not out:
        out.append(Finding(OK, "memory", f"maxmemory-policy {info.get('maxmemory_policy', 'noeviction')}"))
    if info:
        if int(info.get("aof_enabled", 0)):
            out.append(Finding(OK, "persistence", "AOF on"))
        else:
            # A warning, not a problem: a development Redis rightly keeps nothing on disk, and a correct
            # development setup must not look broken. Production needs the AOF: said in words.
            out.append(Finding(
                WARNING, "persistence",
                "the store's Redis has AOF off: fine for development, but in production a restart loses every "
                "job written since the last RDB snapshot (or all of them without one)",
                "for production: CONFIG SET appendonly yes (and appendonly yes in redis.conf), appendfsync everysec"))
    out.append(_skew(store))
    out += _replication(store, health)
    out += _broker_timeouts(store, http_timeout_s)
    return out


def _replication(store: Store, health: ServerHealth) -> list[Finding]:
    """The store's replicas against ``delayed_wait_replicas`` (nothing for a lone server without it)."""
    wanted = store.config.wait_replicas
    try:
        online = health.replicas()
    except Exception as exc:  # an ACL user without INFO
        return [Finding(UNCHECKED_LEVEL, "replication", f"{UNCHECKED}: {exc}")] if wanted else []
    if wanted > online:
        return [Finding(PROBLEM, "replication",
                        f"delayed_wait_replicas is {wanted} but the store's master has {online} replica(s) online: "
                        "every schedule, cancel and reschedule raises ReplicationTimeout",
                        "start the replicas, or lower delayed_wait_replicas")]
    if wanted and wanted == online:
        return [Finding(WARNING, "replication",
                        f"delayed_wait_replicas is {wanted} and the master has exactly {online} replica(s): after a "
                        "failover the new master has one fewer, and writes raise ReplicationTimeout until a "
                        "replica is back", f"run {wanted + 1} replicas or more")]
    if wanted:
        return [Finding(OK, "replication", f"{online} replica(s) online; writes wait for {wanted}")]
    if online:
        return [Finding(OK, "replication",
                        f"{online} replica(s) online, replicated asynchronously: a failover can lose the writes "
                        "acknowledged in the replication lag (delayed_wait_replicas makes writes wait; see "
                        "Redis Sentinel in the README)")]
    return []


def _skew(store: Store) -> Finding:
    t0 = time.time()
    server_ms = store.redis.now_ms()
    t1 = time.time()
    skew_s = server_ms / 1000.0 - (t0 + t1) / 2
    shown = f"this host's clock is {abs(skew_s):.3f} s {'behind' if skew_s > 0 else 'ahead of'} the store's Redis"
    fix = "run NTP (chrony, systemd-timesyncd) on this host and on the Redis host"
    if abs(skew_s) >= SKEW_PROBLEM_S:
        return Finding(PROBLEM, "clock", f"{shown}: due times given as datetimes, Celery's own eta and "
                                         "expires, and what monitors show are off by that much", fix)
    if abs(skew_s) >= SKEW_WARNING_S:
        return Finding(WARNING, "clock", shown, fix)
    return Finding(OK, "clock", f"{shown} (release uses the Redis clock)")


def _broker_timeouts(store: Store, http_timeout_s: float) -> list[Finding]:
    app, cfg = store.app, store.config
    url = broker_url(app.conf)
    scheme = urllib.parse.urlsplit(url).scheme
    if is_redis_url(url):  # kombu's Sentinel transport is its Redis transport: the same visibility_timeout
        opts = app.conf.broker_transport_options or {}
        vt = float(opts.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT_S))
        if cfg.done_ttl_s < vt:
            return [Finding(
                PROBLEM, "visibility_timeout",
                f"broker_transport_options visibility_timeout is {vt:g} s but delayed_done_ttl_s is "
                f"{cfg.done_ttl_s} s: a message redelivered after its done marker expired runs again",
                f"set delayed_done_ttl_s above {vt:g} (or lower visibility_timeout)")]
        return [Finding(OK, "visibility_timeout", f"visibility_timeout {vt:g} s is shorter than the done-marker TTL "
                                                  f"({cfg.done_ttl_s} s): a redelivered finished job is dropped")]
    if scheme in ("amqp", "amqps", "pyamqp"):
        return [_consumer_timeout(app, url, cfg.rabbitmq_api_url, http_timeout_s)]
    return [Finding(OK, "broker", f"broker {scheme or 'unset'}: no broker timeout to check")]


def _consumer_timeout(app: Celery, amqp_url: str, api_url: str | None, timeout_s: float) -> Finding:
    """RabbitMQ's consumer_timeout for the app's queues, read through the management API."""
    parts = urllib.parse.urlsplit(amqp_url)
    if api_url is None:
        user = urllib.parse.unquote(parts.username or "guest")
        password = urllib.parse.unquote(parts.password or "guest")
        api_url = f"http://{user}:{password}@{parts.hostname or '127.0.0.1'}:15672"
    api = urllib.parse.urlsplit(api_url)
    base = f"{api.scheme}://{api.hostname}:{api.port or 15672}{api.path.rstrip('/')}"
    auth = base64.b64encode(f"{urllib.parse.unquote(api.username or 'guest')}:"
                            f"{urllib.parse.unquote(api.password or 'guest')}".encode()).decode()
    vhost = urllib.parse.unquote(parts.path[1:]) if parts.path not in ("", "/") else "/"

    def get(path: str) -> Any:
        req = urllib.request.Request(base + path, headers={"Authorization": f"Basic {auth}"})
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read().decode())

    try:
        overview = get("/api/overview")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return Finding(UNCHECKED_LEVEL, "consumer_timeout",
                       f"could not check RabbitMQ's consumer_timeout: its management API at {base} did not answer "
                       f"({exc})", "enable rabbitmq_management, or set delayed_rabbitmq_api_url")
    queues = sorted({app.conf.task_default_queue, *(q.name for q in (app.amqp.queues or {}).values())})
    found = []
    for name in queues:
        try:
            q = get(f"/api/queues/{urllib.parse.quote(vhost, safe='')}/{urllib.parse.quote(name, safe='')}")
        except (urllib.error.URLError, OSError, ValueError):
            continue  # not declared yet
        arg = (q.get("arguments") or {}).get("x-consumer-timeout")
        pol = (q.get("effective_policy_definition") or {}).get("consumer-timeout")
        values = [int(v) for v in (arg, pol) if isinstance(v, (int, float))]
        if values:
            found.append(f"{name}: {min(values)} ms (queue {'argument' if arg is not None else 'policy'})")
    version = overview.get("rabbitmq_version") or overview.get("management_version") or "?"
    per_queue = "; ".join(found) if found else "no queue sets its own (x-consumer-timeout / consumer-timeout policy)"
    return Finding(
        OK, "consumer_timeout",
        f"RabbitMQ {version}: consumer_timeout per queue: {per_queue}; otherwise the node's consumer_timeout "
        f"(rabbitmq.conf, {RABBITMQ_DEFAULT_CONSUMER_TIMEOUT_MS} ms unless changed; the management API does not "
        "show it). Delayed jobs wait in the store, not in workers, so only a task that runs longer than it "
        "(acks_late) has its channel closed and is delivered again (the execution record drops the copy)",
        "raise consumer_timeout above your longest task when tasks use acks_late")


def fleet_findings(store: Store) -> list[Finding]:
    """Schedulers alive and holding every shard; pauses in force."""
    snap = FleetStats(store).snapshot()
    out = []
    if not snap.schedulers:
        out.append(Finding(PROBLEM, "schedulers", "no scheduler is running: no job is released",
                           "run `celery -A proj delayed run` (or a worker with --delayed)"))
    elif snap.unowned_shards:
        out.append(Finding(PROBLEM, "schedulers",
                           f"{len(snap.unowned_shards)} of {snap.shards} shards are held by no live scheduler "
                           f"({snap.unowned_shards[:10]}{'...' if len(snap.unowned_shards) > 10 else ''})",
                           "wait one delayed_lease_ms for a takeover; if it persists, restart the schedulers"))
    else:
        held = {m: len(s) for m, s in snap.shards_of().items()}
        out.append(Finding(OK, "schedulers", f"{len(snap.schedulers)} live scheduler(s) hold all {snap.shards} "
                                             f"shards: {', '.join(f'{m} ({n})' for m, n in held.items())}"))
    if snap.paused:
        out.append(Finding(WARNING, "paused", f"release is paused for {', '.join(sorted(snap.paused))} "
                                              f"({snap.held} due job(s) held)", "`celery -A proj delayed resume`"))
    if snap.oldest_overdue_ms > 60_000:
        out.append(Finding(WARNING, "backlog", f"{snap.overdue} job(s) overdue, the oldest by "
                                               f"{snap.oldest_overdue_ms / 1000:.0f} s",
                           "check the schedulers' logs; add schedulers or raise delayed_batch_size"))
    return out
