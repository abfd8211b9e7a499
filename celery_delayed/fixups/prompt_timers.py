"""Messages a worker holds for their eta start on time, however many fall due at once.

Upstream: kombu >=5.3.0,<5.8.0, ``kombu.asynchronous.hub.Hub.fire_timers``
(``max_timers=10``, then ``min_delay`` of one second as the poll timeout).
The same code from 5.3.0 (the oldest kombu Celery 5.3 takes) to 5.7.0; still
present in 5.7.0.

Delete when kombu's hub polls without waiting while due timers are left (or
fires every due timer in one turn). Check a new kombu version's
``fire_timers`` before widening the range.

kombu's event loop (``Hub.create_loop``, which Celery's worker runs) fires at
most ten due timers per turn (``Hub.fire_timers(max_timers=10)``) and, when
it fired ten, returns ``min_delay`` (one second) as the next poll timeout: the
eleventh due timer waits for the next I/O event or a second. Each held ETA
message is such a timer. With the prefork pool, the pool's own pipes wake the
loop constantly and this goes unseen; with the solo or threads pool and
nothing else to read (the worker is at its prefetch limit), a burst of
messages due at one instant starts at about ten per second: 2,000 due at once
had 1,150 not started 45 s later, for Celery's own ETA tasks as for jobs
released ahead of their due time (``delayed_lookahead_ms``).

:func:`install` (worker main process, ``worker_init``) wraps
``Hub.fire_timers``: when a due timer is left after the ten, the next poll
does not wait (timeout 0), so the loop still reads its sockets between every
ten timers, and goes on firing the rest. Nothing changes when no timer is due.
"""

from __future__ import annotations

import functools
from time import monotonic
from typing import Any

_MARK = "_celery_delayed_prompt_timers"


def _prompt(fire_timers: Any) -> Any:
    @functools.wraps(fire_timers)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        delay = fire_timers(self, *args, **kwargs)
        timer = self.timer
        queue = getattr(timer, "_queue", None) if timer is not None else None
        if queue and queue[0][0] <= monotonic():  # due timers left: poll without waiting, then fire them
            return 0
        return delay

    setattr(wrapper, _MARK, True)
    return wrapper


def install() -> bool:
    """Wrap kombu's ``Hub.fire_timers`` in this process (idempotent); True when it is wrapped.

    Applied before the worker's loop is made (``worker_init``), which binds ``fire_timers``; the kombu
    versions it applies to are checked by :func:`celery_delayed.fixups.install_fixups`.
    """
    from kombu.asynchronous.hub import Hub

    current = vars(Hub).get("fire_timers")
    if current is None:
        return False
    if not getattr(current, _MARK, False):
        Hub.fire_timers = _prompt(current)
    return True


def installed() -> bool:
    """Whether this process's kombu hub fires due timers without the one-second pause."""
    from kombu.asynchronous.hub import Hub

    return bool(getattr(vars(Hub).get("fire_timers"), _MARK, False))
