"""The Redis commands and round trips of one attempt on the worker side, by how the attempt ended.

``python -m bench.attempt_trips [--jobs N]``: a private redis-server, one ``-P solo`` worker, one
scheduler, N jobs of each case (one more first, uncounted: connections made, scripts loaded):
``retry`` fails once, then succeeds; ``dead`` always fails, ``max_attempts=2`` (a retried
attempt, then a dead-lettered one); ``fail`` raises what it does not retry.

The worker imports this module, which wraps redis-py's ``send_packed_command`` and
``read_response`` in that process and writes one JSON line per task run:

- a command is one on the wire (each of a pipeline's too); an EVALSHA is named by its
  script's SHA (``celery_delayed.store.loader.scripts()``);
- a round trip is a read that waits after a send on its connection: a pipeline is one; a
  command whose reply is read with that connection's next call (``finish_later``) adds none;
- "in the run": the task's thread from ``task_prerun`` to ``task_postrun``; "between runs":
  the rest since the previous run (the broker's fetch and ack); NOT_OWNER: ``finish.lua``
  replies with that code. The server's MONITOR counts the worker-side scripts' EVALSHA too.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import redis
from celery import shared_task, signals

from celery_delayed import DelayedTask, apply_later_many
from celery_delayed.store.loader import scripts
from celery_delayed.vocab import Reply

OUT_ENV = "BENCH_TRIPS_OUT"
TASK = "bench.trips"
CASES = {"retry": 2, "dead": 2, "fail": 1}  # case -> runs per job
WORKER_SCRIPTS = ("start", "extend_lease", "retry", "dead", "fail", "finish")
COLUMNS = ("start", "retry", "dead", "fail", "finish")


class Flaky(Exception):
    """The failure the task retries."""


@shared_task(bind=True, base=DelayedTask, name=TASK, autoretry_for=(Flaky,), max_attempts=2)  # type: ignore[untyped-decorator]
def trips(self: Any, case: str) -> None:
    """Fail as ``case`` says: the first attempt (retry), every attempt (dead), not retried (fail)."""
    if case == "fail":
        raise KeyError("not retryable")
    if case == "dead" or not self.request.retries:
        raise Flaky(case)


# -- the probe, in the worker process ------------------------------------------------------


def _bucket() -> dict[str, Any]:
    return {"cmds": [], "trips": 0}  # cmds: [name, EVALSHA's sha or "", the reply's code]


_probe: dict[str, Any] = {"run": None, "thread": None, "between": _bucket()}


def _current() -> dict[str, Any]:
    run: dict[str, Any] | None = _probe["run"]
    between: dict[str, Any] = _probe["between"]
    return run if run is not None and threading.get_ident() == _probe["thread"] else between


def _parse(data: bytes) -> list[tuple[str, str]]:
    """(command name, first argument) of each RESP request in ``data``."""
    out, i = [], 0
    while i < len(data):
        j = data.index(b"\r\n", i)
        n, i = int(data[i + 1:j]), j + 2
        words: list[str] = []
        for _ in range(n):
            j = data.index(b"\r\n", i)
            size, i = int(data[i + 1:j]), j + 2
            if len(words) < 2:
                words.append(data[i:i + size].decode(errors="replace"))
            i += size + 2
        out.append((words[0].upper(), words[1] if len(words) > 1 else ""))
    return out


def install_probe(path: str) -> None:
    """Count this process's Redis commands and round trips per task run, one JSON line per run in ``path``."""
    from redis.connection import AbstractConnection

    send: Any = AbstractConnection.send_packed_command
    read: Any = AbstractConnection.read_response

    def send_packed_command(self: Any, command: Any, check_health: bool = True) -> None:
        send(self, command, check_health)  # a health check's PING goes first, recorded inside
        parts = [command] if isinstance(command, (str, bytes)) else command
        data = b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in parts)
        sent = self.__dict__.setdefault("_trips_sent", collections.deque())
        bucket = _current()
        for name, first in _parse(data):
            event = [name, first if name == "EVALSHA" else "", None]
            bucket["cmds"].append(event)
            sent.append(event)
        self._trips_waiting = True

    def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        sent = self.__dict__.get("_trips_sent")
        event = sent.popleft() if sent else None
        if getattr(self, "_trips_waiting", False):
            self._trips_waiting = False
            _current()["trips"] += 1
        reply = read(self, *args, **kwargs)
        if event is not None and isinstance(reply, list) and reply and isinstance(reply[0], int):
            event[2] = reply[0]
        return reply

    AbstractConnection.send_packed_command = send_packed_command  # type: ignore[method-assign]
    AbstractConnection.read_response = read_response  # type: ignore[method-assign]

    def prerun(**_: Any) -> None:
        _probe.update(run=_bucket(), thread=threading.get_ident())

    def postrun(kwargs: Any = None, state: str = "", **_: Any) -> None:
        record = {"case": (kwargs or {}).get("case", "?"), "state": state, "run": _probe["run"],
                  "between": _probe["between"]}
        _probe.update(run=None, between=_bucket())
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    signals.task_prerun.connect(prerun, weak=False)
    signals.task_postrun.connect(postrun, weak=False)


if os.environ.get(OUT_ENV) and __name__ != "__main__" and "worker" in sys.argv:
    install_probe(os.environ[OUT_ENV])


# -- the measurement ---------------------------------------------------------------------


def _monitor(url: str, names: dict[str, str], seen: collections.Counter[str], stop: threading.Event) -> None:
    """Count the worker-side scripts' EVALSHA the server sees, until an ECHO of "trips-end"."""
    client: Any = redis.Redis.from_url(url)
    with contextlib.suppress(redis.RedisError), client.monitor() as m:  # a stopped server ends the count
        for cmd in m.listen():
            words = cmd["command"].split(" ", 2)
            if words[0] == "EVALSHA" and names.get(words[1]) in WORKER_SCRIPTS:
                seen[names[words[1]]] += 1
            elif words[:2] == ["ECHO", "trips-end"]:
                break
    stop.set()


def _records(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def table(records: list[dict[str, Any]], names: dict[str, str]) -> str:
    """Per attempt, grouped by case and by how the attempt ended: means of the commands in the run."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for rec in records:  # in the order they ran: by case, the retried attempt first
        ran = {names.get(sha, "") for name, sha, _ in rec["run"]["cmds"] if name == "EVALSHA"}
        end = next((s for s in ("retry", "dead", "fail") if s in ran), rec["state"].lower())
        groups[(rec["case"], end)].append(rec)
    head = ["case", "attempt ended by", "attempts", *(f"EVALSHA {c}" for c in COLUMNS), "other EVALSHA",
            "other cmds", "cmds in all", "round trips", "finish NOT_OWNER", "between runs: cmds / trips"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    others: collections.Counter[str] = collections.Counter()
    for (case, end), recs in groups.items():
        per: collections.Counter[str] = collections.Counter()
        for rec in recs:
            for name, sha, reply in rec["run"]["cmds"]:
                script = names.get(sha, "?") if name == "EVALSHA" else ""
                key = script if script in COLUMNS else ("other EVALSHA" if name == "EVALSHA" else "other cmds")
                per.update({key: 1, "all": 1, "not_owner": int(script == "finish" and reply == Reply.NOT_OWNER)})
                if key.startswith("other"):
                    others[f"{case}/{end}: {script or name}"] += 1
            per.update(trips=rec["run"]["trips"], between=len(rec["between"]["cmds"]),
                       between_trips=rec["between"]["trips"])
        n = len(recs)
        means = (f"{per[c] / n:.2f}" for c in (*COLUMNS, "other EVALSHA", "other cmds", "all", "trips", "not_owner"))
        cells = [case, end, str(n), *means, f"{per['between'] / n:.2f} / {per['between_trips'] / n:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    between = collections.Counter(f"{name} {names.get(sha, 'not ours')}" if sha else name
                                  for rec in records for name, sha, _ in rec["between"]["cmds"])
    lines.append("\nother commands in the runs (in all): "
                 + (", ".join(f"{k} {v}" for k, v in sorted(others.items())) or "none"))
    lines.append("between runs, per run: "
                 + ", ".join(f"{k} {v / max(len(records), 1):.2f}" for k, v in between.most_common()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the three cases and print the table."""
    from celery_delayed.testing import RedisServer

    from .celery_app import make_app
    from .common import celery_worker, delayed_scheduler, procs, uid, wait_for, wait_ready, wait_scheduler

    warnings.filterwarnings("ignore", message="Task name .* is already registered")  # make_app's two tasks
    parser = argparse.ArgumentParser(prog="python -m bench.attempt_trips", description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs per case (default 200)")
    n = parser.parse_args(argv).jobs
    names = {s.sha: s.name for flags in (False, True) for s in scripts(flags).all()}
    conf = {"imports": ["bench.attempt_trips"], "delayed_backoff": "fixed", "delayed_backoff_base_s": 0.05}
    with RedisServer("--maxmemory", "0") as server, tempfile.TemporaryDirectory(prefix="trips-") as tmp:
        out = Path(tmp) / "runs.jsonl"
        os.environ[OUT_ENV] = str(out)  # for the worker: bench.common gives it this environment
        prefix, queue = f"trips{uid()}", f"qtrips{uid()}"
        app = make_app(server.url, prefix, queue, **conf)
        client = redis.Redis.from_url(server.url)
        seen, stopped = collections.Counter[str](), threading.Event()
        threading.Thread(target=_monitor, args=(server.url, names, seen, stopped), daemon=True).start()
        with procs() as ps:
            ps.append(celery_worker(server.url, prefix, queue, pool="solo", concurrency=1, conf=conf))
            ps.append(delayed_scheduler(server.url, prefix, queue, conf=conf))
            wait_ready(ps[0], "worker")
            if not wait_scheduler(client, prefix):
                raise RuntimeError(f"the scheduler did not join: {ps[1].output()[-3000:]}")
            for jobs in (1, n):  # one job of each case first, left out of the table
                warm = len(_records(out))
                for case, runs_per_job in CASES.items():
                    t0, want = time.monotonic(), len(_records(out)) + jobs * runs_per_job
                    apply_later_many(app, TASK, [{"kwargs": {"case": case}} for _ in range(jobs)], strict=False)
                    if not wait_for(lambda: len(_records(out)) >= want, 60 + jobs * 0.2, 0.2):  # noqa: B023 (called here)
                        print(f"case {case}: not every run ended in time; the table counts those that did")
                    print(f"case {case}: {jobs} job(s) in {time.monotonic() - t0:.1f} s", flush=True)
            client.echo("trips-end")
            stopped.wait(10)
        records = _records(out)
    print(f"\n{n} jobs per case; per attempt, the worker process's Redis commands in the run (means)\n")
    print(table(records[warm:], names))
    probe = collections.Counter(names.get(sha, "") for rec in records
                                for name, sha, _ in rec["run"]["cmds"] + rec["between"]["cmds"] if name == "EVALSHA")
    print("\ncheck, EVALSHA of the worker-side scripts in all, the probe vs the server's MONITOR: "
          + ", ".join(f"{s} {probe[s]} vs {seen[s]}" for s in WORKER_SCRIPTS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
