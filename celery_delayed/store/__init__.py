"""The store: jobs in sharded Redis sorted sets, changed only by Lua scripts.

:class:`Store` (``gateway.py``) composes the runner (``runner.py``: the only
code that talks to Redis), the shard layout (``layout.py``) and one facet per
calling side (``jobs.py``, ``lookup.py``, ``release.py``, ``fleet.py``,
``executions.py``, ``dead_letters.py``, ``schedules.py``, ``changes.py``,
``moves.py``): each script of ``lua/`` is run by the one facet method that
bears its name. ``keys.py`` formats every key, ``loader.py`` loads the
scripts, ``records.py`` documents the job record, ``broker_layout.py`` knows
kombu's Redis layout, and ``views.py`` lists many jobs (:class:`Pending`,
:class:`ShardStatus`).
"""

from __future__ import annotations

import dataclasses

from celery import Celery

from .broker_layout import BrokerLayout
from .dead_letters import DeadLetter, DeadLetters
from .fleet import LAYOUT_NOTICE, WakeSubscription
from .gateway import Store
from .health import ServerHealth
from .keys import Keys, ShardKeys, shard_for
from .records import Batch, NewJob, Outcome, Scheduled, Started, rehome
from .views import EtaFallbacks, Pending, ShardStatus

__all__ = [
    "LAYOUT_NOTICE",
    "Batch",
    "BrokerLayout",
    "DeadLetter",
    "DeadLetters",
    "EtaFallbacks",
    "Keys",
    "NewJob",
    "Outcome",
    "Pending",
    "Scheduled",
    "ServerHealth",
    "ShardKeys",
    "ShardStatus",
    "Started",
    "Store",
    "WakeSubscription",
    "get_store",
    "rehome",
    "set_store",
    "shard_for",
]

_STORE_ATTR = "_celery_delayed_store"
_OTHER_STORES_ATTR = "_celery_delayed_other_stores"


def get_store(app: Celery, prefix: str | None = None) -> Store:
    """Return the app's store, creating it on first use (cached on the app).

    ``prefix``: the store under another key prefix on the same Redis (a
    message names the store of its job; see ``worker/execution.job_store``).
    """
    store: Store | None = getattr(app, _STORE_ATTR, None)
    if store is None:
        store = Store(app)
        setattr(app, _STORE_ATTR, store)
    if prefix is None or prefix == store.config.key_prefix:
        return store
    others: dict[str, Store] = app.__dict__.setdefault(_OTHER_STORES_ATTR, {})
    if prefix not in others:
        others[prefix] = Store(app, dataclasses.replace(store.config, key_prefix=prefix))
    return others[prefix]


def set_store(app: Celery, store: Store | None) -> Store | None:
    """Make ``store`` the app's store (None: forget it, the next :func:`get_store` makes one);
    return the one it had (the testing kit installs its own, then puts the old one back)."""
    previous: Store | None = app.__dict__.get(_STORE_ATTR)
    if store is None:
        app.__dict__.pop(_STORE_ATTR, None)
    else:
        setattr(app, _STORE_ATTR, store)
    return previous
