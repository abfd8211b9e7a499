"""The Quickstart as a reader follows it: its tasks.py, its two commands, its first reminder runs.

The page's own text is used: the ``# tasks.py`` block (its local Redis replaced by the suite's
private one), the worker and scheduler commands of its console block, and the block that schedules
the first reminder, run verbatim. The worker must print the reminder and the job end SUCCEEDED.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "tutorial" / "quickstart.md"
LOCAL_REDIS = "redis://127.0.0.1:6379/0"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def _block_starting(language: str, first: str) -> str:
    return next(b for b in _blocks(language) if b.startswith(first))


def _commands() -> list[list[str]]:
    """The console block that starts the worker and the scheduler, as argv lists."""
    block = next(b for b in _blocks("console") if "worker" in b and "delayed run" in b)
    lines = [line.removeprefix("$ ").split() for line in block.splitlines() if line.startswith("$ celery")]
    assert [" ".join(c[3:5]) for c in lines] == ["worker -l", "delayed run"], lines
    return [[sys.executable, "-m", *c] for c in lines]


@pytest.fixture
def project(tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    tasks = _block_starting("python", "# tasks.py")
    assert LOCAL_REDIS in tasks
    (tmp_path / "tasks.py").write_text(tasks.replace(LOCAL_REDIS, redis_url))
    monkeypatch.syspath_prepend(str(tmp_path))
    from celery import _state

    current, finalizers = _state.get_current_app(), set(_state._on_app_finalizers)
    yield tmp_path
    sys.modules.pop("tasks", None)
    _state._set_current_app(current)  # the page's app and its shared task do not reach later tests
    _state._on_app_finalizers.intersection_update(finalizers)


def test_the_quickstart_runs_as_written(project: Path, redis_url: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(project), str(ROOT)]), PYTHONUNBUFFERED="1")
    logs = [project / "worker.log", project / "scheduler.log"]
    procs = [subprocess.Popen(cmd, cwd=project, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
             for cmd, log in zip(_commands(), logs, strict=True)]
    try:
        namespace: dict[str, object] = {}
        exec(_block_starting("python", "from tasks import remind\n"), namespace)  # the page's block, verbatim
        h = namespace["h"]
        deadline = time.monotonic() + 60
        while "reminding 42: time is up" not in logs[0].read_text():
            assert all(p.poll() is None for p in procs), "\n".join(log.read_text()[-3000:] for log in logs)
            assert time.monotonic() < deadline, "no reminder within 60 s:\n" + logs[0].read_text()[-3000:]
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while h.job_state != "SUCCEEDED":  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, h.job_state  # type: ignore[attr-defined]
            time.sleep(0.1)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
