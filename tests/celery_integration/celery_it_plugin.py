"""pytest plugin loaded into Celery's integration-test session: ``-p celery_it_plugin`` (intercept modes).

Celery's files stay untouched; this module is on ``PYTHONPATH`` and pytest
imports it before ``t/integration/conftest.py``, so:

* every app the suite finalizes is installed (``celery_delayed.install``):
  the session worker's app and each test's app. The session worker is a
  thread of this process and its prefork pool children are forked from it,
  so ``retry()`` / ``apply_async(countdown=)`` inside tasks go through the
  store too. The switch is ``delayed_intercept_eta`` in
  ``integration-tests-config.json`` (read by the conftest's ``celery_config``).
* ``CELERY_IT_SCHEDULER=worker`` runs the scheduler inside the session
  worker, as ``celery worker --delayed`` does (the bootstep, enabled through
  ``celery_worker_parameters``); otherwise ``run.py`` starts ``celery -A
  celery_it_app delayed run`` beside the session.
* ``CELERY_IT_TRACE=path`` logs each delayed send and whether it was stored
  (one JSON line each), so ``run.py`` can check that interception happened.
* The session stops at once (exit status 3) when the session app is not
  installed and opted in, or (worker mode) no scheduler joins the store.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
from celery._state import connect_on_app_finalize

import celery_delayed
from celery_delayed.worker import intercept

connect_on_app_finalize(celery_delayed.install)


def _trace_decisions(path: str) -> None:
    """Log every delayed send_task and whether celery-delayed stored it.

    Wraps intercept._maybe_store (looked up at call time by the send_task
    wrapper); the prefork pool children are forked from this process, so
    retries sent from inside tasks are logged too ("where": "worker").
    """
    original, main_pid = intercept._maybe_store, os.getpid()

    def traced(app: Any, name: str, args: Any, kwargs: Any, countdown: Any, eta: Any, task_id: Any,
               more: Any, options: Any) -> Any:
        out = original(app, name, args, kwargs, countdown, eta, task_id, more, options)
        in_test = os.getpid() == main_pid  # pool children: PYTEST_CURRENT_TEST is stale from the fork
        rec = {"where": "test" if in_test else "worker",
               "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0] if in_test else None,
               "task": name, "countdown": countdown, "eta": str(eta) if eta is not None else None,
               "retries": options.get("retries"), "stored": out is not None}
        with open(path, "a") as fh:  # O_APPEND: one short write per line, safe across processes
            fh.write(json.dumps(rec) + "\n")
        return out

    intercept._maybe_store = traced  # type: ignore[assignment]


if os.environ.get("CELERY_IT_TRACE"):
    _trace_decisions(os.environ["CELERY_IT_TRACE"])

_IN_WORKER = os.environ.get("CELERY_IT_SCHEDULER") == "worker"


def pytest_report_header(config: Any) -> str:
    path = config.rootpath / "integration-tests-config.json"
    overrides = json.loads(path.read_text()) if path.exists() else {}
    return (f"celery-delayed {celery_delayed.__version__} from {os.path.dirname(celery_delayed.__file__)}, "
            f"integration-tests-config.json={overrides}, "
            f"scheduler={'in the session worker (--delayed)' if _IN_WORKER else 'celery delayed run'}")


if _IN_WORKER:
    @pytest.fixture(scope="session")
    def celery_worker_parameters() -> dict[str, Any]:
        """The session worker runs the scheduler, as ``celery worker --delayed``."""
        return {"delayed": True}


@pytest.fixture(scope="session", autouse=True)
def _celery_it_check(celery_session_app: Any, request: pytest.FixtureRequest) -> None:
    """Stop the session unless the session app intercepts (and, in worker mode, its worker schedules)."""
    celery_delayed.install(celery_session_app)  # idempotent; the finalize hook may not have run yet
    if not (intercept.installed(celery_session_app) and celery_session_app.conf.get("delayed_intercept_eta")):
        pytest.exit("celery-delayed interception is not enabled for the session app", returncode=3)
    if _IN_WORKER:
        request.getfixturevalue("celery_session_worker")
        store = celery_delayed.get_store(celery_session_app)
        deadline = time.monotonic() + 30
        while not store.fleet.live_members():
            if time.monotonic() > deadline:
                pytest.exit("the session worker runs no celery-delayed scheduler", returncode=3)
            time.sleep(0.1)
