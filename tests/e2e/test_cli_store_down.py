"""Every ``delayed`` command gives the same one-line error, exit 1 and no traceback, when Redis is down."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from support import free_port, run_celery

COMMANDS = [
    ("status",), ("status", "--json"), ("list",), ("list", "--json"), ("show", "some-id"), ("cancel", "some-id"),
    ("dlq", "list"), ("dlq", "list", "--json"), ("dlq", "show", "some-id"), ("dlq", "requeue", "some-id"),
    ("dlq", "requeue", "--all"), ("dlq", "purge", "--yes"), ("dlq", "purge", "--older-than", "60"),
]


@pytest.mark.timeout(120)
def test_every_command_reports_the_store_down_clearly(uid):
    down = f"redis://127.0.0.1:{free_port()}/0"

    def run(args: tuple[str, ...]) -> tuple[tuple[str, ...], int, str]:
        res = run_celery(down, f"t{uid}", f"q{uid}", "delayed", *args, timeout=60)
        return args, res.returncode, res.stderr

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, COMMANDS))
    assert len(results) == len(COMMANDS)
    for args, code, err in results:
        assert code == 1, (args, err[-2000:])
        assert "Traceback" not in err, (args, err[-2000:])
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert lines[-1].startswith("Error: cannot reach the celery-delayed store at redis://127.0.0.1:"), (args, err)
        assert "Check that Redis is running" in lines[-1], (args, err)
