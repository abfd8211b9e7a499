"""How celery-delayed plugs into Celery: per app, and into the ``celery`` command.

Importing ``celery_delayed`` changes nothing. Two explicit seams:

- :func:`install` wires one app: the ``send_task`` wrapper that routes
  delayed sends through the store while ``delayed_intercept_eta`` is on
  (:mod:`celery_delayed.worker.intercept`), ``app.control.revoke`` that also
  cancels a stored job (:func:`celery_delayed.cancellation.install_revoke`),
  and the embedded scheduler's worker bootstep (enabled by ``celery worker
  --delayed``). Once per process it also connects the worker side that every
  task needs: ``request.eta`` of a released job (:mod:`.worker.eta`), and the
  ``inspect scheduled`` and ``revoke`` remote-control commands that know the
  store (:mod:`.worker.control`). A producer process that wants interception
  calls it once after creating the app.
- :func:`register_with_celery` runs when the ``celery`` command loads the
  ``delayed`` sub-command (the ``celery.commands`` entry point,
  ``celery_delayed.cli``): it adds ``--delayed`` to ``celery worker``,
  installs every app that ``celery`` loads, so workers and schedulers need no
  code change, gives every task of a worker the store's execution record for the
  messages released from the store (:mod:`celery_delayed.worker.tracking`:
  a plain task's start and finish are recorded, a cancelled one is skipped),
  and applies the corrections to Celery and kombu of
  :mod:`celery_delayed.fixups` in worker processes
  (:func:`~celery_delayed.fixups.install_fixups`; ``delayed_disabled_fixups``
  leaves some out).
"""

from __future__ import annotations

from typing import Any

from celery import Celery, signals
from celery._state import connect_on_app_finalize

from . import fixups
from .cancellation import install_revoke
from .worker import bootstep, control, eta, intercept, tracking

_ATTR = "_celery_delayed_installed"
_registered = False


def install(app: Celery) -> Celery:
    """Wire celery-delayed into ``app`` (idempotent); return the app.

    Example::

        app = Celery("proj", broker="redis://...")
        app.conf.delayed_intercept_eta = True
        celery_delayed.install(app)
    """
    if not app.__dict__.get(_ATTR):
        intercept.install(app)
        install_revoke(app)
        bootstep.add_step(app)
        eta.connect()
        control.install()
        app.__dict__[_ATTR] = True
    return app


def register_with_celery() -> None:
    """Add ``--delayed`` to ``celery worker`` and install every app the ``celery`` command finalizes (once)."""
    global _registered
    if _registered:
        return
    _registered = True
    bootstep.add_worker_option()
    connect_on_app_finalize(install)
    signals.worker_init.connect(_install_fixups, weak=False)
    signals.worker_init.connect(tracking.on_worker_init, weak=False)
    signals.celeryd_after_setup.connect(fixups.on_worker_setup, weak=False)


def _install_fixups(sender: Any = None, **_: Any) -> None:
    """``worker_init`` receiver: apply the fixups in the worker's main process (before it connects)."""
    app = getattr(sender, "app", None)
    if app is not None:
        fixups.install_fixups(app)
