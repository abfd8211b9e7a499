"""Every ``delayed`` command gives the same one-line error, exit 1 and no traceback, when Redis is down."""

from __future__ import annotations

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner
from support import free_port, make_app, run_celery

from celery_delayed.cli import delayed

COMMANDS = [
    ("status",), ("status", "--json"), ("list",), ("list", "--json"), ("show", "some-id"), ("cancel", "some-id"),
    ("dlq", "list"), ("dlq", "list", "--json"), ("dlq", "show", "some-id"), ("dlq", "requeue", "some-id"),
    ("dlq", "requeue", "--all"), ("dlq", "purge", "--yes"), ("dlq", "purge", "--older-than", "60"),
]


@pytest.mark.parametrize("args", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
def test_every_command_reports_the_store_down_clearly(uid, args):
    app = make_app(f"redis://127.0.0.1:{free_port()}/0", uid)
    res = CliRunner().invoke(delayed, list(args), obj=CLIContext(app=app, no_color=True, workdir=None, quiet=True))
    assert res.exit_code == 1, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    lines = [line for line in res.output.strip().splitlines() if line.strip()]
    assert lines[-1].startswith("Error: cannot reach the celery-delayed store at redis://127.0.0.1:"), res.output
    assert "Check that Redis is running" in lines[-1]


@pytest.mark.timeout(60)
def test_through_the_celery_command_no_traceback(uid):
    res = run_celery(f"redis://127.0.0.1:{free_port()}/0", f"t{uid}", f"q{uid}", "delayed", "dlq", "list")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith("Error: cannot reach the celery-delayed store")
