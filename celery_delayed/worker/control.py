"""What celery-delayed adds to a worker's remote-control commands (``celery inspect``, ``app.control``).

Installed in every process ``celery_delayed.install`` runs in (workers
started by the ``celery`` command install their app); Celery's own command
runs first and its reply is kept.

- ``inspect scheduled``: Celery lists the ETA tasks a worker holds in its
  timer. A stored job is held by no worker, so a worker with an installed
  app also lists the jobs scheduled in the store for the queues it consumes,
  in Celery's format (``{"eta", "priority", "request"}``; ``priority`` is 6,
  the timer priority Celery gives every ETA request; ``request`` is what
  ``Request.info()`` would say of the message). Bounded: the earliest
  :data:`SCHEDULED_LIMIT` such jobs among the :data:`SCHEDULED_SCAN` earliest
  of the store (``scheduled(limit=..., scan=...)`` changes both); the rest
  is in ``celery -A proj delayed list``. Every worker consuming a queue
  lists the same stored jobs: the store holds them, not one of the workers.
- ``revoke`` and ``terminate``: Celery keeps a revoked id in each worker's
  memory. A worker also cancels a stored job with that id in the store
  (:func:`~celery_delayed.cancellation.revoke_in_store`), so a revoke sent
  by any process, with or without celery-delayed, cancels it durably; the
  first worker to get it does, the others find it cancelled.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Collection
from typing import Any

from celery.utils.time import maybe_iso8601, maybe_make_aware
from celery.worker.control import Panel
from kombu.compression import decompress
from kombu.serialization import loads, prepare_accept_content

from ..cancellation import revoke_in_store
from ..store import Pending, get_store
from ..timeutil import from_ms
from ..vocab import ETA_HEADER
from .intercept import installed

logger = logging.getLogger("celery_delayed.worker")

#: Most stored jobs one ``inspect scheduled`` reply lists, and how many of the store's earliest it looks at.
SCHEDULED_LIMIT = 100
SCHEDULED_SCAN = 1000
#: The timer priority Celery's worker gives every ETA request (``inspect scheduled`` shows it).
ETA_PRIORITY = 6

_originals: dict[str, Callable[..., Any]] = {}


def install() -> None:
    """Put the commands in Celery's registry of remote-control commands (once per process)."""
    if _originals:
        return
    for name, ours in (("scheduled", scheduled), ("revoke", revoke), ("terminate", terminate)):
        _originals[name] = Panel.data[name]
        for key, fun in list(Panel.data.items()):  # the command and its aliases (dump_schedule)
            if fun is _originals[name]:
                Panel.data[key] = ours


def scheduled(state: Any, limit: int = SCHEDULED_LIMIT, scan: int = SCHEDULED_SCAN, **kwargs: Any) -> list[Any]:
    """Celery's scheduled ETA requests of this worker, then the stored jobs of the queues it consumes."""
    held = list(_originals["scheduled"](state, **kwargs))
    app = state.app
    if not installed(app):
        return held
    try:
        queues = [q.name for q in state.consumer.task_consumer.queues]
        rows = Pending(get_store(app)).messages(queues, limit=limit, max_scan=scan)
    except Exception as exc:  # the store is down: Celery's own answer stands
        logger.warning("inspect scheduled: could not list the celery-delayed store: %s", exc)
        return held
    accept = prepare_accept_content(app.conf.accept_content)
    for due_ms, msg in rows:
        try:
            held.append(scheduled_entry(msg, due_ms, state.hostname, app.timezone, accept))
        except Exception as exc:  # one bad message must not hide the others
            logger.warning("inspect scheduled: a stored message could not be read: %s", exc)
    return held


def scheduled_entry(
    msg: str, due_ms: int, hostname: str, tz: Any, accept: Collection[str] | None = None,
) -> dict[str, Any]:
    """Celery's ``inspect scheduled`` entry for a stored message (``worker/control.py``'s format).

    ``accept``: the content types the worker accepts (kombu's ``prepare_accept_content``).
    """
    env = json.loads(msg)
    headers, props = env["headers"], env["properties"]
    raw = base64.b64decode(env["body"])
    if headers.get("compression"):
        raw = decompress(raw, headers["compression"])
    args, kwargs, _ = loads(raw, env["content-type"], env["content-encoding"], accept=accept)
    eta = headers.get(ETA_HEADER)
    when = maybe_make_aware(maybe_iso8601(eta), tz) if eta else from_ms(due_ms)
    info = props.get("delivery_info") or {}
    return {
        "eta": when.isoformat(),
        "priority": ETA_PRIORITY,
        "request": {
            "id": headers["id"],
            "name": headers.get("shadow") or headers["task"],
            "args": args,
            "kwargs": kwargs,
            "type": headers["task"],
            "hostname": hostname,
            "time_start": None,
            "acknowledged": False,
            "delivery_info": {"exchange": info.get("exchange"), "routing_key": info.get("routing_key"),
                              "priority": props.get("priority"), "redelivered": False},
            "worker_pid": None,
        },
    }


def revoke(state: Any, task_id: Any, terminate: bool = False, signal: Any = None, **kwargs: Any) -> Any:
    """Celery's ``revoke``, then the stored jobs among the ids are cancelled in the store."""
    reply = _originals["revoke"](state, task_id, terminate=terminate, signal=signal, **kwargs)
    if installed(state.app):
        revoke_in_store(state.app, task_id, terminate=terminate)
    return reply


def terminate(state: Any, signal: Any, task_id: Any, **kwargs: Any) -> Any:
    """Celery's ``terminate`` (a revoke with terminate), then the same in the store."""
    reply = _originals["terminate"](state, signal, task_id, **kwargs)
    if installed(state.app):
        revoke_in_store(state.app, task_id, terminate=True)
    return reply
