"""``request.eta`` of a job released from the store.

Celery gives a task sent with ``countdown``/``eta`` its due time as
``self.request.eta``. A stored job's message carries that eta in its
``delayed_eta`` header (written when the job is scheduled or retried, as
Celery writes it, rewritten by ``reschedule``, ``promote`` and dead-letter
``requeue``), and a ``task_prerun`` receiver copies it into the request the
body sees, for every task (``DelayedTask`` or not). Celery's own ``eta``
header is null when a job is released at its due time; a job released ahead
of it (look-ahead) has it set to the due time by the Redis clock, so that the
worker holds it until then: the task still sees ``delayed_eta``.
"""

from __future__ import annotations

from typing import Any

from celery import signals

from ..vocab import ETA_HEADER, request_header

_connected = False


def on_task_prerun(sender: Any = None, task: Any = None, **_: Any) -> None:
    """``task_prerun`` receiver: ``request.eta`` from the ``delayed_eta`` header (a stored job's)."""
    request = getattr(task, "request", None)
    if request is None:
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
