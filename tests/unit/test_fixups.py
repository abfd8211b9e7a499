"""The fixups of Celery and kombu: the registry, the setting that turns them off, and each one's effect.

Each fixup's test runs twice: applied, it shows the corrected behaviour; left
out with ``delayed_disabled_fixups``, the upstream behaviour it corrects is
still there (so the fixup is what corrects it). The patched classes are put
back as upstream ships them around every test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
import weakref
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from importlib import import_module
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery, current_app
from celery.concurrency.solo import TaskPool
from celery.worker import state
from celery.worker.consumer.consumer import Consumer
from celery.worker.strategy import default as default_strategy
from kombu import Connection, Queue
from kombu.asynchronous import Hub
from kombu.asynchronous.timer import Timer
from kombu.common import QoS as PrefetchCount
from kombu.message import Message
from kombu.serialization import dumps
from kombu.transport import redis as kredis
from support import wait_for

from celery_delayed.config import FIXUP_NAMES, DelayedConfig
from celery_delayed.errors import ConfigurationError
from celery_delayed.fixups import (
    FIXUPS,
    held_restore,
    install_fixups,
    on_worker_setup,
    parse_version,
    upstream_version,
)
from celery_delayed.testing import RedisServer

#: Every class attribute a fixup replaces.
PATCHED = [(kredis.Channel, "_get_pool"), (kredis.SentinelChannel, "_get_pool"), (Hub, "fire_timers"),
           (Consumer, "apply_eta_task"), (Consumer, "_limit_post_eta"), (kredis.QoS, "restore_unacked")]


@pytest.fixture
def pristine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Upstream's own methods during the test (any fixup unwrapped), and whatever was there after it."""
    for cls, name in PATCHED:
        method = vars(cls)[name]
        while getattr(method, "__module__", "").startswith("celery_delayed.fixups"):
            method = method.__wrapped__
        monkeypatch.setattr(cls, name, method)
    monkeypatch.setattr(held_restore, "_app", None)
    monkeypatch.setattr(held_restore, "_pending", {})
    yield


def _apply(broker: str, name: str, disabled: bool) -> None:
    """install_fixups as a worker does, with ``name`` left out when ``disabled``."""
    fixup = FIXUPS[name]
    if not fixup.applies_to(upstream_version(fixup.upstream)):
        pytest.skip(f"{fixup.upstream} {upstream_version(fixup.upstream)} is outside {fixup.versions}")
    app = Celery("fixups", broker=broker, set_as_current=False)
    app.conf.delayed_disabled_fixups = [name] if disabled else []
    applied = install_fixups(app)
    assert (name in applied) is not disabled, applied


on_and_off = pytest.mark.parametrize("disabled", [False, True], ids=["applied", "disabled"])


# -- the registry and the setting


def test_the_registry_lists_the_names_the_setting_takes():
    assert tuple(FIXUPS) == FIXUP_NAMES
    assert all(f.name == name for name, f in FIXUPS.items())


@pytest.mark.parametrize("name", FIXUP_NAMES)
def test_each_module_opens_with_its_upstream_versions_and_when_to_delete_it(name):
    fixup = FIXUPS[name]
    header = import_module(f"celery_delayed.fixups.{name}").__doc__ or ""
    assert f"Upstream: {fixup.versions}" in header, (name, fixup.versions)
    assert "Delete when" in header


@pytest.mark.parametrize("name", FIXUP_NAMES)
def test_no_installed_upstream_version_is_newer_than_a_fixup_was_checked_against(name):
    """An upgrade past a fixup's range is a prompt to check it: does the new release still need it?

    An older release than the range (the lowest supported versions, in the matrix) just skips it.
    """
    fixup = FIXUPS[name]
    version = upstream_version(fixup.upstream)
    assert parse_version(version) < fixup.before, (
        f"{fixup.upstream} {version} is newer than {fixup.versions}: the fixup {name} is skipped. Check whether "
        f"{fixup.upstream} {version} still needs it; widen its range or delete it")


def test_versions_are_compared_by_release():
    assert parse_version("5.7.0") == (5, 7, 0)
    assert parse_version("5.8.0rc1") == (5, 8, 0)
    assert parse_version("6") == (6, 0, 0)
    fixup = FIXUPS["reconnect_guard"]
    assert fixup.versions == "kombu >=5.7.0,<5.8.0"
    assert [fixup.applies_to(v) for v in ("5.6.9", "5.7.0", "5.7.12", "5.8.0")] == [False, True, True, False]


def test_an_unknown_name_is_refused_with_the_known_ones():
    app = Celery("fixups", broker="memory://", set_as_current=False)
    app.conf.delayed_redis_url = "redis://127.0.0.1:1/0"
    app.conf.delayed_disabled_fixups = ["prompt_timers", "timer_fix"]
    for check in (DelayedConfig.from_app, install_fixups):
        with pytest.raises(ConfigurationError, match="delayed_disabled_fixups") as err:
            check(app)
        assert "timer_fix" in str(err.value)
        assert all(name in str(err.value) for name in FIXUP_NAMES), err.value


def test_the_setting_is_a_list_of_names():
    app = Celery("fixups", broker="redis://127.0.0.1:1/0", set_as_current=False)
    assert DelayedConfig.from_app(app).disabled_fixups == ()
    app.conf.delayed_disabled_fixups = "prompt_timers"  # a string is not a list of one name
    with pytest.raises(ConfigurationError, match="must be a list of names"):
        DelayedConfig.from_app(app)
    app.conf.delayed_disabled_fixups = ["eta_cycle", "held_restore"]
    assert DelayedConfig.from_app(app).disabled_fixups == ("eta_cycle", "held_restore")


@pytest.mark.parametrize("name", FIXUP_NAMES)
def test_a_fixup_outside_its_versions_or_disabled_is_skipped_with_a_debug_line(name, monkeypatch, caplog):
    calls: list[Celery] = []

    def install(app: Celery) -> bool:
        calls.append(app)
        return True

    fixup = FIXUPS[name]
    others = {n: dataclasses.replace(f, since=(0, 0, 0), before=(100, 0, 0), install=lambda app: True)
              for n, f in FIXUPS.items() if n != name}  # the others apply, whatever is installed
    for other, replaced in others.items():
        monkeypatch.setitem(FIXUPS, other, replaced)
    monkeypatch.setitem(FIXUPS, name, dataclasses.replace(fixup, since=(99, 0, 0), before=(100, 0, 0),
                                                          install=install))
    app = Celery("fixups", broker="memory://", set_as_current=False)
    with caplog.at_level(logging.DEBUG, logger="celery_delayed.fixups"):
        assert name not in install_fixups(app)
    assert not calls
    assert f"fixup {name} skipped: {fixup.upstream} {upstream_version(fixup.upstream)} is outside " \
           f"{fixup.upstream} >=99.0.0,<100.0.0" in caplog.text

    monkeypatch.setitem(FIXUPS, name, dataclasses.replace(fixup, install=install))
    app.conf.delayed_disabled_fixups = (name,)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="celery_delayed.fixups"):
        assert install_fixups(app) == [n for n in FIXUP_NAMES if n != name]
    assert not calls
    assert f"fixup {name} skipped: named in delayed_disabled_fixups" in caplog.text
    caplog.clear()  # a worker's logging is set up after worker_init: the reasons are logged again then
    with caplog.at_level(logging.DEBUG, logger="celery_delayed.fixups"):
        on_worker_setup()
    assert f"fixup {name} skipped: named in delayed_disabled_fixups" in caplog.text


# -- each fixup: applied, the correction; disabled, the upstream behaviour


@on_and_off
def test_reconnect_guard_turns_a_detached_channel_into_a_connection_error(redis_url, pristine, disabled):
    """The channel that crashed Celery 5.7's reconnect: its transport detached by ``collect()``, it survived."""
    _apply(redis_url, "reconnect_guard", disabled)
    conn = Connection(redis_url)
    channel = conn.channel()  # connected (kombu's Redis channel pings its server)
    connection_errors = conn.connection_errors
    try:
        conn._do_close_transport()  # what collect() does to the transport: client = None
        with pytest.raises(Exception) as err:
            channel._get_pool()
        if disabled:
            # Not a connection error: Celery's ignore_errors lets it through and the consumer dies.
            assert isinstance(err.value, AttributeError) and "hostname" in str(err.value)
            assert not isinstance(err.value, connection_errors)
        else:
            # A connection error: Celery ignores it and reconnects.
            assert isinstance(err.value, redis.exceptions.ConnectionError)
            assert isinstance(err.value, connection_errors)
    finally:
        pool = channel.__dict__.get("_pool")
        if pool is not None:
            pool.disconnect()


@on_and_off
def test_prompt_timers_fires_30_due_timers_without_waiting(redis_url, pristine, disabled):
    """kombu's loop polls with the timeout ``fire_timers`` returns: 1 s while due timers wait is the pause."""
    _apply(redis_url, "prompt_timers", disabled)
    hub = Hub()
    try:
        fired: list[int] = []
        for i in range(30):
            hub.timer.call_at(time.monotonic() - 1.0, fired.append, (i,))
        timeouts = []
        while len(fired) < 30 and len(timeouts) < 10:
            timeouts.append(hub.fire_timers())
        assert fired == list(range(30))
        assert len(timeouts) == 3  # ten per turn either way
        # Applied: the loop polls without waiting while due timers are left. Disabled: it waits up to a
        # second with 20, then 10 timers due.
        assert timeouts[:2] == ([1, 1] if disabled else [0, 0]), timeouts
    finally:
        hub.close()


@on_and_off
def test_eta_cycle_frees_a_fired_eta_request_when_its_task_is_done(pristine, disabled):
    """An ETA request held by Celery's own strategy, fired by kombu's timer, run by the solo pool."""
    _apply("memory://", "eta_cycle", disabled)
    app = Celery("fixups", broker="memory://", set_as_current=False)
    ran: list[int] = []

    @app.task(name="fixups.mark", shared=False)
    def mark(i: int) -> None:
        ran.append(i)

    eta = datetime.now(timezone.utc) - timedelta(seconds=1)
    headers, properties, body, _ = app.amqp.as_task_v2("eta-cycle-1", mark.name, args=(7,), eta=eta)
    content_type, encoding, data = dumps(body, serializer="json")
    message = Message(body=data, content_type=content_type, content_encoding=encoding, headers=headers,
                      properties=properties, delivery_tag="1")
    previous = current_app._get_current_object()
    pool = TaskPool()
    was_enabled = gc.isenabled()
    try:
        app.set_current()  # a worker's request runs its task in the current app
        pool.start()
        timer = Timer()
        consumer = Consumer(lambda req: req.execute_using_pool(pool), app=app, pool=pool, timer=timer,
                            controller=SimpleNamespace(state=state, use_eventloop=False), hostname="fixups")
        consumer.qos = PrefetchCount(lambda prefetch_count: None, 1)
        consumer.event_dispatcher = None
        handle = default_strategy(mark, app, consumer)  # binds the consumer's ETA callback, as a worker's does
        gc.disable()  # only reference counting frees it
        handle(message, None, lambda *a: None, lambda *a: None, [])
        (entry,) = (event[2] for event in timer.queue)
        request = weakref.ref(entry.args[0])
        assert request() is not None and request()._eta_timer_entry is entry
        timer.clear()
        del message
        timer.apply_entry(entry)  # due: the task runs
        del entry
        assert ran == [7] and "eta-cycle-1" not in state.requests
        if disabled:
            assert request() is not None, "the request and its timer entry hold each other"
            gc.collect()
        assert request() is None
    finally:
        if was_enabled:
            gc.enable()
        pool.stop()
        previous.set_current()


@on_and_off
def test_held_restore_returns_held_messages_once_the_broker_is_back(pristine, disabled):
    """A message delivered and not acknowledged when Redis went away: kombu's restore fails with the server."""
    with contextlib.ExitStack() as stack:
        server = RedisServer(appendonly=True).start()  # a restart keeps the data
        stack.callback(server.close)
        _apply(server.url, "held_restore", disabled)
        app = Celery("fixups", broker=server.url, set_as_current=False)
        conn = app.connection_for_write()
        stack.callback(conn.release)
        channel = conn.default_channel
        queue = Queue("fixups-held")(channel)
        queue.declare()
        channel.basic_publish(channel.prepare_message("held"), exchange="", routing_key="fixups-held")
        assert queue.get(no_ack=False) is not None  # delivered, in kombu's unacked hash
        stack.callback(_forget_delivered, channel)
        server.stop("term")
        with pytest.raises(redis.exceptions.ConnectionError):
            channel.qos.restore_unacked()  # what closing the channel does: no server to restore to
        server.start()
        client = redis.Redis.from_url(server.url)
        stack.callback(client.close)
        if disabled:
            # Nothing restores it before kombu's visibility timeout (an hour by default).
            time.sleep(3.0)
            assert (client.llen("fixups-held"), client.hlen("unacked")) == (0, 1)
        else:
            wait_for(lambda: client.llen("fixups-held") == 1, 15, what="the held message back in its queue")
            assert client.hlen("unacked") == 0


def _forget_delivered(channel: Any) -> None:
    """Keep kombu from restoring the test's message again when the channel is collected."""
    channel.qos._delivered.clear()
    channel.qos._delivered.restored = True
