"""kombu 5.7's crash after a Redis restart (issue 9, item 15), and the worker-side guard against it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kombu
import pytest

from celery_delayed.fixups import FIXUPS

SCENARIO = Path(__file__).resolve().parents[1] / "support" / "scenarios" / "kombu_reconnect.py"
affected = FIXUPS["reconnect_guard"].applies_to(kombu.__version__)


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, str(SCENARIO), *args], capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


@pytest.mark.timeout(120)
@pytest.mark.skipif(not affected, reason=f"kombu {kombu.__version__} is outside the guarded versions")
def test_reconnect_after_a_redis_kill_crashes_kombu_without_the_guard_and_not_with_it():
    bare = [_run() for _ in range(3)]
    assert any("RESULT: CRASH AttributeError" in o and "hostname" in o for o in bare), bare
    guarded = [_run("--guard") for _ in range(3)]
    assert all("RESULT: OK" in o for o in guarded), guarded


@pytest.mark.e2e
@pytest.mark.timeout(60)
@pytest.mark.skipif(not affected, reason=f"kombu {kombu.__version__} is outside the guarded versions")
@pytest.mark.parametrize("disabled", [False, True], ids=["applied", "disabled"])
def test_a_worker_applies_the_guard_unless_it_is_disabled(redis_url, uid, workers, disabled):
    from support import WorkerProcess

    conf = {"delayed_disabled_fixups": ["reconnect_guard"] if disabled else []}
    w = WorkerProcess(redis_url, f"t{uid}", f"q{uid}", concurrency=1, pool="threads", conf=conf)
    workers.append(w)
    w.wait_ready()
    assert ("guarded kombu's Redis channels" in w.output()) is not disabled
