"""The Celery app the fault scenarios run in worker and scheduler subprocesses.

The app of ``tests/e2e_app.py`` (configured by the same E2E_* variables) plus
one task, ``fault.run``, that records every execution twice: in Redis (as
``e2e.mark`` does) and in an append-only file named by FAULT_RUNLOG. The file
is the ground truth when Redis itself is the thing that fails.

Lines of the run log: ``start <id> <pid> <retries> <time>`` when the body
starts and ``done <id> <pid> <retries> <time>`` when it ends.

FAULT_KILL_BEFORE_ACK=k makes a publish-path scheduler SIGKILL itself after
publishing its k-th batch and before acknowledging it: the worst moment.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from e2e_app import app, record

from celery_delayed import DelayedTask

__all__ = ["app"]

RUNLOG = os.environ.get("FAULT_RUNLOG", "")


def _log(kind: str, task_id: str, retries: int) -> None:
    if not RUNLOG:
        return
    line = f"{kind} {task_id} {os.getpid()} {retries} {time.time():.6f}\n".encode()
    # One write on an O_APPEND descriptor: lines of concurrent processes never interleave.
    fd = os.open(RUNLOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@app.task(base=DelayedTask, bind=True, name="fault.run")
def run(self: DelayedTask, n: int = 0, sleep_s: float = 0.0) -> str:
    retries = int(self.request.retries or 0)
    _log("start", self.request.id, retries)
    if sleep_s:
        time.sleep(sleep_s)
    try:
        record(self.request.id, retries)
    finally:
        # The file is written even when Redis is down (scenario: Redis restart).
        _log("done", self.request.id, retries)
    return str(self.request.id)


_KILL_AT = int(os.environ.get("FAULT_KILL_BEFORE_ACK", "0") or 0)
if _KILL_AT:
    from celery_delayed.scheduler import releaser as _releaser

    _init = _releaser.PublishReleaser.__init__

    def _dying_init(self: Any, *args: Any, **kwargs: Any) -> None:
        _init(self, *args, **kwargs)
        published = [0]

        def before_ack(batch: Any) -> None:
            published[0] += 1
            if published[0] >= _KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)

        self.before_ack = before_ack

    _releaser.PublishReleaser.__init__ = _dying_init
