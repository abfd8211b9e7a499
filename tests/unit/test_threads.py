"""BackgroundThread: ticks, a prompt stop, errors logged and survived, wake-ups, the hooks."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from celery_delayed.threads import BackgroundThread

LONG_S = 60.0  # a wait no test sits out: each ends it by a stop or a wake-up


def fail(exc: Exception) -> float | None:
    """A tick's step that raises ``exc``."""
    raise exc


class Ticker(BackgroundThread):
    """Puts each tick's number on a queue; ``step`` may raise or return the next wait."""

    backoff_s = 0.01
    max_backoff_s = 0.05

    def __init__(self, tick_s: float = LONG_S, step: Callable[[int], float | None] | None = None) -> None:
        super().__init__(name="test-ticker")
        self.tick_s = tick_s
        self.step = step
        self.ticks: queue.Queue[int] = queue.Queue()
        self.count = 0
        self.events: list[str] = []

    def body(self) -> float | None:
        self.count += 1
        self.ticks.put(self.count)
        return self.step(self.count) if self.step is not None else None

    def on_start(self) -> None:
        self.events.append(f"start in {threading.current_thread().name}")

    def on_exit(self) -> None:
        self.events.append(f"exit in {threading.current_thread().name}")

    def next_tick(self, timeout: float = 5.0) -> int:
        return self.ticks.get(timeout=timeout)

    def no_tick_within(self, seconds: float) -> bool:
        try:
            self.ticks.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


@pytest.fixture
def threads() -> Iterator[list[BackgroundThread]]:
    """Threads a test starts; each is stopped at the end whatever the test did."""
    started: list[BackgroundThread] = []
    yield started
    for t in started:
        t.stop(timeout=5)


def test_ticks_run_every_tick_s_in_a_named_daemon_thread(threads: list[BackgroundThread]) -> None:
    t = Ticker(tick_s=0.01)
    threads.append(t)
    t.start()
    assert [t.next_tick() for _ in range(3)] == [1, 2, 3]
    assert t.daemon and t.name == "test-ticker"
    assert t.events == ["start in test-ticker"]


def test_the_wait_body_returns_is_used(threads: list[BackgroundThread]) -> None:
    t = Ticker(tick_s=LONG_S, step=lambda n: 0.0)  # body says: no wait, whatever tick_s is
    threads.append(t)
    t.start()
    assert [t.next_tick() for _ in range(3)] == [1, 2, 3]


def test_stop_ends_a_long_wait_at_once_and_runs_on_exit(threads: list[BackgroundThread]) -> None:
    t = Ticker(tick_s=LONG_S)
    threads.append(t)
    t.start()
    assert t.next_tick() == 1  # now waiting a minute
    started = time.monotonic()
    t.stop(timeout=5)
    assert time.monotonic() - started < 1.0
    assert not t.is_alive() and t.stopping
    assert t.events == ["start in test-ticker", "exit in test-ticker"]
    assert t.count == 1


def test_wake_runs_the_next_tick_at_once(threads: list[BackgroundThread]) -> None:
    t = Ticker(tick_s=LONG_S)
    threads.append(t)
    t.start()
    assert t.next_tick() == 1
    for n in (2, 3):
        started = time.monotonic()
        t.wake()
        assert t.next_tick(timeout=5) == n
        assert time.monotonic() - started < 1.0


def test_a_wake_up_during_a_tick_is_not_lost(threads: list[BackgroundThread]) -> None:
    t = Ticker(tick_s=LONG_S)

    def step(n: int) -> None:
        if n == 1:
            t.wake()  # woken while ticking

    t.step = step
    threads.append(t)
    t.start()
    assert [t.next_tick(), t.next_tick()] == [1, 2]


def test_a_tick_that_raises_is_logged_with_the_name_and_the_loop_goes_on(
        threads: list[BackgroundThread], caplog: pytest.LogCaptureFixture) -> None:
    t = Ticker(tick_s=LONG_S, step=lambda n: fail(RuntimeError(f"boom {n}")) if n <= 2 else None)
    threads.append(t)
    with caplog.at_level(logging.ERROR, logger="celery_delayed.threads"):
        t.start()
        assert [t.next_tick() for _ in range(3)] == [1, 2, 3]  # backed off 0.01 s, then 0.02 s
    records = [r for r in caplog.records if r.name == "celery_delayed.threads"]
    assert [r.getMessage() for r in records] == [
        "test-ticker: tick failed (boom 1); retrying in 0.0s",
        "test-ticker: tick failed (boom 2); retrying in 0.0s",
    ]
    assert all(r.exc_info is not None for r in records)
    assert t.is_alive()
    assert t.failures == 0  # the third tick went through


def test_on_error_sees_the_failures_in_a_row_and_sets_the_back_off(threads: list[BackgroundThread]) -> None:
    seen: list[tuple[str, int]] = []

    class Failing(Ticker):
        def on_error(self, exc: Exception) -> float:
            seen.append((str(exc), self.failures))
            return 0.0 if self.failures < 3 else LONG_S

    t = Failing(step=lambda n: fail(ValueError(f"bad {n}")))
    threads.append(t)
    t.start()
    assert [t.next_tick() for _ in range(3)] == [1, 2, 3]
    assert t.no_tick_within(0.2)  # the third failure backs off a minute
    assert seen == [("bad 1", 1), ("bad 2", 2), ("bad 3", 3)]


def test_a_failed_tick_sleeps_its_back_off_even_when_woken_during_it(threads: list[BackgroundThread]) -> None:
    class WokenThenFails(Ticker):
        def body(self) -> float | None:
            super().body()
            self.wake()  # e.g. a listener's wake-up while the store is down
            raise ConnectionError("down")

        def on_error(self, exc: Exception) -> float:
            return LONG_S

    t = WokenThenFails()
    threads.append(t)
    t.start()
    assert t.next_tick() == 1
    assert t.no_tick_within(0.2)
    t.wake()  # a wake-up after the failure does end the back-off
    assert t.next_tick() == 2


def test_an_on_error_that_raises_does_not_end_the_loop(
        threads: list[BackgroundThread], caplog: pytest.LogCaptureFixture) -> None:
    class BadHandler(Ticker):
        def on_error(self, exc: Exception) -> float:
            raise KeyError("handler")

    t = BadHandler(step=lambda n: fail(RuntimeError("tick")) if n == 1 else None)
    threads.append(t)
    with caplog.at_level(logging.ERROR, logger="celery_delayed.threads"):
        t.start()
        assert [t.next_tick(), t.next_tick()] == [1, 2]  # after the default back-off, 0.01 s
    assert "test-ticker: handling an error failed; retrying in 0.0s" in caplog.messages


def test_on_error_may_stop_the_loop(threads: list[BackgroundThread]) -> None:
    class StopOnError(Ticker):
        def on_error(self, exc: Exception) -> float:
            self.request_stop()  # e.g. a setting the store refuses
            return 0.0

    t = StopOnError(step=lambda n: fail(RuntimeError("fatal")))
    threads.append(t)
    t.start()
    t.join(5)
    assert not t.is_alive() and t.count == 1
    assert t.events[-1] == "exit in test-ticker"


def test_run_in_the_callers_thread_ends_on_request_stop() -> None:
    t = Ticker(tick_s=0.01)

    def step(n: int) -> None:
        if n == 3:
            t.request_stop()

    t.step = step
    t.run()  # returns once stopped; never started as a thread of its own
    assert t.count == 3
    assert t.events == [f"start in {threading.current_thread().name}", f"exit in {threading.current_thread().name}"]
    t.stop()  # no join: the thread was never started
    assert t.ident is None


def test_backoff_doubles_up_to_the_cap() -> None:
    t = Ticker()
    t.backoff_s, t.max_backoff_s = 0.1, 0.5
    assert [t.backoff(n) for n in range(1, 6)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    assert t.backoff(0) == 0.1
