"""The pytest plugin of celery-delayed (registered with pytest's ``pytest11`` entry point).

Nothing here is autouse and nothing starts at import or collection: a
fixture starts what it needs when a test asks for it. Fixtures:

``delayed_redis_url`` (session)
    A Redis server for the tests' stores: ``$DELAYED_TEST_REDIS_URL`` when set
    (each test keeps its keys under a prefix of its own and deletes them
    after), else a private ``redis-server`` started on a free port for the
    session (skipped when the binary is missing, failed when ``$CI`` is set).
``delayed_app``
    The Celery app under test. The default is a bare app; override it in
    your ``conftest.py`` to return yours::

        @pytest.fixture
        def delayed_app():
            from proj.celery import app
            return app

``delayed_kit``
    A :class:`~celery_delayed.testing.kit.DelayedTestKit` on ``delayed_app``:
    ``scheduled_jobs()``, ``assert_scheduled()``, ``assert_not_scheduled()``,
    ``release_due()``, ``run_due()``. Closed after the test (its keys deleted,
    the app's own store put back).
``delayed_clock``
    The kit's :class:`~celery_delayed.testing.kit.DelayedClock` (``advance()``,
    ``set()``, ``now()``): the store's clock, frozen at the start of the test.
``delayed_store``
    The kit's :class:`~celery_delayed.store.Store`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from celery import Celery

    from ..store import Store
    from .kit import DelayedClock, DelayedTestKit


@pytest.fixture(scope="session")
def delayed_redis_url() -> Iterator[str]:
    """A Redis server URL for the tests' stores (see the module docstring)."""
    url = os.environ.get("DELAYED_TEST_REDIS_URL")
    if url:
        yield url
        return
    if shutil.which("redis-server") is None:
        why = "redis-server is not installed (apt-get install redis-server), and DELAYED_TEST_REDIS_URL is not set"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    from .servers import RedisServer

    with RedisServer() as server:
        yield server.url


@pytest.fixture
def delayed_app() -> Celery:
    """The app under test: override this fixture to return your own."""
    from celery import Celery

    return Celery("delayed-tests", broker="memory://", set_as_current=False)


@pytest.fixture
def delayed_kit(delayed_app: Celery, delayed_redis_url: str) -> Iterator[DelayedTestKit]:
    """A testing kit on ``delayed_app`` with a store on ``delayed_redis_url`` (see the module docstring)."""
    from .kit import DelayedTestKit

    with DelayedTestKit(delayed_app, delayed_redis_url) as kit:
        yield kit


@pytest.fixture
def delayed_clock(delayed_kit: DelayedTestKit) -> DelayedClock:
    """The store's clock in this test (frozen; ``advance()`` moves it)."""
    return delayed_kit.clock


@pytest.fixture
def delayed_store(delayed_kit: DelayedTestKit) -> Store:
    """The store the kit installed on ``delayed_app``."""
    return delayed_kit.store
