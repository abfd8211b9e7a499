"""Per-test Celery apps and the rule for servers a test needs."""

from __future__ import annotations

import os
import socket

import pytest
from celery import Celery

IN_CI = bool(os.environ.get("CI"))


def need(what: str, available: bool) -> None:
    """Skip when a server the test needs is missing; fail instead when CI is set."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI but is not available")
    pytest.skip(f"{what} is not available")


def port_open(host: str, port: int) -> bool:
    """Whether something listens on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def make_app(broker: str, uid: str, **conf: object) -> Celery:
    """A Celery app with its own key prefix (``t<uid>``) and default queue (``q<uid>``)."""
    app = Celery(f"t{uid}", broker=broker, set_as_current=False)
    app.conf.update(
        delayed_key_prefix=f"t{uid}",
        task_default_queue=f"q{uid}",
        broker_connection_retry_on_startup=True,
        **conf,
    )
    return app
