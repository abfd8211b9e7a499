"""The README's demo command, small: every task runs once, none twice, nothing left running."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(150)
def test_demo_runs_every_task_once(redis_url: str) -> None:
    env = dict(os.environ, REDIS_URL=redis_url)
    proc = subprocess.run(
        [str(ROOT / "scripts" / "demo"), "--tasks", "300", "--spread", "2"],
        cwd=ROOT, env=env | {"PYTHON": sys.executable}, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"demo exited {proc.returncode}:\n{out[-4000:]}\n{proc.stderr[-4000:]}"

    def count(name: str) -> int:
        m = re.search(rf"^{name}\s+(\d+)", out, re.MULTILINE)
        assert m, f"no {name!r} line in the demo's output:\n{out}"
        return int(m.group(1))

    scheduled, cancelled = count("scheduled"), count("cancelled")
    assert scheduled == 300
    assert count("released") == count("executed") == scheduled - cancelled
    assert re.search(r"^executed\s+\d+\s+\(all\)", out, re.MULTILINE)
    assert count("duplicates") == 0
    assert "(executed anyway: 0)" in out
    assert re.search(r"^lateness\s+p50 [\d.]+ ms\s+p99 [\d.]+ ms\s+max [\d.]+ ms", out, re.MULTILINE)
    # The verdict states its threshold; LATE (a loaded machine) exits 0 like OK, in honest words.
    assert re.search(r"^(OK: every task ran once, on time \(p99 [\d.]+ m?s, threshold 250 ms\)"
                     r"|LATE: every task ran once, but p99 lateness [\d.]+ m?s is over the 250 ms threshold "
                     r"\(the machine could not keep up\))$", out, re.MULTILINE), out
    assert out.rstrip().splitlines()[-1].startswith("done in")
    pids = [int(p) for p in re.findall(r"^(?:worker|scheduler) .*\(pid (\d+)\)$", out, re.MULTILINE)]
    assert len(pids) == 2
    for pid in pids:  # the demo stopped (and reaped) the worker and the scheduler
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # On a shared Redis (REDIS_URL) the demo removes its own keys.
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert not list(client.scan_iter(match="*demo-*", count=1000))


@pytest.mark.parametrize(("args", "message"), [
    (["--tasks", "0"], "--tasks: must be between 1 and 1000000, got 0"),
    (["--tasks", "many"], "--tasks: must be a whole number, got 'many'"),
    (["--spread", "nan"], "--spread: must be between 0 and 3600 seconds, got nan"),
    (["--spread=-1"], "--spread: must be between 0 and 3600 seconds, got -1"),
])
def test_demo_rejects_bad_options(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from example_project.demo import main
    finally:
        sys.path.remove(str(ROOT))
    with pytest.raises(SystemExit) as exc:
        main(args)  # argument errors come before anything is started
    assert exc.value.code == 2
    out = capsys.readouterr()
    assert message in out.err
    assert out.out == ""


def _outcome(lateness_ms: list[float], duplicates: int = 0) -> Any:
    sys.path.insert(0, str(ROOT))
    try:
        from example_project.demo import Outcome
    finally:
        sys.path.remove(str(ROOT))
    n = len(lateness_ms)
    return Outcome(scheduled=n + 1, cancelled=1, released=n, executed=n, duplicates=duplicates, cancelled_ran=0,
                   lateness_ms=sorted(lateness_ms))


@pytest.mark.parametrize(("lateness_ms", "duplicates", "line"), [
    ([1.0] * 99 + [12.34], 0, "OK: every task ran once, on time (p99 1.0 ms, threshold 250 ms)"),
    ([1.0] * 98 + [249.0, 300.0], 0, "OK: every task ran once, on time (p99 249.0 ms, threshold 250 ms)"),
    ([1.0] * 98 + [4900.0, 5000.0], 0,
     "LATE: every task ran once, but p99 lateness 4.9 s is over the 250 ms threshold "
     "(the machine could not keep up)"),
    ([1.0] * 100, 1, "FAILED: not every task ran exactly once"),
])
def test_demo_verdict_states_its_threshold(lateness_ms: list[float], duplicates: int, line: str) -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from example_project.demo import LATE_P99_MS, verdict
    finally:
        sys.path.remove(str(ROOT))
    assert LATE_P99_MS == 250
    assert verdict(_outcome(lateness_ms, duplicates), LATE_P99_MS) == line


def test_demo_says_when_redis_url_is_unreachable() -> None:
    from support import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    proc = subprocess.run(
        [sys.executable, "-m", "example_project.demo", "--tasks", "10"],
        cwd=ROOT, env=dict(os.environ, REDIS_URL=url), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert f"cannot reach Redis at {url}" in proc.stderr
    assert "unset REDIS_URL" in proc.stderr
    assert "worker" not in proc.stdout  # nothing was started
