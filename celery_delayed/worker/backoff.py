"""Backoff policies for retries: pure functions, no Redis, no clock.

Every policy gives the delay (seconds) before retry number ``retry`` (1 for
the first retry, i.e. the second attempt). With ``t = min(cap, base *
factor ** (retry - 1))``:

=============== ===============================================================
policy          delay before retry ``retry``
=============== ===============================================================
``exponential`` full jitter (the default): ``uniform(0, t)``
``equal``       equal jitter: ``t / 2 + uniform(0, t / 2)``
``decorrelated`` decorrelated jitter: ``min(cap, uniform(base, prev * factor))``
                where ``prev`` is the previous delay (``base`` before the first)
``fixed``       ``min(cap, base)``, no jitter
=============== ===============================================================

(The jitter variants are those of "Exponential Backoff And Jitter", AWS
Architecture Blog, 2015.) Pass a seeded :class:`random.Random` to get the same
delays every time; :func:`rng_for` makes one per job and attempt.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..config import SETTINGS_BY_KEY
from ..errors import ConfigurationError

POLICIES: tuple[str, ...] = SETTINGS_BY_KEY["backoff"].choices

#: Defaults when neither the call, the task nor a ``delayed_*`` setting says (the settings' defaults).
DEFAULT_POLICY: str = SETTINGS_BY_KEY["backoff"].default
DEFAULT_BASE_S: float = SETTINGS_BY_KEY["backoff_base_s"].default
DEFAULT_FACTOR: float = SETTINGS_BY_KEY["backoff_factor"].default
DEFAULT_CAP_S: float = SETTINGS_BY_KEY["backoff_cap_s"].default


@dataclass(frozen=True)
class Backoff:
    """A validated backoff policy (see the module docstring)."""

    policy: str = DEFAULT_POLICY
    base_s: float = DEFAULT_BASE_S
    factor: float = DEFAULT_FACTOR
    cap_s: float = DEFAULT_CAP_S

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigurationError(f"backoff policy must be one of {POLICIES}, got {self.policy!r}")
        for name, lo in (("base_s", 0.0), ("factor", 1.0), ("cap_s", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigurationError(f"backoff {name} must be a finite number, got {value!r}")
            if value < lo:
                raise ConfigurationError(f"backoff {name} must be at least {lo}, got {value}")

    def delay(self, retry: int, prev_s: float | None = None, rng: random.Random | None = None) -> float:
        """The delay in seconds before retry number ``retry`` (1-based)."""
        return compute_backoff(self.policy, retry, self.base_s, self.factor, self.cap_s, prev_s, rng)


def compute_backoff(
    policy: str,
    retry: int,
    base_s: float = DEFAULT_BASE_S,
    factor: float = DEFAULT_FACTOR,
    cap_s: float = DEFAULT_CAP_S,
    prev_s: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Return the delay in seconds before retry number ``retry`` (1 = the first retry).

    Args:
        policy: one of :data:`POLICIES`.
        retry: the retry about to be scheduled, from 1.
        base_s: the first (un-jittered) delay.
        factor: growth per retry (>= 1).
        cap_s: the longest delay.
        prev_s: the previous delay, for ``decorrelated`` (default ``base_s``).
        rng: the random source (default: the ``random`` module's).

    Raises:
        ValueError: ``retry`` below 1 or an unknown policy.
    """
    if isinstance(retry, bool) or not isinstance(retry, int) or retry < 1:
        raise ValueError(f"retry must be an int >= 1, got {retry!r}")
    r = rng if rng is not None else random._inst
    if policy == "fixed":
        return min(cap_s, base_s)
    if policy == "decorrelated":
        prev = base_s if prev_s is None else max(prev_s, base_s)
        return min(cap_s, r.uniform(base_s, prev * factor))
    try:
        ceiling = min(cap_s, base_s * factor ** (retry - 1))
    except OverflowError:  # a huge retry number: the cap applies long before
        ceiling = cap_s
    if policy == "exponential":
        return r.uniform(0.0, ceiling)
    if policy == "equal":
        return ceiling / 2 + r.uniform(0.0, ceiling / 2)
    raise ValueError(f"unknown backoff policy {policy!r}; use one of {POLICIES}")


def rng_for(seed: int | None, job_id: str, retry: int) -> random.Random | None:
    """A reproducible random source for one job's retry, or None when ``seed`` is None.

    The same seed, job id and retry number give the same jitter on any worker,
    in any process, so a test (or an incident review) can recompute the delay.
    """
    if seed is None:
        return None
    return random.Random(f"{seed}:{job_id}:{retry}")
