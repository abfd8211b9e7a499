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
        )


def get_config(app: Celery) -> DelayedConfig:
    """Return the app's config, reading it on first use and caching it on the app."""
    cfg: DelayedConfig | None = getattr(app, _ATTR, None)
    if cfg is None:
        cfg = DelayedConfig.from_app(app)
        setattr(app, _ATTR, cfg)
    return cfg


def finite(value: float) -> bool:
    """True for a finite number (not NaN, not +/-inf)."""
    return not (math.isnan(value) or math.isinf(value))
