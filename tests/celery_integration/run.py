#!/usr/bin/env python3
"""Celery's own integration tests about delays, run with celery-delayed's interception on.

    python tests/celery_integration/run.py                 # CI: intercept and worker-delayed, in parallel
    python tests/celery_integration/run.py plain intercept --jobs 2
    python tests/celery_integration/run.py intercept --files test_inspect -k scheduled --sdist celery-5.7.0.tar.gz

The tests are those of the installed Celery version's source distribution
(``pip download --no-binary :all: --no-deps celery==<version>`` into a
temporary folder, or ``--sdist``), selected as issue 16 does: in
``t/integration/`` test_tasks.py, test_canvas.py and test_inspect.py (one
pytest session each), ``-k "countdown or eta or retry or retried or retries
or expire or revoke or scheduled"``; Redis broker and backend.

Modes (the ``integration-tests-config.json`` written at the tree's root):

- ``plain``: no file, no celery-delayed: Celery alone, for comparison;
- ``intercept``: ``delayed_intercept_eta`` on, ``delayed_intercept_min_delay_s``
  0 (every delay goes through the store), a ``celery delayed run`` scheduler
  process beside the session;
- ``intercept-default``: the same with the default minimum delay (1 s);
- ``worker-delayed``: as ``intercept``, with the scheduler inside the session
  worker (``celery worker --delayed``'s bootstep) instead.

Each session gets its own ``redis-server`` on a free port (never 6379), and
in intercept modes its scheduler; pytest runs with a hard timeout in its own
process group, which is then killed with everything else. Sessions run
``--jobs`` at a time (the suite mostly sleeps). Exit status 0 when, in every
mode, every selected test passed (the last result of a rerun counts) except
those in :data:`CANNOT_PASS` (none today), and, with the default selection,
each file ran the README's number of tests (:data:`TESTS`); in intercept modes
(minimum delay 0) every session stored every delayed send, none went to the
broker, and there were at least :data:`DELAYED_SENDS` of them; with the default
minimum delay at least :data:`MIN_STORED_DEFAULT` were stored. In every
interception mode no send fell back to a broker ETA message (a change that
silently stops intercepting would otherwise still pass). Output: ``--out`` (a
temporary folder unless given), one folder per mode with pytest logs, junit
XML, scheduler logs and ``summary.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import celery
import redis

HERE = Path(__file__).resolve().parent
SELECTION = "countdown or eta or retry or retried or retries or expire or revoke or scheduled"
FILES = ("test_tasks", "test_canvas", "test_inspect")
INTERCEPT = {"delayed_intercept_eta": True, "delayed_intercept_min_delay_s": 0}
MODES: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "intercept": INTERCEPT,
    "intercept-default": {"delayed_intercept_eta": True},
    "worker-delayed": INTERCEPT,
}
CI_MODES = ("intercept", "worker-delayed")
#: Selected tests that cannot pass with interception on, by design: test id -> why (also in the README).
CANNOT_PASS: dict[str, str] = {}
#: The Celery version whose counts the README gives (28 tests, 25 delayed sends).
DOCUMENTED = "5.7.0"
#: Tests each file's default selection runs with Celery DOCUMENTED (another version: at least these).
TESTS = {"test_tasks": 20, "test_canvas": 5, "test_inspect": 3}
#: Delayed sends each file's default selection makes (25): with the minimum delay at 0 every one is stored.
#: A rerun test may send more. (test_class_based_task_retried's jittered countdown is 0 or 1 s: a delayed
#: send either way.)
DELAYED_SENDS = {"test_tasks": 18, "test_canvas": 6, "test_inspect": 1}
#: Delayed sends stored with the default minimum delay (1 s), over the three files: the rest are shorter
#: (16 of 25, or 17 when that jittered countdown draws 1 s).
MIN_STORED_DEFAULT = 16


def sdist_tree(dest: Path, sdist: Path | None) -> Path:
    """A fresh copy of Celery's source tree (the installed version) under ``dest``."""
    version = celery.__version__
    if sdist is None:
        dl = dest / "dl"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "--disable-pip-version-check", "-q", f"celery=={version}", "-d", str(dl)],
                       check=True, timeout=600)
        [sdist] = dl.glob(f"celery-{version}.tar.gz")
    tree_root = dest / "src"
    shutil.rmtree(tree_root, ignore_errors=True)
    tree_root.mkdir(parents=True)
    with tarfile.open(sdist) as tf:
        tf.extractall(tree_root, filter="data")
    tree = tree_root / f"celery-{version}"
    if not (tree / "t" / "integration").is_dir():
        raise SystemExit(f"{sdist} is not Celery {version}'s source distribution")
    # The tests must import the INSTALLED celery: pytest puts the tree's root on
    # sys.path (t/ is a package), where the sdist's own celery/ would shadow it.
    shutil.rmtree(tree / "celery")
    shutil.rmtree(tree / "celery.egg-info", ignore_errors=True)
    return tree


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout}s waiting for {what}")


def stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the process group of ``proc`` (started with start_new_session), SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # the group: the prefork children of the test process too
        try:
            proc.wait(timeout=grace if sig == signal.SIGTERM else 5)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # children left behind in the group
            return


def junit_outcomes(path: Path) -> dict[str, str]:
    """Outcome per test from the junit XML; a rerun test appears more than once: the last entry wins."""
    outcome: dict[str, str] = {}
    if path.exists():
        for case in ET.parse(path).iter("testcase"):
            kinds = {child.tag for child in case}
            kind = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
            outcome[f"{case.get('classname')}::{case.get('name')}"] = {"failure": "failed"}.get(kind, kind)
    return outcome


def summary_line(log: Path) -> str:
    """pytest's last line ('20 passed, 43 deselected, ..., 1 rerun in 164.42s')."""
    lines = [ln.strip("= \n") for ln in log.read_text(errors="replace").splitlines() if ln.startswith("=")]
    return lines[-1] if lines else ""


def run_session(mode: str, tree: Path, out: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    result: dict[str, Any] = {"file": name, "port": port}

    def log(suffix: str) -> Any:
        fh = open(out / f"{name}.{suffix}", "w")  # noqa: SIM115 (closed at the end of the session)
        logs.append(fh)
        return fh

    procs.append(subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=log("redis.log"), stderr=subprocess.STDOUT, start_new_session=True))
    config = MODES[mode]
    env = dict(os.environ, TEST_BROKER=url, TEST_BACKEND=url, REDIS_HOST="127.0.0.1", REDIS_PORT=str(port),
               CELERY_IT_CONFIG=str(tree / "integration-tests-config.json"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    env.pop("NO_WORKER", None)
    client = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
    trace = out / f"{name}.intercept.jsonl"
    try:
        wait_for(client.ping, 10, "redis-server")
        if config is not None:
            env.update(CELERY_IT_TRACE=str(trace), CELERY_IT_SCHEDULER="worker" if mode == "worker-delayed" else "")
            if mode != "worker-delayed":
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "celery_it_app", "delayed", "run", "-l", "INFO"],
                    cwd=HERE, env=env, stdout=log("scheduler.log"), stderr=subprocess.STDOUT,
                    start_new_session=True))
                wait_for(lambda: client.zcard("delayed:schedulers") > 0, 30, "the scheduler to join")
        junit = out / f"{name}.junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "celery.contrib.pytest", "-p", "no:cacheprovider",
               f"t/integration/{name}.py", "-k", args.k, "-v", "-rfER", f"--junitxml={junit}"]
        if config is not None:
            cmd[5:5] = ["-p", "celery_it_plugin"]  # after celery.contrib.pytest: its fixtures win
        result["command"] = " ".join(cmd)
        t0 = time.monotonic()
        test = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log("pytest.log"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        procs.append(test)
        try:
            result["returncode"] = test.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            result["returncode"] = "timeout"
        result["seconds"] = round(time.monotonic() - t0, 1)
        result["outcomes"] = junit_outcomes(junit)
        result["pytest_summary"] = summary_line(out / f"{name}.pytest.log")
        if config is not None:
            recs = [json.loads(ln) for ln in trace.read_text().splitlines() if ln.strip()] if trace.exists() else []
            result["delayed_sends"] = {"stored": sum(r["stored"] for r in recs),
                                       "to_broker": sum(not r["stored"] for r in recs)}
            result["eta_fallbacks"] = sum(int(client.hget(k, "eta_fallbacks") or 0)
                                          for k in client.scan_iter(match="delayed:*:stats", count=1000))
            result["stored_jobs"] = sum(1 for _ in client.scan_iter(match="delayed:*:job:*", count=1000))
    except Exception as exc:  # a session that could not start: recorded, the others still run
        result["returncode"] = f"error: {exc}"
    finally:
        for proc in reversed(procs):
            stop(proc)
        client.close()
        for fh in logs:
            fh.close()
    return result


def check(mode: str, results: list[dict[str, Any]], default_selection: bool = True) -> list[str]:
    """What is wrong with one mode's sessions (empty: green).

    ``default_selection``: the run used the default ``-k`` (the README's counts apply).
    """
    problems = []
    for r in results:
        name = r["file"]
        if not isinstance(r.get("returncode"), int) or r["returncode"] not in (0, 1):
            problems.append(f"{name}: the session did not complete ({r.get('returncode')})")
        outcomes = r.get("outcomes", {})
        if not outcomes:
            problems.append(f"{name}: no test ran")
        elif default_selection and name in TESTS:
            want, exact = TESTS[name], celery.__version__ == DOCUMENTED
            if len(outcomes) < want or (exact and len(outcomes) != want):
                problems.append(f"{name}: {len(outcomes)} tests ran, {'' if exact else 'at least '}{want} expected "
                                f"(the README's count with Celery {DOCUMENTED})")
        for test, outcome in outcomes.items():
            expected = "failed" if MODES[mode] is not None and test in CANNOT_PASS else "passed"
            if outcome != expected:
                problems.append(f"{name}: {test} {outcome} (expected {expected})")
        if MODES[mode] is None:
            continue
        sends = r.get("delayed_sends", {})
        stored, to_broker = sends.get("stored", 0), sends.get("to_broker", 0)
        if MODES[mode] == INTERCEPT:
            if to_broker:
                problems.append(f"{name}: {to_broker} delayed send(s) went to the broker, not the store "
                                "(with delayed_intercept_min_delay_s 0 every one is stored)")
            if default_selection and stored < DELAYED_SENDS.get(name, 0):
                problems.append(f"{name}: only {stored} delayed sends stored (at least {DELAYED_SENDS[name]} "
                                "expected)")
        if r.get("eta_fallbacks"):
            problems.append(f"{name}: {r['eta_fallbacks']} delayed send(s) fell back to broker ETA messages")
    if MODES[mode] is not None and MODES[mode] != INTERCEPT and default_selection \
            and {r["file"] for r in results} == set(DELAYED_SENDS):
        stored = sum(r.get("delayed_sends", {}).get("stored", 0) for r in results)
        sent = stored + sum(r.get("delayed_sends", {}).get("to_broker", 0) for r in results)
        if stored < MIN_STORED_DEFAULT or sent < sum(DELAYED_SENDS.values()):
            problems.append(f"{stored} of {sent} delayed sends stored (at least {MIN_STORED_DEFAULT} of "
                            f"{sum(DELAYED_SENDS.values())} expected)")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modes", nargs="*", help=f"any of {list(MODES)} (default: {' '.join(CI_MODES)})")
    ap.add_argument("--files", nargs="+", default=list(FILES), help="integration test modules (no .py)")
    ap.add_argument("-k", default=SELECTION, help="pytest -k expression")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per pytest session")
    ap.add_argument("--jobs", type=int, default=6, help="sessions run at once")
    ap.add_argument("--sdist", type=Path, help="Celery's sdist (default: pip download it)")
    ap.add_argument("--out", type=Path, help="where logs go (default: a temporary folder, kept)")
    args = ap.parse_args()
    modes = args.modes or list(CI_MODES)
    if set(modes) - set(MODES):
        ap.error(f"unknown mode(s) {sorted(set(modes) - set(MODES))}")
    if not shutil.which("redis-server"):
        sys.exit("redis-server not found on PATH")
    out_root = args.out or Path(tempfile.mkdtemp(prefix="celery-it-"))
    t0 = time.monotonic()
    tree = sdist_tree(out_root, args.sdist)
    trees, sessions = {}, []
    for mode in modes:
        out = out_root / mode
        out.mkdir(parents=True, exist_ok=True)
        trees[mode] = out / "tree"
        shutil.rmtree(trees[mode], ignore_errors=True)
        shutil.copytree(tree, trees[mode], symlinks=True)
        if MODES[mode] is not None:
            (trees[mode] / "integration-tests-config.json").write_text(json.dumps(MODES[mode]) + "\n")
        sessions += [(mode, name) for name in args.files]
    print(f"Celery {celery.__version__}'s integration tests, modes {' '.join(modes)}: "
          f"{len(sessions)} sessions, {args.jobs} at a time; logs in {out_root}", flush=True)
    # the longest sessions first, so the parallel run ends with the short ones
    order = sorted(sessions, key=lambda s: FILES.index(s[1]) if s[1] in FILES else 0)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {s: pool.submit(run_session, s[0], trees[s[0]], out_root / s[0], s[1], args) for s in order}
        results = {s: f.result() for s, f in futures.items()}
    failed = False
    for mode in modes:
        mine = [results[(mode, name)] for name in args.files]
        counts: dict[str, int] = {}
        for r in mine:
            for outcome in r.get("outcomes", {}).values():
                counts[outcome] = counts.get(outcome, 0) + 1
        problems = check(mode, mine, default_selection=args.k == SELECTION)
        failed = failed or bool(problems)
        (out_root / mode / "summary.json").write_text(json.dumps({
            "mode": mode, "celery": celery.__version__, "config": MODES[mode], "counts": counts,
            "problems": problems, "sessions": mine}, indent=2))
        print(f"== {mode}: {counts}  {'OK' if not problems else 'FAILED'}")
        for r in mine:
            extra = (f"  stored {r['delayed_sends']['stored']} of {sum(r['delayed_sends'].values())} delayed sends,"
                     f" {r['eta_fallbacks']} fallbacks" if "delayed_sends" in r else "")
            print(f"   {r['file']:<12} rc={r.get('returncode')} {r.get('seconds')}s{extra}\n"
                  f"      pytest: {r.get('pytest_summary')}")
        for p in problems:
            print(f"   PROBLEM {p}")
    print(f"total {time.monotonic() - t0:.0f} s; logs in {out_root}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
