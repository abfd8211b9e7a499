"""A database's rows belong to one store: a second store (another Redis) with the same database and prefix is
refused; a store that lost its data takes its id back and gets its jobs again; ``db bind --force`` rebinds."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner
from support import RedisServer, free_port, make_app

from celery_delayed import ConfigurationError, apply_later, apply_later_many, get_store
from celery_delayed.cli import delayed
from celery_delayed.reconciler import Reconciler
from celery_delayed.scheduler import Scheduler
from celery_delayed.scheduler.maintenance import CONFIG_RETRY_S, Maintenance
from celery_delayed.sql.rows import get_rows

TASK = "t.bind"


@pytest.fixture
def two_servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    with RedisServer() as one, RedisServer() as two:
        yield one, two


def _app(url: str, uid: str, database_url: str, init: bool = False) -> Any:
    app = make_app(url, uid, delayed_database_url=database_url, delayed_shards=4)
    if init:
        rows = get_rows(app)
        assert rows is not None
        rows.init_schema()
    return app


def _dispose(*apps: Any) -> None:
    for app in apps:
        rows = get_rows(app)
        assert rows is not None
        rows.dispose()


def _cli(app: Any, *args: str) -> Any:
    return CliRunner().invoke(delayed, list(args), obj=CLIContext(app=app, no_color=True, workdir=None, quiet=True))


def _jobs_in(app: Any) -> int:
    store = get_store(app)
    return sum(len(ids) for s in range(4) for ids in store.lookup.scheduled_pages(s, 1000))


def test_a_second_store_with_the_same_database_and_prefix_is_refused(two_servers: Any, uid: str, database_url: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Before, the second store's reconciler indexed every row of the first into its own Redis, silently."""
    one, two = two_servers
    first = _app(one.url, uid, database_url, init=True)
    hs = apply_later_many(first, TASK, [{"args": (i,), "when": 3600} for i in range(20)], strict=False)
    rows = get_rows(first)
    assert rows is not None
    held = rows.binding()
    assert held is not None and held.store_id == get_store(first).layout.identity()
    second = _app(two.url, uid, database_url)  # another Redis, new and empty: the same database and prefix
    try:
        with pytest.raises(ConfigurationError, match=f"bound to store {held.store_id} at {one.url}") as info:
            Reconciler(second).run_pass()
        assert "another delayed_key_prefix or another database" in str(info.value)
        assert "delayed db bind --force" in str(info.value)
        with pytest.raises(ConfigurationError, match="holds the jobs of another celery-delayed store"):
            apply_later(second, TASK, when=60, strict=False)
        with pytest.raises(ConfigurationError, match="holds the jobs of"):
            Scheduler(second).preflight()
        # a scheduler that started before (the database bound elsewhere since): its maintenance stops, loudly
        maintenance = Maintenance(get_store(second), get_rows(second), "owner", lambda: [0])
        with pytest.raises(ConfigurationError) as refused:
            maintenance.tick()
        with caplog.at_level(logging.ERROR, logger="celery_delayed.scheduler"):
            assert maintenance.on_error(refused.value) == CONFIG_RETRY_S
        assert "scheduler maintenance stopped: the database" in caplog.text
        assert _jobs_in(second) == 0  # none of the first store's jobs went into the second Redis
        assert rows.counts() == {"SCHEDULED": 20}  # and the second wrote no row
        assert get_store(second).layout.identity() is None
        result = _cli(second, "reconcile")
        assert result.exit_code == 1 and "holds the jobs of" in result.output and "Traceback" not in result.output
        status = _cli(second, "status")
        assert status.exit_code == 0 and "WARNING: database: the database" in status.output, status.output
        doctor = _cli(second, "doctor", "--json")
        assert doctor.exit_code == 1 and "holds the jobs of another celery-delayed store" in doctor.output
        # the first store goes on as before
        assert Reconciler(first).run_pass().reindexed == 0
        assert {h.job_state for h in hs} == {"SCHEDULED"}
        assert f"bound to store {held.store_id}" in _cli(first, "status").output
        assert f"schema current, bound to store {held.store_id}" in _cli(first, "doctor").output
    finally:
        _dispose(first, second)


def test_a_store_of_its_own_is_refused_by_a_database_bound_to_another(two_servers: Any, uid: str,
                                                                      database_url: str, tmp_path: Any) -> None:
    """A store already bound (it has an id) meets a database bound to another store: ids differ."""
    one, two = two_servers
    first = _app(one.url, uid, database_url, init=True)
    apply_later(first, TASK, when=3600, strict=False)
    elsewhere = _app(two.url, uid, f"sqlite:///{tmp_path / 'own.db'}", init=True)
    own = apply_later(elsewhere, TASK, when=3600, strict=False)  # the second store, bound to its own database
    second = _app(two.url, uid, database_url)  # then given the first one's
    try:
        ours = get_store(second).layout.identity()
        assert ours is not None
        with pytest.raises(ConfigurationError, match=f"this app's store at {two.url} is store {ours}"):
            Reconciler(second).run_pass()
        assert own.job_state == "SCHEDULED"
    finally:
        _dispose(first, elsewhere, second)


def test_a_store_that_lost_its_data_takes_its_id_back(uid: str, database_url: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer() as server:
        app = _app(server.url, uid, database_url, init=True)
        hs = apply_later_many(app, TASK, [{"args": (i,), "when": 3600} for i in range(10)], strict=False)
        store_id = get_store(app).layout.identity()
        get_store(app).redis.client.flushall()  # Redis lost everything (a private server)
        again = _app(server.url, uid, database_url)  # a process started after the loss
        try:
            with caplog.at_level(logging.WARNING, logger="celery_delayed.binding"):
                report = Reconciler(again).run_pass()
            assert report.reindexed == 10  # the durability the database is for
            assert get_store(again).layout.identity() == store_id
            assert "has no id: it lost its data" in caplog.text
            assert {get_store(again).lookup.get(h.id)["st"] for h in hs} == {"SCHEDULED"}
        finally:
            _dispose(app, again)


def test_db_bind_force_gives_the_database_to_another_store(two_servers: Any, uid: str, database_url: str) -> None:
    one, two = two_servers
    first = _app(one.url, uid, database_url, init=True)
    h = apply_later(first, TASK, when=3600, strict=False)
    second = _app(two.url, uid, database_url)
    try:
        refused = _cli(second, "db", "bind")
        assert refused.exit_code == 1 and "bind --force" in refused.output
        moved = _cli(second, "db", "bind", "--force")
        assert moved.exit_code == 0, moved.output
        assert f"is bound to store {get_store(second).layout.identity()} at {two.url}" in moved.output
        assert Reconciler(second).run_pass().reindexed == 1  # the first store's job is this one's now
        assert get_store(second).lookup.get(h.id)["st"] == "SCHEDULED"
        again = _app(one.url, uid, database_url)  # a new process of the first store is refused now
        with pytest.raises(ConfigurationError, match="holds the jobs of another celery-delayed store"):
            Reconciler(again).run_pass()
        _dispose(again)
    finally:
        _dispose(first, second)


def test_db_init_binds_and_redis_down_elsewhere_is_refused(uid: str, database_url: str) -> None:
    with RedisServer() as server:
        app = _app(server.url, uid, database_url)
        out = _cli(app, "db", "init")
        assert out.exit_code == 0 and f"bound to store {get_store(app).layout.identity()} at {server.url}" in out.output
    same = _app(server.url, uid, database_url)  # the bound store's Redis, down: its rows are still its jobs
    down = _app(f"redis://127.0.0.1:{free_port()}/0", uid, database_url)  # another Redis, down
    try:
        assert apply_later(same, TASK, when=60, strict=False).indexed is False
        with pytest.raises(ConfigurationError, match="holds the jobs of another celery-delayed store"):
            apply_later(down, TASK, when=60, strict=False)
    finally:
        _dispose(app, same, down)
