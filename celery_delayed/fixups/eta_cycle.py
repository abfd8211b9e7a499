"""A held ETA message's request is freed when it finishes, not by Python's cycle collector.

Upstream: celery >=5.7.0,<5.8.0, ``celery.worker.strategy.default``, which
keeps an ETA request's timer entry on the request
(``req._eta_timer_entry``, new in 5.7.0: absent up to 5.6.3). Still present
in 5.7.0.

Delete when Celery drops a fired entry from its request (or no longer keeps
it there). Check a new Celery version's ``strategy.default`` and
``Consumer.on_close`` before widening the range.

Celery 5.7's worker keeps the timer entry of each ETA request on the request
(``req._eta_timer_entry = call_at(eta, apply_eta_task, (req,))``, so that
``Consumer.on_close`` can cancel it), and the entry's arguments hold the
request: a reference cycle that outlives the timer. Every ETA request, with
its kombu message, its promises and bound methods (about 28 objects), then
stays in memory after its task finished until the cycle collector finds it.
It has lived long enough by then to reach the oldest generation, so it is
freed only by a full collection, which scans every object of the worker's
main process: measured with 3,000 held messages (bench scenario 16), full
collections of 55-76 ms that collected 33,000-85,000 such objects, and the
timers of the tasks due meanwhile fired that much late (the scenario's p99).
Jobs released ahead of their due time (``delayed_lookahead_ms``) are ETA
messages too.

:func:`install` (worker main process, ``worker_init``) wraps the two
consumer methods the entry calls when it fires, ``apply_eta_task`` and
``_limit_post_eta`` (rate-limited tasks), so that they first drop the
request's reference to its entry: a fired entry has nothing left to cancel.
The request is then freed by reference counting when its task is done.
Nothing changes for an entry that has not fired.
"""

from __future__ import annotations

import functools
from typing import Any

_MARK = "_celery_delayed_drops_fired_entry"
_METHODS = ("apply_eta_task", "_limit_post_eta")


def _dropping(method: Any) -> Any:
    @functools.wraps(method)
    def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(request, "_eta_timer_entry", None) is not None:
            request._eta_timer_entry = None  # fired: on_close has nothing left to cancel
        return method(self, request, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    return wrapper


def install() -> bool:
    """Wrap the consumer's ETA callbacks in this process (idempotent); True when they are wrapped.

    Only where Celery keeps the entry on the request (``Request._eta_timer_entry``). Applied before
    the consumer's task strategies bind the methods (``worker_init``); the Celery versions it applies
    to are checked by :func:`celery_delayed.fixups.install_fixups`.
    """
    from celery.worker.consumer.consumer import Consumer
    from celery.worker.request import Request

    if not hasattr(Request, "_eta_timer_entry"):
        return False
    wrapped = False
    for name in _METHODS:
        current = vars(Consumer).get(name)
        if current is None:
            continue
        if not getattr(current, _MARK, False):
            setattr(Consumer, name, _dropping(current))
        wrapped = True
    return wrapped
