"""Every option of the listing commands says in its --help what it means."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from celery_delayed.cli import delayed


@pytest.mark.parametrize("command", [["list"], ["dlq", "list"]])
def test_paging_options_say_what_they_mean(command: list[str]) -> None:
    out = CliRunner().invoke(delayed, [*command, "--help"]).output
    assert "--offset N" in out and "Skip the first N rows" in out, out
    assert "--limit N" in out and "Show at most N rows" in out, out
