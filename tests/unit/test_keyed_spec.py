"""Validation of apply_later's debounce and throttle arguments (pure: ``producer/keyed.py``)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from celery_delayed.errors import ConfigurationError, InvalidOption
from celery_delayed.producer.keyed import MAX_SPAN_S, KeyedSpec, keyed_spec


def test_neither_key() -> None:
    assert keyed_spec() is None


@pytest.mark.parametrize(("value", "ms"), [(5, 5000), (0.0004, 1), (1.2345, 1234), (timedelta(minutes=2), 120_000),
                                           (MAX_SPAN_S, MAX_SPAN_S * 1000)])
def test_durations(value: object, ms: int) -> None:
    assert keyed_spec(debounce_key="k", max_wait=value) == KeyedSpec("debounce", "k", ms)
    assert keyed_spec(throttle_key="k", window=value) == KeyedSpec("throttle", "k", ms)


def test_debounce_without_max_wait_has_no_limit() -> None:
    assert keyed_spec(debounce_key="k") == KeyedSpec("debounce", "k", None)


@pytest.mark.parametrize("value", [0, -1, MAX_SPAN_S + 1, float("inf"), float("nan"), True, "3", None])
def test_bad_windows(value: object) -> None:
    with pytest.raises(InvalidOption, match="window"):
        keyed_spec(throttle_key="k", window=value)


def test_a_database_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="delayed_database_url"):
        keyed_spec(debounce_key="k", database=True)
    with pytest.raises(ConfigurationError, match="delayed_database_url"):
        keyed_spec(throttle_key="k", window=1, connection=object())
