"""Point celery-delayed's pytest plugin at the project's app.

The plugin (``celery_delayed.testing.plugin``, installed with the package)
gives the ``delayed_*`` fixtures; ``delayed_app`` is the one a project
overrides. Its other fixtures start a private redis-server the first time a
test asks for one.

Run these tests in a pytest of their own (``scripts/test`` does): they import
the example's ``proj`` package, which reads its settings once, at import, and
``tests/e2e/test_demo.py`` imports it with settings of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project: `import proj`

# Load the plugin also where the package is not installed with its entry points (a source checkout).
from celery_delayed.testing.plugin import (
    delayed_clock,
    delayed_kit,
    delayed_redis_url,
    delayed_store,
)

__all__ = ["delayed_clock", "delayed_kit", "delayed_redis_url", "delayed_store"]


@pytest.fixture
def delayed_app() -> Iterator[Celery]:
    """The project's app, with the stand-in payment provider reset for each test."""
    from proj import trials
    from proj.celery import app

    for record in (trials.DECLINING, trials.CHARGED, trials.REMINDED, trials.INDEXED):
        record.clear()
    yield app
