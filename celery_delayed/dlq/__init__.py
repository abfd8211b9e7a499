"""The dead-letter queue from Python: list, inspect, requeue and purge jobs that ran out of attempts.

Thin functions over the store's dead-letter facet
(:class:`celery_delayed.store.dead_letters.DeadLetters`, which documents what
a dead letter holds and how the queue is bounded). Each takes the app (or its
store). Times are the Redis server's clock, epoch ms. The feature's other
parts: :mod:`.cli` (``celery -A proj delayed dlq ...``), and the worker's
failure path (:mod:`celery_delayed.worker.failures`), which dead-letters a job
whose attempts ran out.
"""

from __future__ import annotations

from celery import Celery

from ..store import DeadLetter, DeadLetters, Store, get_store
from ..timeutil import due_spec

__all__ = ["DeadLetter", "count", "list_dead", "purge", "requeue", "requeue_all", "show"]


def _store(app: Celery | Store) -> Store:
    return app if isinstance(app, Store) else get_store(app)


def _letters(app: Celery | Store) -> DeadLetters:
    return _store(app).dead_letters


def count(app: Celery | Store) -> int:
    """The number of dead letters over all shards."""
    return _letters(app).count()


def list_dead(app: Celery | Store, offset: int = 0, limit: int = 50, task: str | None = None) -> list[DeadLetter]:
    """Dead letters, most recent death first, optionally of one task name.

    Raises:
        InvalidOption: a negative offset or a limit below 1.
    """
    return _letters(app).page(offset, limit, task)


def show(app: Celery | Store, job_id: str) -> dict[str, str]:
    """The whole record of a dead letter (traceback included, message left out).

    Raises:
        JobNotFound: no record with this id.
        InvalidState: the job exists but is not DEAD.
    """
    return _letters(app).show(job_id)


def requeue(app: Celery | Store, job_id: str, when: object = 0) -> int:
    """Schedule a dead letter again at ``when`` (default now), attempt counter reset; return its due time (ms).

    Raises:
        JobNotFound: no record with this id.
        InvalidState: it is not DEAD, or it has no message to send.
        InvalidWhen: a bad ``when``.
    """
    store = _store(app)
    return store.dead_letters.requeue_job(job_id, due_spec(when, store.app.timezone))


def requeue_all(app: Celery | Store, when: object = 0, task: str | None = None) -> int:
    """Schedule every dead letter (of one task name, if given) again; return how many."""
    store = _store(app)
    return store.dead_letters.requeue_all(due_spec(when, store.app.timezone), task)


def purge(app: Celery | Store, older_than: float | None = None) -> int:
    """Delete dead letters that died more than ``older_than`` seconds ago (None: all); return how many.

    Raises:
        InvalidOption: a negative or non-numeric ``older_than``.
    """
    return _letters(app).purge(older_than)
