"""Fleet-wide rate limits at release: their keys and rates (``delayed_rate_limits``).

A limit's key names what it limits: a task by its name, ``queue:<name>``,
``tenant:<name>``, or ``tenant:*`` (each tenant on its own, at that rate; a
tenant's own key wins). A rate is Celery's rate string (``"100/s"``,
``"10/m"``, ``"1000/h"``; a bare number is per second), read with Celery's
own :func:`celery.utils.time.rate`. The release scripts enforce them
(``lua/includes/shaping_release.lua``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from celery.utils.time import rate as celery_rate

from .errors import ConfigurationError

#: The key forms that name something other than a task.
KEY_KINDS = ("queue", "tenant")


def check_key(key: object, where: str = "delayed_rate_limits") -> str:
    """A rate limit's key, checked.

    Raises:
        ConfigurationError: not a string, empty, or an unknown ``kind:`` form.
    """
    if not isinstance(key, str) or not key.strip():
        raise ConfigurationError(f"{where}: a key must be a task name, 'queue:<name>', 'tenant:<name>' or "
                                 f"'tenant:*', got {key!r}")
    kind, sep, name = key.partition(":")
    if sep and kind in KEY_KINDS:
        if not name:
            raise ConfigurationError(f"{where}: {key!r} names no {kind}; write '{kind}:<name>'")
        if name == "*" and kind != "tenant":
            raise ConfigurationError(f"{where}: {key!r}: only tenants take '*' (every tenant at that rate)")
    elif sep and " " not in kind and "." not in kind:
        raise ConfigurationError(f"{where}: {key!r} is not a key form it knows: use a task name, "
                                 "'queue:<name>', 'tenant:<name>' or 'tenant:*'")
    return key


def parse_rate(value: object, where: str = "delayed_rate_limits") -> float:
    """A rate in jobs per second, from Celery's rate syntax (``"100/s"``, ``"10/m"``, ``"1000/h"``, a number).

    Raises:
        ConfigurationError: not that syntax, or not a positive rate.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigurationError(f"{where}: a rate must be a string like '100/s', '10/m' or '1000/h', "
                                 f"got {type(value).__name__} {value!r}")
    try:
        per_s = float(celery_rate(value.strip() if isinstance(value, str) else value))
    except (ValueError, KeyError, TypeError):
        raise ConfigurationError(f"{where}: {value!r} is not a rate: write '<number>/s', '<number>/m' or "
                                 "'<number>/h' (Celery's rate syntax)") from None
    if not math.isfinite(per_s) or per_s <= 0:
        raise ConfigurationError(f"{where}: {value!r} must be a positive rate (to stop releasing, pause instead)")
    return per_s


def parse_limits(value: Mapping[str, object] | None, where: str = "delayed_rate_limits") -> dict[str, float]:
    """``{key: rate}`` checked, each rate in jobs per second.

    Raises:
        ConfigurationError: a bad key or rate (naming it).
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{where} must be a dict of key -> rate, got {type(value).__name__} {value!r}")
    return {check_key(k, where): parse_rate(v, f"{where}[{k!r}]") for k, v in value.items()}


def format_rate(per_s: float) -> str:
    """A rate back in Celery's syntax, in the unit that reads best (``"50/s"``, ``"10/m"``)."""
    for unit, scale in (("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        n = per_s * scale
        if n >= 1 and abs(n - round(n)) < 1e-9:
            return f"{round(n)}/{unit}"
    return f"{per_s:.6g}/s"
