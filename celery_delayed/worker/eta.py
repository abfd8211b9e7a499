"""``request.eta`` of a job released from the store.

Celery gives a task sent with ``countdown``/``eta`` its due time as
``self.request.eta``. A stored job's message has no ``eta``, on purpose: a
worker holds a message with an eta until then by its own clock, and the
store has released the job when it is due by the Redis server's clock. The
message carries the eta instead in its ``delayed_eta`` header (written when
the job is scheduled or retried, rewritten by ``reschedule`` and dead-letter
``requeue``), and a ``task_prerun`` receiver copies it into the request the
body sees, for every task (``DelayedTask`` or not). Nothing waits on it: the
header costs the worker nothing but the copy.
"""

from __future__ import annotations

from typing import Any

from celery import signals

from ..vocab import ETA_HEADER, request_header

_connected = False


def on_task_prerun(sender: Any = None, task: Any = None, **_: Any) -> None:
    """``task_prerun`` receiver: ``request.eta`` from the ``delayed_eta`` header when Celery has none."""
    request = getattr(task, "request", None)
    if request is None or request.eta is not None:
        return
    eta = request_header(request, ETA_HEADER)
    if isinstance(eta, str) and eta:
        request.eta = eta


def connect() -> None:
    """Connect the receiver (once per process; :func:`celery_delayed.install` calls it)."""
    global _connected
    if not _connected:
        signals.task_prerun.connect(on_task_prerun, weak=False, dispatch_uid="celery_delayed.eta")
        _connected = True
