"""The one shape of the package's background threads: a tick, a wait, a prompt stop.

:class:`BackgroundThread` takes the shape of Celery's ``bgThread``
(``celery/utils/threads.py``): a daemon thread whose :meth:`~BackgroundThread.body`
does one tick, and a :meth:`~BackgroundThread.stop` that sets an event and
joins. Unlike Celery's, an error in a tick never ends the process nor the
thread: it is logged with the thread's name and the loop goes on after a
back-off, as every loop of this package did by hand before.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


class BackgroundThread(threading.Thread):
    """A daemon thread that runs :meth:`body` in a loop until :meth:`stop`.

    Between two ticks it waits on an event, so :meth:`stop` ends the wait at
    once and :meth:`wake` cuts it short to run the next tick now. A tick that
    raises is passed to :meth:`on_error`, which logs it and says how long to
    back off before the next one; the loop goes on.

    Subclasses implement :meth:`body` and may set :attr:`tick_s`,
    :attr:`backoff_s`, :attr:`max_backoff_s` and :attr:`stop_timeout_s`, and
    override the hooks :meth:`on_start`, :meth:`on_error` and :meth:`on_exit`.
    :meth:`run` may also be called directly (in the caller's thread): it
    returns once :meth:`request_stop` is called.

    Args:
        name: the thread's name (default: the class's name); it heads the
            default error log.
    """

    #: Seconds between two ticks when :meth:`body` returns None.
    tick_s: float = 1.0
    #: Back-off after the first failed tick in a row, doubled for each further one (see :meth:`backoff`).
    backoff_s: float = 0.1
    #: The longest back-off, in seconds.
    max_backoff_s: float = 5.0
    #: How long :meth:`stop` waits for the thread to end by default, in seconds.
    stop_timeout_s: float = 10.0

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name=name or type(self).__name__, daemon=True)
        #: Ticks that failed in a row (0 after a tick that succeeded); read by :meth:`on_error`.
        self.failures = 0
        # Double underscores: a subclass's own attributes cannot shadow these.
        self.__stopping = threading.Event()
        self.__woken = threading.Event()

    # -- the subclass's part --------------------------------------------------------

    def body(self) -> float | None:
        """Do one tick; return the seconds to wait before the next (None: :attr:`tick_s`)."""
        raise NotImplementedError

    def on_start(self) -> None:
        """Run in the thread before the first tick (default: nothing)."""

    def on_error(self, exc: Exception) -> float:
        """Handle an exception a tick raised; return the seconds to back off before the next tick.

        :attr:`failures` already counts this one. The default logs the
        traceback with the thread's name and backs off by :meth:`backoff`.
        """
        delay = self.backoff(self.failures)
        logger.exception("%s: tick failed (%s); retrying in %.1fs", self.name, exc, delay)
        return delay

    def on_exit(self) -> None:
        """Run in the thread once the loop has ended, however it ended (default: nothing)."""

    def backoff(self, failures: int) -> float:
        """The back-off after ``failures`` failed ticks in a row: :attr:`backoff_s` doubled each time, capped."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** max(failures - 1, 0)))

    # -- control ----------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """True once :meth:`request_stop` (or :meth:`stop`) was called."""
        return self.__stopping.is_set()

    def wake(self) -> None:
        """End the current wait: the next tick runs now (a tick under way is followed by another at once)."""
        self.__woken.set()

    def request_stop(self) -> None:
        """Ask the loop to stop after the tick under way, without waiting (safe in a signal handler)."""
        self.__stopping.set()
        self.__woken.set()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop after the tick under way and wait for the thread to end.

        Args:
            timeout: the longest wait, in seconds (default :attr:`stop_timeout_s`).
                Nothing is waited for when the thread was never started (its
                :meth:`run` was called by another thread) or when called from
                the thread itself.
        """
        self.request_stop()
        if self.ident is not None and threading.current_thread() is not self:
            self.join(self.stop_timeout_s if timeout is None else timeout)

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        """Tick until stopped: :meth:`on_start`, then :meth:`body` and a wait, again and again, then :meth:`on_exit`."""
        try:
            self.on_start()
            while not self.__stopping.is_set():
                self.__woken.clear()  # a wake() from here on ends the coming wait
                try:
                    delay = self.body()
                except Exception as exc:
                    self.failures += 1
                    delay = self._handle(exc)
                    self.__woken.clear()  # a failed tick is followed by its back-off first
                else:
                    self.failures = 0
                if delay is None:
                    delay = self.tick_s
                if delay > 0 and not self.__stopping.is_set():
                    self.__woken.wait(delay)
        finally:
            self.on_exit()

    def _handle(self, exc: Exception) -> float:
        """:meth:`on_error`, guarded: a failing handler must not end the loop either."""
        try:
            return self.on_error(exc)
        except Exception:
            delay = self.backoff(self.failures)
            logger.exception("%s: handling an error failed; retrying in %.1fs", self.name, delay)
            return delay
