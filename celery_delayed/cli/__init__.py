"""``celery -A proj delayed ...``: the ``celery.commands`` entry point of celery-delayed.

Sub-commands: ``run`` and ``status`` (:mod:`.scheduler`); ``list``, ``show``
and ``cancel`` (:mod:`.jobs`); ``dlq list | show | requeue | purge``
(:mod:`celery_delayed.dlq.cli`); ``db init`` and ``reconcile`` (:mod:`.durability`); ``pause``, ``resume``, ``promote``,
``doctor`` (:mod:`.ops`); ``limits [set | lift | reset]`` and ``tenants``
(:mod:`.shaping`); ``web`` (:mod:`.web`); ``schedules list | show | add | remove | pause |
resume | run-now`` (:mod:`celery_delayed.schedules.cli`); ``absorb``
(:mod:`celery_delayed.adoption.cli`). Every command prints one clear line and exits 1 on a
celery-delayed error (bad settings, store unreachable or full, no such job).

The ``celery`` command imports this module to load the ``delayed`` group; that
is also where celery-delayed plugs into the ``celery`` command
(:func:`celery_delayed.plugin.register_with_celery`: ``worker --delayed``,
and every app it loads is installed).
"""

from __future__ import annotations

from ..adoption import cli as adoption
from ..dlq import cli as dlq
from ..plugin import register_with_celery
from ..schedules import cli as schedules
from . import durability, jobs, ops, reshard, scheduler, shaping, web
from ._common import delayed

__all__ = ["adoption", "delayed", "dlq", "durability", "jobs", "ops", "reshard", "scheduler", "schedules",
           "shaping", "web"]

register_with_celery()
