"""The testing kit for users (``celery_delayed.testing``): the kit on a real redis-server, and the
pytest plugin run in a pytest of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_delayed import ConfigurationError, DelayedTask, apply_later, cancel, get_store
from celery_delayed.testing import DelayedClock, DelayedTestKit

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kapp() -> Celery:
    """An app whose broker is not Redis and that names no store: the kit gives it one."""
    app = Celery("kit", broker="memory://", set_as_current=False)
    app.calls = []  # type: ignore[attr-defined]

    @app.task(base=DelayedTask, bind=True, name="kit.charge", max_attempts=3, shared=False)
    def charge(self: Any, order: int, declines: int = 0) -> str:
        app.calls.append(order)  # type: ignore[attr-defined]
        if self.request.retries < declines:
            raise self.retry_later(exc=RuntimeError("declined"), countdown=60)
        return f"charged {order}"

    @app.task(name="kit.plain", shared=False)
    def plain(x: int) -> int:
        app.calls.append(("plain", x))  # type: ignore[attr-defined]
        return x

    return app


@pytest.fixture
def kit(kapp: Celery, redis_url: str) -> Any:
    with DelayedTestKit(kapp, redis_url) as k:
        yield k


def test_clock() -> None:
    clock = DelayedClock(datetime(2030, 1, 1, tzinfo=timezone.utc))
    assert clock.now_ms() == clock() == 1_893_456_000_000
    assert clock.advance(hours=1, seconds=30) == datetime(2030, 1, 1, 1, 0, 30, tzinfo=timezone.utc)
    clock.advance(timedelta(milliseconds=5))
    assert clock.now_ms() == 1_893_456_000_000 + 3_630_005
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1)
    clock.set(datetime(2029, 1, 1, tzinfo=timezone.utc))
    assert clock.now().year == 2029


def test_schedule_assert_and_run_by_the_clock(kit: DelayedTestKit, kapp: Celery) -> None:
    h = apply_later(kapp, "kit.charge", (1,), when=timedelta(hours=1))
    job = kit.assert_scheduled("kit.charge", args=(1,), at=kit.clock.now() + timedelta(hours=1),
                               tolerance=timedelta(0))
    assert job.id == h.id and job.kwargs == {} and job.state == "SCHEDULED"
    kit.assert_not_scheduled("kit.charge", args=(2,))
    with pytest.raises(AssertionError, match=r"kit.charge\(args=\(1,\)"):
        kit.assert_scheduled("kit.charge", args=(2,))
    with pytest.raises(AssertionError, match="1 job"):
        kit.assert_not_scheduled("kit.charge")
    assert kit.run_due() == []  # not due by the kit's clock
    kit.clock.advance(minutes=59, seconds=59)
    assert kit.run_due() == []
    kit.clock.advance(seconds=1)
    [ran] = kit.run_due()
    assert (ran.id, ran.state, ran.result, ran.job_state) == (h.id, "SUCCESS", "charged 1", "SUCCEEDED")
    assert kapp.calls == [1]  # type: ignore[attr-defined]
    assert kit.scheduled_jobs() == []


def test_retries_go_through_the_store(kit: DelayedTestKit, kapp: Celery) -> None:
    h = apply_later(kapp, "kit.charge", (7,), {"declines": 2}, when=0)
    [first] = kit.run_due()
    assert first.state == "RETRY" and first.job_state == "SCHEDULED"
    assert isinstance(first.exception, RuntimeError)
    kit.assert_scheduled("kit.charge", args=(7,), at=kit.clock.now() + timedelta(seconds=60))
    kit.clock.advance(60)
    [second] = kit.run_due()
    assert second.state == "RETRY"
    kit.clock.advance(60)
    [third] = kit.run_due()
    assert (third.state, third.job_state, third.id) == ("SUCCESS", "SUCCEEDED", h.id)
    assert kapp.calls == [7, 7, 7]  # type: ignore[attr-defined]


def test_exhausted_retries_dead_letter_and_propagate(kit: DelayedTestKit, kapp: Celery) -> None:
    apply_later(kapp, "kit.charge", (9,), {"declines": 5}, when=0)
    kit.run_due()
    kit.clock.advance(60)
    kit.run_due()
    kit.clock.advance(60)
    with pytest.raises(RuntimeError, match="declined"):
        kit.run_due(propagate=True)
    assert kapp.calls == [9, 9, 9]  # type: ignore[attr-defined]
    [letter] = kit.store.dead_letters.page()
    assert letter.task == "kit.charge"


def test_cancel_before_and_after_release(kit: DelayedTestKit, kapp: Celery) -> None:
    a = apply_later(kapp, "kit.charge", (1,), when=10)
    cancel(kapp, a.id)
    kit.assert_not_scheduled("kit.charge")
    b = apply_later(kapp, "kit.charge", (2,), when=10)
    kit.clock.advance(10)
    assert kit.release_due() == [b.id]
    cancel(kapp, b.id)  # released, not started: the worker side skips it
    [ran] = kit.run_released()
    assert ran.state == "IGNORED" and ran.job_state == "CANCELLED"
    assert kapp.calls == []  # type: ignore[attr-defined]


def test_plain_tasks_and_debounce(kit: DelayedTestKit, kapp: Celery) -> None:
    apply_later(kapp, "kit.plain", (1,), when=5, debounce_key="p", max_wait=8)
    kit.clock.advance(4)
    apply_later(kapp, "kit.plain", (2,), when=5, debounce_key="p", max_wait=8)
    kit.assert_scheduled("kit.plain", args=(2,), at=kit.clock.now() + timedelta(seconds=4))  # capped at 8 s
    kit.clock.advance(4)
    [ran] = kit.run_due()
    assert (ran.state, ran.result, ran.job_state) == ("SUCCESS", 2, "SUCCEEDED")


def test_close_restores_the_app_and_drops_its_keys(kapp: Celery, redis_url: str) -> None:
    kapp.conf.delayed_redis_url = redis_url
    own = get_store(kapp)
    with DelayedTestKit(kapp, redis_url, key_prefix="kitclose") as kit:  # the app's own Redis, named
        assert get_store(kapp) is kit.store and kit.store.config.key_prefix == "kitclose"
        apply_later(kapp, "kit.charge", (1,), when=60)
        assert kit.store.redis.client.keys("kitclose:*")
    assert get_store(kapp) is own
    assert not own.redis.client.keys("kitclose:*")


PLUGIN_TESTS = '''
import pytest
from celery_delayed import DelayedTask

def test_nothing_requested(request):
    assert not [f for f in request.fixturenames if f.startswith("delayed_")]

def test_fixtures(delayed_app, delayed_kit, delayed_clock, delayed_store):
    @delayed_app.task(base=DelayedTask, name="p.t")
    def t(x):
        return x * 2
    t.apply_later(args=(21,), when=30)
    delayed_kit.assert_scheduled(t, args=(21,))
    delayed_clock.advance(30)
    [ran] = delayed_kit.run_due()
    assert ran.result == 42 and delayed_store is delayed_kit.store
'''


def test_pytest_plugin(tmp_path: Path, redis_url: str) -> None:
    (tmp_path / "test_user.py").write_text(textwrap.dedent(PLUGIN_TESTS))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "DELAYED_TEST_REDIS_URL": redis_url}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "celery_delayed.testing.plugin", "-p", "no:cacheprovider",
            "--setup-show", str(tmp_path)]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 passed" in proc.stdout
    # nothing autouse: the test that asked for nothing set up no delayed_ fixture
    nothing = proc.stdout.split("test_nothing_requested")[0]
    assert "delayed_" not in nothing


def test_throttle_and_debounce_follow_the_kit_clock(kit: DelayedTestKit, kapp: Celery) -> None:
    a = apply_later(kapp, "kit.plain", (1,), when=0, throttle_key="t", window=60)
    kit.clock.advance(59)
    b = apply_later(kapp, "kit.plain", (2,), when=0, throttle_key="t", window=60)
    assert not b.created and b.id == a.id
    kit.clock.advance(1)
    c = apply_later(kapp, "kit.plain", (3,), when=0, throttle_key="t", window=60)
    assert c.created and c.id != a.id
    assert [job.args for job in kit.run_due()] == [(1,), (3,)]


def test_debounce_does_not_replace_a_job_waiting_for_its_retry(kit: DelayedTestKit, kapp: Celery) -> None:
    a = apply_later(kapp, "kit.charge", (1,), {"declines": 1}, when=0, debounce_key="d")
    [ran] = kit.run_due()
    assert ran.state == "RETRY" and ran.job_state == "SCHEDULED"
    b = apply_later(kapp, "kit.charge", (2,), when=0, debounce_key="d")
    assert b.created and b.id != a.id  # the retry keeps its arguments; the call is a job of its own
    kit.clock.advance(60)
    assert sorted(job.args[0] for job in kit.run_due()) == [1, 2]


def test_intercepted_apply_async_countdown(kapp: Celery, redis_url: str) -> None:
    """Code that calls Celery's own apply_async(countdown=) is tested the same way (delayed_intercept_eta)."""
    import celery_delayed

    kapp.conf.delayed_intercept_eta = True
    celery_delayed.install(kapp)
    with DelayedTestKit(kapp, redis_url) as kit:
        kapp.tasks["kit.plain"].apply_async((5,), countdown=120)
        kit.assert_scheduled("kit.plain", args=(5,), at=kit.clock.now() + timedelta(seconds=120))
        kit.clock.advance(120)
        [ran] = kit.run_due()
        assert (ran.result, ran.job_state) == (5, "SUCCEEDED")


def test_expired_jobs_are_not_run(kit: DelayedTestKit, kapp: Celery) -> None:
    late = apply_later(kapp, "kit.plain", (1,), when=10, expires=kit.clock.now() + timedelta(seconds=20))
    apply_later(kapp, "kit.plain", (2,), when=30)
    kit.clock.advance(30)  # past the first one's expiry
    assert [job.args for job in kit.run_due()] == [(2,)]
    assert kit.job_state(late.id) == "EXPIRED"


# -- which Redis the kit uses -----------------------------------------------------------------


def _nightly_app(broker: str, uid: str) -> Celery:
    """The README's "Testing a schedule" app: its broker (and so its default store) is a Redis of its own."""
    from celery.schedules import crontab

    app = Celery("kitnightly", broker=broker, set_as_current=False)
    app.conf.delayed_key_prefix = f"t{uid}"

    @app.task(name="kit.nightly", shared=False)
    def nightly() -> str:
        return "report"

    app.conf.delayed_schedule = {"nightly": {"task": "kit.nightly", "schedule": crontab(minute=30, hour=2),
                                             "timezone": "Europe/Berlin"}}
    return app


def _answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False
    finally:
        client.close()


def _redis_children() -> set[int]:
    """The redis-server processes this test process started (Linux: read /proc)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
            name, fields = rest.rsplit(") ", 1)
        except (OSError, ValueError):
            continue
        if name == "redis-server" and int(fields.split()[1]) == os.getpid():
            out.add(int(pid))
    return out


@pytest.mark.parametrize("apps_redis", ["up", "down"])
def test_with_no_url_the_kit_runs_its_own_redis_never_the_apps(apps_redis: str, redis_url: str, rclient: Any,
                                                               uid: str, monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """``DelayedTestKit(app, start=...)``, as the README's "Testing a schedule" writes it: a private
    redis-server for the kit's store, stopped when the kit closes; the app's own Redis is never touched."""
    from celery_delayed.testing import free_port

    monkeypatch.delenv("DELAYED_TEST_REDIS_URL", raising=False)
    apps = redis_url if apps_redis == "up" else f"redis://127.0.0.1:{free_port()}/0"
    app = _nightly_app(apps, uid)
    before, servers = rclient.dbsize(), _redis_children()
    with DelayedTestKit(app, start=datetime(2026, 3, 28, 23, 0, tzinfo=timezone.utc)) as kit:
        assert kit.run_due() == []
        kit.clock.advance(hours=2)  # 29 March, 03:00 in Berlin: 02:30 did not exist
        [run] = kit.run_due()
        assert (run.task, run.result, run.job_state) == ("kit.nightly", "report", "SUCCEEDED")
        own = kit.store.url
        assert own != apps and _answers(own)
        assert rclient.dbsize() == before  # nothing was written to the app's Redis
    assert not _answers(own)  # the kit's server stopped with it
    assert get_store(app).url == apps  # and the app has its own store back
    app.conf.delayed_database_url = f"sqlite:///{tmp_path / 'jobs.db'}"
    with pytest.raises(ConfigurationError, match="Redis only"):
        DelayedTestKit(app)
    assert _redis_children() == servers  # a kit that failed to start stopped its server too


def test_with_no_url_and_no_redis_server_the_kit_says_what_to_do(kapp: Celery, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELAYED_TEST_REDIS_URL", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on it
    with pytest.raises(ConfigurationError, match=r"redis-server is not installed.*redis_url=.*DELAYED_TEST_REDIS_URL"):
        DelayedTestKit(kapp)


def test_the_kit_takes_delayed_test_redis_url_and_an_explicit_url(kapp: Celery, redis_url: str, rclient: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELAYED_TEST_REDIS_URL", redis_url)
    with DelayedTestKit(kapp, key_prefix="kitenv") as kit:
        assert kit.store.url == redis_url
        apply_later(kapp, "kit.plain", (1,), when=60)
        assert rclient.keys("kitenv:*")
    assert not rclient.keys("kitenv:*")  # its keys deleted, the server (not the kit's) left running
    assert _answers(redis_url)


def test_the_apps_production_connection_settings_do_not_follow_the_kit(kapp: Celery, redis_url: str) -> None:
    """Sentinels, their options and replica acknowledgements describe the app's Redis, not the test server."""
    kapp.conf.delayed_redis_url = "sentinel://127.0.0.1:1;sentinel://127.0.0.1:2"
    kapp.conf.delayed_redis_options = {"master_name": "prod"}
    kapp.conf.delayed_wait_replicas = 1
    with DelayedTestKit(kapp, redis_url) as kit:
        h = apply_later(kapp, "kit.plain", (4,), when=5)
        kit.clock.advance(5)
        [ran] = kit.run_due()
        assert (ran.id, ran.result, ran.job_state) == (h.id, 4, "SUCCEEDED")


def test_scheduled_jobs_give_the_arguments_as_passed(kit: DelayedTestKit, kapp: Celery) -> None:
    apply_later(kapp, "kit.charge", (10,), {"declines": 0}, when=60)
    [job] = kit.scheduled_jobs()
    assert job.args == (10,) and job.kwargs == {"declines": 0}
    assert kit.assert_scheduled("kit.charge", args=[10]) == job  # a list, as given, still matches
    kit.clock.advance(60)
    [ran] = kit.run_due()
    assert ran.args == (10,)
