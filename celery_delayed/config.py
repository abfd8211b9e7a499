"""Settings: ``delayed_*`` keys on ``app.conf``, read once per app into a frozen object.

Every setting is one row of :data:`SETTINGS` (name, type, default, bounds,
meaning); validation, the defaults and the docs' settings reference (generated
by ``docs/_ext/delayed_docs.py`` at build time) all come from it.
Precedence for the options a task or a call may override, as Celery's own
``Task.from_config``: call option > task attribute > setting > default
(:func:`resolve`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from celery import Celery

from .errors import ConfigurationError
from .rate_limits import parse_limits
from .redis_urls import broker_url, is_redis_url, is_sentinel_url, redact, sentinel_hosts

_DAY_S = 86_400
_YEAR_S = 365 * _DAY_S


@dataclass(frozen=True)
class Setting:
    """One ``delayed_*`` setting: its type, default, bounds and meaning."""

    key: str  # the attribute of DelayedConfig; the setting is "delayed_" + key
    kind: type
    default: Any
    doc: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    nullable: bool = False  # None is a value of its own (not "the default")
    unit: str = ""

    @property
    def name(self) -> str:
        """The ``app.conf`` key."""
        return f"delayed_{self.key}"

    def read(self, conf: Any) -> Any:
        """The validated value of this setting in ``conf``."""
        value = conf.get(self.name, None)
        if value is None:
            return self.default
        return self.check(value)

    def check(self, value: Any) -> Any:
        """Validate one value; raise :class:`ConfigurationError` when it is wrong."""
        what = self._describe()
        if self.kind is dict:
            if not isinstance(value, dict):
                raise ConfigurationError(f"{self.name} must be a dict, got {type(value).__name__} {value!r}")
            return value
        if self.kind is bool:  # choices: strings accepted besides True and False ("auto")
            if not isinstance(value, bool) and not (isinstance(value, str) and value in self.choices):
                allowed = ", ".join(["True", "False", *map(repr, self.choices)][:-1])
                last = repr(self.choices[-1]) if self.choices else "False"
                raise ConfigurationError(
                    f"{self.name} must be {allowed} or {last}, got {type(value).__name__} {value!r}")
            return value
        if self.kind is dict:
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise ConfigurationError(f"{self.name} must be a dict with str keys, got {type(value).__name__}")
            return dict(value)
        if self.kind is tuple:  # names, each one of choices
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ConfigurationError(
                    f"{self.name} must be a list of names, got {type(value).__name__} {value!r}")
            unknown = [v for v in value if v not in self.choices]
            if unknown:
                raise ConfigurationError(
                    f"{self.name} has unknown name(s) {unknown}; the known names are {', '.join(self.choices)}")
            return tuple(value)
        if self.kind is str:
            if not isinstance(value, str):
                raise ConfigurationError(f"{self.name} must be a string, got {type(value).__name__} {value!r}")
            if self.choices and value not in self.choices:
                raise ConfigurationError(f"{self.name} must be one of {self.choices}, got {value!r}")
            return value
        numeric = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric) or not math.isfinite(value):
            raise ConfigurationError(f"{self.name} must be {what}, got {type(value).__name__} {value!r}")
        if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
            raise ConfigurationError(f"{self.name} must be {self._bounds()}, got {value}")
        return self.kind(value)

    def _describe(self) -> str:
        noun = "an int" if self.kind is int else "a number"
        bounds = self._bounds()
        return f"{noun} {bounds}" if bounds else noun

    def _bounds(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"between {_num(self.lo)} and {_num(self.hi)}"
        if self.lo is not None:
            return f">= {_num(self.lo)}"
        return ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


#: The fixups of :mod:`celery_delayed.fixups`, by name (``delayed_disabled_fixups`` names some of them).
FIXUP_NAMES = ("reconnect_guard", "prompt_timers", "eta_cycle", "held_restore")

#: Every setting. The docs' settings reference is generated from this table.
SETTINGS: tuple[Setting, ...] = (
    Setting("redis_url", str, None, "Redis holding the store (`redis://`, `rediss://`, `unix://`, or "
            "`sentinel://host:port;sentinel://host:port`). Required when the broker is not Redis.", nullable=True),
    Setting("redis_options", dict, None, "with a `sentinel://` store URL: `master_name` (required), and optionally "
            "`sentinel_kwargs` (the Sentinels' own password, TLS), `min_other_sentinels`, and options of the "
            "master's connections (`ssl`, `ssl_ca_certs`, `password` ...), as kombu's broker transport options; "
            "`None` = the broker's when the store is the broker (see Redis Sentinel)", nullable=True),
    Setting("wait_replicas", int, 0, "scheduling, cancelling, rescheduling and the worker's execution records wait "
            "until this many replicas have the write (Redis `WAIT`), so an acknowledged job, and a run's record, "
            "survive a failover; `0` = do not wait",
            lo=0, hi=100),
    Setting("wait_replicas_timeout_ms", int, 1000, "how long a write waits for `delayed_wait_replicas` replicas "
            "before it raises `ReplicationTimeout`", lo=1, hi=600_000, unit="ms"),
    Setting("redis_cluster", bool, "auto", "`True`: `delayed_redis_url` names any node of a Redis Cluster (db 0): "
            "the store uses redis-py's cluster client, its shards spread over every master, and release takes the "
            "publish path (see Redis Cluster); `\"auto\"`: asks the server once (`INFO cluster`) when the store's "
            "client is made; `False`: a single server, not asked", choices=("auto",)),
    Setting("key_prefix", str, "delayed", "prefix of every store key (no braces, `\\|` or spaces)"),
    Setting("shards", int, 16,
            "number of shards; a job's shard is `crc32(shard_key or job id) % shards`; recorded in the store "
            "when it is created (a process configured otherwise is refused): `delayed reshard --shards N` "
            "changes it live",
            lo=1, hi=16384),
    Setting("bucket_ms", int, 0, "time-bucket width inside a shard; `0` = one sorted set per shard",
            lo=0, hi=86_400_000, unit="ms"),
    Setting("release_mode", str, "auto", "`\"direct\"`, `\"publish\"` or `\"auto\"` (see How release works)",
            choices=("auto", "direct", "publish")),
    Setting("batch_size", int, 500, "most jobs one release call moves", lo=1, hi=100_000),
    Setting("lookahead_ms", int, 2000, "release a job up to this long before it is due (at least this long less "
            "250 ms, or half of it under 500 ms), with Celery's `eta` set to its due time: the worker already "
            "holds it when the moment comes (`0` = release when due); a debounced job is always released when due",
            lo=0, hi=60_000, unit="ms"),
    Setting("lease_ms", int, 30_000, "scheduler membership lease: a dead scheduler's shards move to the others "
            "after this; heartbeat every quarter of it", lo=500, hi=3_600_000, unit="ms"),
    Setting("claim_lease_ms", int, 60_000, "publish path: time to publish a claimed job before it is claimed again",
            lo=500, hi=86_400_000, unit="ms"),
    Setting("publish_max_refusals", int, 5, "publish path: a message the broker refuses (no such exchange, too "
            "large, nacked) is put back at once, and dead-lettered after this many refusals", lo=1, hi=1000),
    Setting("record_ttl_s", int, 7 * _DAY_S, "how long a released or cancelled job's record stays readable",
            lo=1, hi=10 * _YEAR_S, unit="s"),
    Setting("max_payload_bytes", int, 1 << 20, "largest message `apply_later` accepts",
            lo=256, hi=512 << 20, unit="bytes"),
    Setting("exec_lease_ms", int, 30_000, "worker side: execution lease of a running job, extended by a heartbeat "
            "every third of it; a dead worker's job can be taken over by its redelivery after this",
            lo=300, hi=86_400_000, unit="ms"),
    Setting("done_ttl_s", int, _DAY_S, "how long a succeeded job's record (the done marker) turns a redelivery "
            "into a no-op", lo=1, hi=10 * _YEAR_S, unit="s"),
    Setting("idempotency_ttl_s", int, _DAY_S, "how long a finished job scheduled with an `idempotency_key` keeps "
            "the key reserved (the longer of the two TTLs applies)", lo=1, hi=10 * _YEAR_S, unit="s"),
    Setting("max_attempts", int, 4, "attempts of a job (first run + retries) before it is dead-lettered",
            lo=1, hi=10_000),
    Setting("backoff", str, "exponential", "retry backoff: `exponential` (full jitter), `equal`, `decorrelated`, "
            "`fixed`", choices=("exponential", "equal", "decorrelated", "fixed")),
    Setting("backoff_base_s", float, 1.0, "first retry delay before jitter", lo=0.0, hi=float(_YEAR_S), unit="s"),
    Setting("backoff_factor", float, 2.0, "growth of the delay per retry (≥ 1)", lo=1.0, hi=1000.0),
    Setting("backoff_cap_s", float, 600.0, "longest retry delay", lo=0.0, hi=float(_YEAR_S), unit="s"),
    Setting("backoff_seed", int, None, "seed the jitter (per job and retry) for reproducible delays; `None` = random",
            nullable=True),
    Setting("dlq_max_age_s", int, 30 * _DAY_S, "dead letters older than this are trimmed",
            lo=1, hi=10 * _YEAR_S, unit="s"),
    Setting("dlq_max_len", int, 10_000, "most dead letters kept, over all shards (each keeps "
            "`ceil(max_len / shards)`)", lo=1, hi=10_000_000),
    Setting("dlq_queue", str, None, "also send each dead letter, as task `delayed_dlq_task`, to this Celery queue",
            nullable=True),
    Setting("dlq_task", str, "celery_delayed.dead_letter", "task name of those messages"),
    Setting("dlq_all_failures", bool, False, "dead-letter every final failure, not only jobs that ran out of "
            "attempts"),
    Setting("misfire", str, "run", "a job released later than its max lateness: `\"run\"`, `\"skip\"` or `\"dead\"`",
            choices=("run", "skip", "dead")),
    Setting("max_lateness_s", float, None, "default max lateness; `None` = no limit", lo=0.0, hi=float(_YEAR_S),
            nullable=True, unit="s"),
    Setting("database_url", str, None, "a SQLAlchemy URL (PostgreSQL with psycopg 3, SQLite): every job is a row "
            "there first, Redis is its time index (see Durability); `None` = Redis only", nullable=True),
    Setting("reconcile_interval_s", float, 60.0, "how often a scheduler runs the reconciler (one at a time)",
            lo=1.0, hi=float(_DAY_S), unit="s"),
    Setting("requeue_after_s", float, 300.0, "a released job not started this long after its due time, whose "
            "message is nowhere, is released again", lo=1.0, hi=float(30 * _DAY_S), unit="s"),
    Setting("intercept_eta", bool, False, "route `apply_async(eta=/countdown=)` and `Task.retry(countdown=)` of "
            "every task through the store (see Adopting without changing call sites)"),
    Setting("intercept_min_delay_s", float, 1.0, "with interception: shorter delays stay broker ETA messages",
            lo=0.0, hi=float(_YEAR_S), unit="s"),
    Setting("metrics_port", int, None, "serve Prometheus metrics on this port from `delayed run` and "
            "`worker --delayed` (`--metrics-port` overrides it); `None` = no exporter", lo=1, hi=65535,
            nullable=True),
    Setting("metrics_address", str, "127.0.0.1", "address the metrics exporter binds"),
    Setting("schedule", dict, None, "recurring schedules: `{name: {\"task\", \"schedule\", \"args\", \"kwargs\", "
            "\"options\", \"timezone\", \"misfire\"}}` like `beat_schedule` (see Recurring schedules); read again "
            "by the schedulers every `delayed_schedule_sync_s`", nullable=True),
    Setting("rate_limits", dict, None, "fleet-wide rate limits at release: `{key: rate}`, a key being a task "
            "name, `\"queue:<name>\"`, `\"tenant:<name>\"` or `\"tenant:*\"` (each tenant at that rate), a rate "
            "Celery's rate string (`\"100/s\"`, `\"10/m\"`, `\"1000/h\"`); every scheduler of the fleet "
            "together releases at most that rate (see Rate limits and tenants); `delayed limits` changes them at "
            "run time", nullable=True),
    Setting("import_beat_schedule", bool, False, "also run the app's `beat_schedule` as recurring schedules "
            "(`delayed_schedule` wins on a shared name)"),
    Setting("schedule_sync_s", float, 10.0, "how often a scheduler writes changed config entries of its shards' "
            "schedules to the store", lo=0.1, hi=86_400.0, unit="s"),
    Setting("schedule_catch_up_max", int, 100, "misfire `\"each\"`: most missed occurrences of one schedule run "
            "after an outage (the latest)", lo=1, hi=100_000),
    Setting("rabbitmq_api_url", str, None, "RabbitMQ management API for `delayed doctor` (e.g. "
            "`http://guest:guest@127.0.0.1:15672`); `None` = the AMQP broker's host on port 15672 with its "
            "credentials", nullable=True),
    Setting("disabled_fixups", tuple, (), "a list of the corrections to Celery and kombu a worker does not apply: "
            + ", ".join(f"`\"{n}\"`" for n in FIXUP_NAMES) + " (see Fixes to Celery and kombu); each applies "
            "only to the upstream versions it was written for", choices=FIXUP_NAMES),
)
SETTINGS_BY_KEY = {s.key: s for s in SETTINGS}


def _redis_url(conf: Any, value: str | None) -> str:
    if value is None:
        broker = broker_url(conf)
        if not broker or not is_redis_url(broker):
            raise ConfigurationError(
                "set delayed_redis_url: the broker is not Redis "
                f"({redact(broker) or 'unset'!r}), so the store needs its own Redis URL"
            )
        return broker
    if not is_redis_url(value):
        raise ConfigurationError(
            f"delayed_redis_url must be a redis://, rediss://, unix:// or sentinel:// URL, got {redact(value)!r}")
    return value


#: Broker transport options that a Sentinel store takes from the broker (kombu's SentinelChannel).
_SENTINEL_BROKER_OPTIONS = ("master_name", "sentinel_kwargs", "min_other_sentinels")


def _redis_options(conf: Any, value: dict[str, Any] | None) -> dict[str, Any]:
    """The store client's options: the setting, or (the store is the broker's Sentinel) the broker's."""
    if value is not None:
        return value
    if conf.get("delayed_redis_url") is None and is_sentinel_url(broker_url(conf)):
        opts = conf.broker_transport_options or {}
        out = {k: opts[k] for k in _SENTINEL_BROKER_OPTIONS if k in opts}
        ssl = conf.broker_use_ssl
        if ssl:
            out["ssl"] = True
            if isinstance(ssl, dict):
                out.update(ssl)
        return out
    return {}


def _check_store(values: dict[str, Any]) -> None:
    """Checks across settings: a Sentinel URL needs a master name, and wait_replicas a bound."""
    url, opts = values["redis_url"], values["redis_options"]
    if is_sentinel_url(url) and values.get("redis_cluster") is True:
        raise ConfigurationError(
            f"delayed_redis_cluster is set, but delayed_redis_url {redact(url)!r} names Sentinels: a Redis Cluster "
            "fails over by itself; give the URL of any cluster node (redis://host:port/0), or unset "
            "delayed_redis_cluster to use the Sentinels")
    if is_sentinel_url(url):
        sentinel_hosts(url)
        if not isinstance(opts.get("master_name"), str) or not opts["master_name"]:
            raise ConfigurationError(
                f"delayed_redis_url {redact(url)!r} names Sentinels: set delayed_redis_options = "
                "{'master_name': '<the name the Sentinels monitor>'} (for the broker's own Sentinels, "
                "broker_transport_options['master_name'] is used when delayed_redis_url is unset)")
    elif opts:
        unknown = set(opts) & {"master_name", "sentinel_kwargs", "min_other_sentinels"}
        if unknown:
            raise ConfigurationError(
                f"delayed_redis_options has {sorted(unknown)}, which only a sentinel:// delayed_redis_url uses "
                f"(it is {redact(url)!r})")


def _redis_cluster(conf: Any, value: bool | str) -> bool | str:
    """A cluster has one database: refuse a store URL that names another (``"auto"``: when detected)."""
    if value is True:
        url = conf.get("delayed_redis_url") or broker_url(conf)
        if is_sentinel_url(url):  # refused whatever its database: _check_store says why
            return value
        parts = urlsplit(url)
        db = parts.path.strip("/") or parse_qs(parts.query).get("db", ["0"])[0]
        if db not in ("", "0"):
            what = f"database {db}" if db.isdigit() else "a database other than 0"  # not a number: maybe a password
            raise ConfigurationError(
                f"delayed_redis_cluster is set, but delayed_redis_url {redact(url)!r} names {what}: a Redis "
                "Cluster has database 0 only (use /0 or no database in the URL)")
    return value


def _key_prefix(conf: Any, value: str) -> str:
    if not value or any(c in value for c in "{}| \t\r\n"):
        raise ConfigurationError(f"delayed_key_prefix must be non-empty without braces, '|' or spaces, got {value!r}")
    return value


def _database_url(conf: Any, value: str | None) -> str | None:
    """PostgreSQL or SQLite, shared by every process (the check lives with the database code)."""
    if value is None:
        return None
    from .database_urls import check_database_url  # imports nothing heavy: SQLAlchemy is an optional extra

    _non_empty("database_url")(conf, value)
    return check_database_url(value)


def _non_empty(name: str) -> Callable[[Any, str | None], str | None]:
    def check(conf: Any, value: str | None) -> str | None:
        if value == "":
            raise ConfigurationError(f"delayed_{name} must be non-empty (or unset)")
        return value

    return check


#: Checks beyond type and bounds, by key.
_EXTRA_CHECKS: dict[str, Callable[[Any, Any], Any]] = {
    "redis_url": _redis_url,
    "redis_options": _redis_options,
    "key_prefix": _key_prefix,
    "redis_cluster": _redis_cluster,
    "dlq_queue": _non_empty("dlq_queue"),
    "dlq_task": _non_empty("dlq_task"),
    "database_url": _database_url,
    "rate_limits": lambda conf, value: parse_limits(value),
}


@dataclass(frozen=True)
class DelayedConfig:
    """The validated ``delayed_*`` settings of one app (see :data:`SETTINGS`)."""

    redis_url: str
    redis_options: dict[str, Any]
    wait_replicas: int
    wait_replicas_timeout_ms: int
    redis_cluster: bool | str  # True, False or "auto" (the store decides: Store.cluster)
    key_prefix: str
    shards: int
    bucket_ms: int
    release_mode: str
    batch_size: int
    lookahead_ms: int
    lease_ms: int
    claim_lease_ms: int
    publish_max_refusals: int
    record_ttl_s: int
    max_payload_bytes: int
    exec_lease_ms: int
    done_ttl_s: int
    idempotency_ttl_s: int
    max_attempts: int
    backoff: str
    backoff_base_s: float
    backoff_factor: float
    backoff_cap_s: float
    backoff_seed: int | None
    dlq_max_age_s: int
    dlq_max_len: int
    dlq_queue: str | None
    dlq_task: str
    dlq_all_failures: bool
    misfire: str
    max_lateness_s: float | None
    database_url: str | None
    reconcile_interval_s: float
    requeue_after_s: float
    intercept_eta: bool
    intercept_min_delay_s: float
    metrics_port: int | None
    metrics_address: str
    schedule: dict[str, Any] | None
    rate_limits: dict[str, float]  # key -> jobs per second (rate_limits.py)
    import_beat_schedule: bool
    schedule_sync_s: float
    schedule_catch_up_max: int
    rabbitmq_api_url: str | None
    disabled_fixups: tuple[str, ...]

    @property
    def record_ttl_ms(self) -> int:
        """``record_ttl_s`` in milliseconds."""
        return self.record_ttl_s * 1000

    @property
    def dlq_max_len_per_shard(self) -> int:
        """The dead letters one shard keeps: ``ceil(dlq_max_len / shards)``."""
        return -(-self.dlq_max_len // self.shards)

    @classmethod
    def defaults(cls, **overrides: Any) -> DelayedConfig:
        """A config with every default (``redis_url`` must be given), for tools and tests."""
        values = {s.key: s.default for s in SETTINGS}
        values["redis_options"] = {}
        values["rate_limits"] = {}
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_app(cls, app: Celery) -> DelayedConfig:
        """Read and validate the settings; raise :class:`ConfigurationError` when wrong."""
        conf = app.conf
        values: dict[str, Any] = {}
        for setting in SETTINGS:
            value = setting.read(conf)
            extra = _EXTRA_CHECKS.get(setting.key)
            values[setting.key] = extra(conf, value) if extra is not None else value
        _check_store(values)
        return cls(**values)


_ATTR = "_celery_delayed_config"


def get_config(app: Celery) -> DelayedConfig:
    """Return the app's config, reading it on first use and caching it on the app."""
    cfg: DelayedConfig | None = getattr(app, _ATTR, None)
    if cfg is None:
        cfg = DelayedConfig.from_app(app)
        setattr(app, _ATTR, cfg)
    return cfg


def set_config(app: Celery, config: DelayedConfig | None) -> DelayedConfig | None:
    """Make ``config`` the app's config (None: read the settings again on next use); return the one
    it had (the testing kit installs its own, then puts the old one back)."""
    previous: DelayedConfig | None = app.__dict__.get(_ATTR)
    if config is None:
        app.__dict__.pop(_ATTR, None)
    else:
        setattr(app, _ATTR, config)
    return previous


def resolve(call: Any, task: Any, attr: str, config: DelayedConfig, setting: str | None = None) -> Any:
    """One option's value: call option > task attribute ``attr`` > setting > default.

    The setting is ``delayed_<setting or attr>`` (already resolved to its
    default in ``config``). ``None`` at a level means "not given there".
    """
    if call is not None:
        return call
    value = getattr(task, attr, None) if task is not None else None
    if value is not None:
        return value
    return getattr(config, setting or attr)


def _human(s: Setting) -> str:
    if s.unit != "s" or not isinstance(s.default, int) or s.default < _DAY_S or s.default % _DAY_S:
        return ""
    days = s.default // _DAY_S
    return f" ({days} day{'s' if days > 1 else ''})"

