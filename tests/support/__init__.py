"""What the test suite shares: apps, worker and scheduler processes, polling.

Worker and scheduler subprocesses load the Celery apps in ``worker_apps/``
(``celery -A e2e_app ...``, with that folder on their PYTHONPATH). The
private ``redis-server`` starter is the package's own
(:mod:`celery_delayed.testing.servers`), shared with ``bench/`` and
``example_project/``.
"""

from __future__ import annotations

from celery_delayed.testing import RedisServer, free_port

from .apps import IN_CI, make_app, need, port_open
from .processes import WORKER_APPS, Proc, SchedulerProcess, WorkerProcess, app_env, ran, run_celery, wait_for

__all__ = [
    "IN_CI",
    "WORKER_APPS",
    "Proc",
    "RedisServer",
    "SchedulerProcess",
    "WorkerProcess",
    "app_env",
    "free_port",
    "make_app",
    "need",
    "port_open",
    "ran",
    "run_celery",
    "wait_for",
]
