"""Backoff policies: pure functions, seeded, bounded; option precedence."""

from __future__ import annotations

import random

import pytest
from celery import Celery

from celery_delayed.config import DelayedConfig
from celery_delayed.errors import ConfigurationError
from celery_delayed.worker.backoff import POLICIES, Backoff, compute_backoff, rng_for
from celery_delayed.worker.failures import RetryPolicy


def test_seeded_delays_are_reproducible():
    for policy in POLICIES:
        a = [compute_backoff(policy, n, rng=random.Random(7)) for n in range(1, 8)]
        b = [compute_backoff(policy, n, rng=random.Random(7)) for n in range(1, 8)]
        assert a == b


def test_documented_values_with_a_seed():
    # t = min(cap, base * factor**(n-1)); exponential: uniform(0, t); equal: t/2 + uniform(0, t/2)
    for n, t in enumerate([1, 2, 4, 8, 16, 30, 30], start=1):
        draw = random.Random(5).uniform
        assert compute_backoff("exponential", n, 1.0, 2.0, 30.0, rng=random.Random(5)) == draw(0, t)
        draw = random.Random(5).uniform
        assert compute_backoff("equal", n, 1.0, 2.0, 30.0, rng=random.Random(5)) == t / 2 + draw(0, t / 2)
    # decorrelated: min(cap, uniform(base, prev * factor)), prev = base before the first
    assert compute_backoff("decorrelated", 1, 1.0, 3.0, 30.0, rng=random.Random(5)) == random.Random(5).uniform(1, 3)
    assert compute_backoff("decorrelated", 2, 1.0, 3.0, 30.0, prev_s=4.0, rng=random.Random(5)) == min(
        30.0, random.Random(5).uniform(1, 12))
    assert [compute_backoff("fixed", n, 3.0, 2.0, 30.0) for n in (1, 5, 50)] == [3.0, 3.0, 3.0]
    assert compute_backoff("fixed", 1, 60.0, 2.0, 30.0) == 30.0


@pytest.mark.parametrize("policy", POLICIES)
def test_bounds_over_many_draws(policy):
    rng = random.Random(99)
    prev = None
    for n in range(1, 200):
        d = compute_backoff(policy, n, 0.5, 3.0, 20.0, prev_s=prev, rng=rng)
        assert 0.0 <= d <= 20.0
        ceiling = min(20.0, 0.5 * 3.0 ** (n - 1)) if n < 50 else 20.0
        if policy == "exponential":
            assert d <= ceiling
        elif policy == "equal":
            assert ceiling / 2 <= d <= ceiling
        elif policy == "decorrelated":
            assert d >= min(0.5, 20.0)
            assert d <= max(0.5, (prev or 0.5)) * 3.0
        prev = d


def test_huge_retry_numbers_do_not_overflow():
    assert compute_backoff("equal", 10_000, 1.0, 2.0, 600.0, rng=random.Random(1)) >= 300.0


def test_rng_for_is_per_job_and_retry():
    assert rng_for(None, "a", 1) is None
    one = [rng_for(3, "job", 1).random() for _ in range(2)]  # type: ignore[union-attr]
    assert one[0] == one[1]
    assert rng_for(3, "job", 1).random() != rng_for(3, "job", 2).random()  # type: ignore[union-attr]
    assert rng_for(3, "job", 1).random() != rng_for(3, "other", 1).random()  # type: ignore[union-attr]


@pytest.mark.parametrize(("kwargs", "what"), [
    ({"policy": "linear"}, "policy"), ({"base_s": -1.0}, "base_s"), ({"factor": 0.5}, "factor"),
    ({"cap_s": float("nan")}, "cap_s"), ({"base_s": True}, "base_s"),
])
def test_bad_policy_is_a_clear_error(kwargs, what):
    with pytest.raises(ConfigurationError, match=what):
        Backoff(**kwargs)
    with pytest.raises(ValueError, match="retry"):
        compute_backoff("fixed", 0)


def _app(**conf: object) -> Celery:
    app = Celery("bo", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.update(**conf)
    return app


def test_precedence_call_over_task_over_setting_over_default():
    default = DelayedConfig.from_app(_app())
    cfg = DelayedConfig.from_app(_app(delayed_backoff="fixed", delayed_backoff_base_s=7.0, delayed_max_attempts=9))

    class Plain:
        name = "t"

    class WithAttrs:
        name = "t"
        backoff = "equal"
        backoff_base_s = 2.0
        max_attempts = 3

    assert RetryPolicy.resolve(Plain(), default).backoff == Backoff("exponential", 1.0, 2.0, 600.0)
    assert RetryPolicy.resolve(Plain(), default).max_attempts == 4
    assert RetryPolicy.resolve(Plain(), cfg).backoff == Backoff("fixed", 7.0, 2.0, 600.0)
    assert RetryPolicy.resolve(Plain(), cfg).max_attempts == 9
    assert RetryPolicy.resolve(WithAttrs(), cfg).backoff == Backoff("equal", 2.0, 2.0, 600.0)
    assert RetryPolicy.resolve(WithAttrs(), cfg).max_attempts == 3
    assert RetryPolicy.resolve(WithAttrs(), cfg, backoff="decorrelated", backoff_cap_s=5.0).backoff == Backoff(
        "decorrelated", 2.0, 2.0, 5.0)
    assert RetryPolicy.resolve(WithAttrs(), cfg, 6).max_attempts == 6
    with pytest.raises(ConfigurationError, match="max_attempts"):
        RetryPolicy.resolve(Plain(), cfg, 0)


@pytest.mark.parametrize(("setting", "value"), [
    ("delayed_backoff", "linear"), ("delayed_backoff_base_s", -1), ("delayed_backoff_factor", 0.5),
    ("delayed_max_attempts", 0), ("delayed_dlq_max_len", 0), ("delayed_intercept_eta", "yes"),
    ("delayed_backoff_seed", 1.5), ("delayed_intercept_min_delay_s", float("inf")),
])
def test_bad_settings_are_refused_at_start(setting, value):
    with pytest.raises(ConfigurationError, match=setting):
        DelayedConfig.from_app(_app(**{setting: value}))
