"""Settings: ``delayed_*`` keys on ``app.conf``, read once into a frozen object.

========================== ======= ============ ==========================================
setting                    type    default      meaning
========================== ======= ============ ==========================================
delayed_redis_url          str     broker_url   Redis holding the store (must be redis://,
                                                rediss:// or unix://)
delayed_key_prefix         str     "delayed"    prefix of every store key
delayed_shards             int     16           number of shards (sorted sets)
delayed_bucket_ms          int     0            time-bucket width in ms; 0 = one sorted
                                                set per shard
delayed_release_mode       str     "auto"       "direct" (Lua pushes onto the Redis
                                                broker's lists), "publish" (claim, publish
                                                with kombu, ack) or "auto"
delayed_batch_size         int     500          most jobs one release call moves
delayed_lease_ms           int     30000        scheduler membership lease; a dead
                                                scheduler's shards move after this
delayed_claim_lease_ms     int     60000        publish path: time to publish a claimed
                                                job before it is claimed again
delayed_record_ttl_s       int     604800       how long a released / cancelled job's
                                                record stays readable
delayed_max_payload_bytes  int     1048576      largest message apply_later accepts
delayed_max_attempts       int     4            attempts of a job (first run + retries)
                                                before it is dead-lettered
delayed_backoff            str     exponential  retry backoff policy: exponential (full
                                                jitter), equal, decorrelated, fixed
delayed_backoff_base_s     float   1.0          first retry delay before jitter, seconds
delayed_backoff_factor     float   2.0          growth of the delay per retry (>= 1)
delayed_backoff_cap_s      float   600.0        longest retry delay, seconds
delayed_backoff_seed       int     None         seed the jitter (per job and retry), for
                                                reproducible delays; None = random
delayed_dlq_max_age_s      int     2592000      dead letters older than this are trimmed
delayed_dlq_max_len        int     10000        most dead letters kept (over all shards;
                                                each shard keeps ceil(max_len / shards))
delayed_dlq_queue          str     None         also send each dead letter, as task
                                                delayed_dlq_task, to this Celery queue
delayed_dlq_task           str     see meaning  task name of those messages; default
                                                "celery_delayed.dead_letter"
delayed_dlq_all_failures   bool    False        dead-letter every final failure, not only
                                                jobs that ran out of retries
delayed_intercept_eta      bool    False        route apply_async(eta=/countdown=) and
                                                Task.retry(countdown=) of every task
                                                through the store
delayed_intercept_min_delay_s
                           float   1.0          shorter delays stay broker ETA messages
delayed_exec_lease_ms      int     30000        worker side: execution lease of a running
                                                job, extended by a heartbeat every third
                                                of it; a dead worker's job can be taken
                                                over by its redelivery after this
delayed_done_ttl_s         int     86400        how long a finished job's record (the done
                                                marker) makes a redelivery a no-op
delayed_idempotency_ttl_s  int     86400        how long a finished job scheduled with an
                                                idempotency_key keeps the key reserved
                                                (the longer of the two TTLs applies)
delayed_misfire            str     "run"        a job released over max lateness: "run",
                                                "skip" or "dead" (see misfire.py)
delayed_max_lateness_s     float   None         default max lateness, seconds; None = none
========================== ======= ============ ==========================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from celery import Celery

from .errors import ConfigurationError

_ATTR = "_celery_delayed_config"
_MODES = ("auto", "direct", "publish")


def _int(conf: Any, name: str, default: int, lo: int, hi: int) -> int:
    value = conf.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(
            f"{name} must be an int between {lo} and {hi}, got {type(value).__name__} {value!r}"
        )
    if not lo <= value <= hi:
        raise ConfigurationError(f"{name} must be between {lo} and {hi}, got {value}")
    return value


def _float(conf: Any, name: str, default: float, lo: float, hi: float) -> float:
    value = conf.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigurationError(
            f"{name} must be a number between {lo} and {hi}, got {type(value).__name__} {value!r}"
        )
    if not lo <= value <= hi:
        raise ConfigurationError(f"{name} must be between {lo} and {hi}, got {value}")
    return float(value)


def _bool(conf: Any, name: str, default: bool) -> bool:
    value = conf.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def _str(conf: Any, name: str, default: str | None) -> str | None:
    value = conf.get(name, default)
    if value is not None and not isinstance(value, str):
        raise ConfigurationError(f"{name} must be a string, got {type(value).__name__} {value!r}")
    return value


def _is_redis_url(url: str) -> bool:
    return urlsplit(url).scheme in ("redis", "rediss", "unix", "socket")


@dataclass(frozen=True)
class DelayedConfig:
    """The validated ``delayed_*`` settings of one app (see the module docstring)."""

    redis_url: str
    key_prefix: str
    shards: int
    bucket_ms: int
    release_mode: str
    batch_size: int
    lease_ms: int
    claim_lease_ms: int
    record_ttl_s: int
    max_payload_bytes: int
    # retries and the dead-letter queue (retrying.py, dlq.py, intercept.py)
    max_attempts: int = 4
    backoff: str = "exponential"
    backoff_base_s: float = 1.0
    backoff_factor: float = 2.0
    backoff_cap_s: float = 600.0
    backoff_seed: int | None = None
    dlq_max_age_s: int = 2_592_000
    dlq_max_len: int = 10_000
    dlq_queue: str | None = None
    dlq_task: str = "celery_delayed.dead_letter"
    dlq_all_failures: bool = False
    intercept_eta: bool = False
    intercept_min_delay_s: float = 1.0
    # worker side (task.py, misfire.py)
    exec_lease_ms: int = 30_000
    done_ttl_s: int = 86_400
    idempotency_ttl_s: int = 86_400
    misfire: str = "run"
    max_lateness_s: float | None = None

    @property
    def record_ttl_ms(self) -> int:
        """``record_ttl_s`` in milliseconds."""
        return self.record_ttl_s * 1000

    @classmethod
    def from_app(cls, app: Celery) -> DelayedConfig:
        """Read and validate the settings; raise :class:`ConfigurationError` when wrong."""
        conf = app.conf
        broker = conf.broker_url or ""
        if isinstance(broker, (list, tuple)):
            broker = broker[0] if broker else ""
        url = _str(conf, "delayed_redis_url", None)
        if url is None:
            if not broker or not _is_redis_url(broker):
                raise ConfigurationError(
                    "set delayed_redis_url: the broker is not Redis "
                    f"({broker or 'unset'!r}), so the store needs its own Redis URL"
                )
            url = broker
        elif not _is_redis_url(url):
            raise ConfigurationError(
                f"delayed_redis_url must be a redis://, rediss:// or unix:// URL, got {url!r}"
            )
        prefix = _str(conf, "delayed_key_prefix", "delayed") or ""
        if not prefix or any(c in prefix for c in "{}| \t\r\n"):
            raise ConfigurationError(
                f"delayed_key_prefix must be non-empty without braces, '|' or spaces, got {prefix!r}"
            )
        mode = _str(conf, "delayed_release_mode", "auto")
        if mode not in _MODES:
            raise ConfigurationError(f"delayed_release_mode must be one of {_MODES}, got {mode!r}")
        return cls(
            redis_url=url,
            key_prefix=prefix,
            shards=_int(conf, "delayed_shards", 16, 1, 16384),
            bucket_ms=_int(conf, "delayed_bucket_ms", 0, 0, 86_400_000),
            release_mode=str(mode),
            batch_size=_int(conf, "delayed_batch_size", 500, 1, 100_000),
            lease_ms=_int(conf, "delayed_lease_ms", 30_000, 500, 3_600_000),
            claim_lease_ms=_int(conf, "delayed_claim_lease_ms", 60_000, 500, 86_400_000),
            record_ttl_s=_int(conf, "delayed_record_ttl_s", 604_800, 1, 10 * 365 * 86_400),
            max_payload_bytes=_int(conf, "delayed_max_payload_bytes", 1 << 20, 256, 512 << 20),
            **_retry_settings(conf),
            **_worker_settings(conf),
        )


def _retry_settings(conf: Any) -> dict[str, Any]:
    from .backoff import POLICIES

    policy = _str(conf, "delayed_backoff", "exponential")
    if policy not in POLICIES:
        raise ConfigurationError(f"delayed_backoff must be one of {POLICIES}, got {policy!r}")
    seed = conf.get("delayed_backoff_seed", None)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigurationError(f"delayed_backoff_seed must be an int or None, got {seed!r}")
    queue = _str(conf, "delayed_dlq_queue", None)
    task = _str(conf, "delayed_dlq_task", "celery_delayed.dead_letter")
    if queue == "" or not task:
        raise ConfigurationError("delayed_dlq_queue and delayed_dlq_task must be non-empty (or unset)")
    return {
        "max_attempts": _int(conf, "delayed_max_attempts", 4, 1, 10_000),
        "backoff": str(policy),
        "backoff_base_s": _float(conf, "delayed_backoff_base_s", 1.0, 0.0, 31_536_000.0),
        "backoff_factor": _float(conf, "delayed_backoff_factor", 2.0, 1.0, 1000.0),
        "backoff_cap_s": _float(conf, "delayed_backoff_cap_s", 600.0, 0.0, 31_536_000.0),
        "backoff_seed": seed,
        "dlq_max_age_s": _int(conf, "delayed_dlq_max_age_s", 2_592_000, 1, 10 * 365 * 86_400),
        "dlq_max_len": _int(conf, "delayed_dlq_max_len", 10_000, 1, 10_000_000),
        "dlq_queue": queue,
        "dlq_task": str(task),
        "dlq_all_failures": _bool(conf, "delayed_dlq_all_failures", False),
        "intercept_eta": _bool(conf, "delayed_intercept_eta", False),
        "intercept_min_delay_s": _float(conf, "delayed_intercept_min_delay_s", 1.0, 0.0, 31_536_000.0),
    }


def _worker_settings(conf: Any) -> dict[str, Any]:
    misfire = _str(conf, "delayed_misfire", "run")
    if misfire not in ("run", "skip", "dead"):
        raise ConfigurationError(f"delayed_misfire must be 'run', 'skip' or 'dead', got {misfire!r}")
    lateness = conf.get("delayed_max_lateness_s", None)
    return {
        "exec_lease_ms": _int(conf, "delayed_exec_lease_ms", 30_000, 300, 86_400_000),
        "done_ttl_s": _int(conf, "delayed_done_ttl_s", 86_400, 1, 10 * 365 * 86_400),
        "idempotency_ttl_s": _int(conf, "delayed_idempotency_ttl_s", 86_400, 1, 10 * 365 * 86_400),
        "misfire": str(misfire),
        "max_lateness_s": None if lateness is None
        else _float(conf, "delayed_max_lateness_s", 0.0, 0.0, 31_536_000.0),
    }


def get_config(app: Celery) -> DelayedConfig:
    """Return the app's config, reading it on first use and caching it on the app."""
    cfg: DelayedConfig | None = getattr(app, _ATTR, None)
    if cfg is None:
        cfg = DelayedConfig.from_app(app)
        setattr(app, _ATTR, cfg)
    return cfg
