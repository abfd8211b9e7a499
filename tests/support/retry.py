"""Helpers of the retry and interception end-to-end tests."""

from __future__ import annotations

import json
import threading
import time
from typing import Any


def runs(client: Any, prefix: str, job_id: str) -> list[tuple[int, float]]:
    """(retries, time) of each recorded run of one job."""
    out = []
    for entry in client.lrange(f"{prefix}:ran", 0, -1):
        jid, _pid, retries, at = str(entry).split("|")
        if jid == job_id:
            out.append((int(retries), float(at)))
    return out


class QueueWatch:
    """Polls a queue's Redis list and kombu's unacked hash (messages a worker holds).

    A broker ETA message would sit in the worker's hands (the unacked hash)
    for its whole delay; a store retry appears there only while it runs.
    """

    def __init__(self, client: Any, key: str, job_id: str) -> None:
        self.client, self.key, self.job_id = client, key, job_id
        self.seen: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            raws = list(self.client.lrange(self.key, 0, -1))
            raws += [json.dumps(json.loads(v)[0]) for v in self.client.hvals("unacked")]
            for raw in raws:
                env = json.loads(raw)
                if env["headers"].get("id") == self.job_id:
                    self.seen[env["properties"]["delivery_tag"]] = env["headers"]
            time.sleep(0.005)

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(2)
        return list(self.seen.values())
