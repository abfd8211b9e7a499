"""Embedded scheduler: ``celery -A proj worker --delayed`` runs one in the worker.

Like ``-B``, for small deployments: the scheduler runs in a thread of the
worker's main process and stops with the worker. The ``--delayed`` option is
added to ``celery worker`` by the ``delayed`` command's entry point
(:func:`celery_delayed.plugin.register_with_celery`); :func:`add_step` adds
the step to an app (``celery_delayed.install`` does).
"""

from __future__ import annotations

import logging
from typing import Any

import click
from celery import Celery, bootsteps

from ..errors import StoreUnavailable
from ..scheduler import Scheduler

logger = logging.getLogger("celery_delayed.scheduler")


class DelayedSchedulerStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep that runs a :class:`Scheduler` in a thread when enabled."""

    label = "celery-delayed scheduler"

    def __init__(self, parent: Any, delayed: bool = False, **kwargs: Any) -> None:
        self.enabled = bool(delayed)
        self.scheduler: Scheduler | None = None
        self.exporter: Any = None
        super().__init__(parent, **kwargs)

    def start(self, parent: Any) -> None:
        self.scheduler = Scheduler(parent.app)
        try:
            # Settings that disagree with the store's stop the worker here, before
            # the scheduler joins; an unreachable store is the loop's to retry.
            self.scheduler.preflight()
        except StoreUnavailable as exc:
            logger.warning("celery-delayed scheduler: store unavailable at start (%s); retrying", exc)
        self.scheduler.start()  # a daemon thread
        port = self.scheduler.config.metrics_port
        if port is not None:
            from ..metrics import serve

            try:
                self.exporter = serve(parent.app, port, self.scheduler.config.metrics_address)
            except (ImportError, OSError) as exc:
                logger.error("celery-delayed metrics: cannot serve on port %d: %s", port, exc)

    def stop(self, parent: Any) -> None:
        if self.exporter is not None:
            self.exporter.shutdown()
            self.exporter = None
        if self.scheduler is not None:
            self.scheduler.stop(timeout=10)

    shutdown = stop


def add_step(app: Celery) -> None:
    """Add the embedded-scheduler bootstep to ``app``'s workers (enabled by ``--delayed``)."""
    if DelayedSchedulerStep not in app.steps["worker"]:
        app.steps["worker"].add(DelayedSchedulerStep)


def _on_delayed_flag(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        obj = ctx.find_object(object) if ctx.obj is None else ctx.obj
        app = getattr(obj, "app", None)
        if app is not None:
            add_step(app)
    return value


DELAYED_OPTION = click.Option(
    ["--delayed"],
    is_flag=True,
    default=False,
    callback=_on_delayed_flag,
    expose_value=True,
    help="Also run a celery-delayed scheduler in this worker (like -B for beat).",
)


def add_worker_option() -> None:
    """Add ``--delayed`` to ``celery worker`` (once)."""
    from celery.bin.worker import worker

    if not any(getattr(p, "name", None) == "delayed" for p in worker.params):
        worker.params.append(DELAYED_OPTION)
