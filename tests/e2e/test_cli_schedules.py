"""``celery -A proj delayed schedules list | show | add | remove | pause | resume | run-now`` (issue 14)."""

from __future__ import annotations

import json

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from support import make_app

from celery_delayed.cli import delayed
from celery_delayed.metrics import render

pytestmark = pytest.mark.timeout(60)


def invoke(app, *args: str) -> Result:
    ctx = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    return CliRunner().invoke(delayed, list(args), obj=ctx)


@pytest.fixture
def sapp(redis_url, uid):
    return make_app(redis_url, uid, delayed_shards=4)


def test_add_list_show_pause_resume_run_now_remove(sapp):
    res = invoke(sapp, "schedules", "add", "nightly", "e2e.mark", "--cron", "30 2 * * *",
                 "--timezone", "Europe/Berlin", "--args", "[1, 2]")
    assert res.exit_code == 0 and res.stdout.startswith("schedule nightly: e2e.mark cron 30 2 * * *, next "), res.output
    assert invoke(sapp, "schedules", "add", "poll", "e2e.mark", "--every", "30", "--skip-if-running").exit_code == 0
    out = invoke(sapp, "schedules", "list").stdout.splitlines()
    assert [line.split()[0] for line in out] == ["nightly", "poll"]
    assert "cron 30 2 * * * (Europe/Berlin)" in out[0] and "from=api" in out[0]
    rows = [json.loads(x) for x in invoke(sapp, "schedules", "list", "--json").stdout.splitlines()]
    assert rows[0]["args"] == [1, 2] and rows[1]["schedule"] == "every 30s"
    shown = json.loads(invoke(sapp, "schedules", "show", "poll").stdout)
    assert shown["task"] == "e2e.mark" and shown["misfire"] == "latest"
    assert len(shown["occurrences"]) == 1 and shown["skip_if_running"] is True  # stored at once
    assert invoke(sapp, "schedules", "pause", "poll").stdout.strip() == "paused schedule poll"
    assert "paused" in invoke(sapp, "schedules", "list").stdout.splitlines()[1]
    assert invoke(sapp, "schedules", "pause", "poll").stdout.strip() == "schedule poll was paused already"
    assert invoke(sapp, "schedules", "resume", "poll").stdout.strip() == "resumed schedule poll"
    assert invoke(sapp, "schedules", "run-now", "poll").stdout.startswith("scheduled ")
    assert invoke(sapp, "schedules", "remove", "poll").stdout.startswith("removed schedule poll")
    assert [line.split()[0] for line in invoke(sapp, "schedules", "list").stdout.splitlines()] == ["nightly"]
    status = json.loads(invoke(sapp, "status", "--json").stdout)
    assert status["schedules"] == {"count": 1, "paused": 0}
    assert "recurring: 1 schedule(s)" in invoke(sapp, "status").stdout
    invoke(sapp, "schedules", "pause", "nightly")
    text = render(sapp)[0].decode()
    assert 'celery_delayed_recurring_schedules{state="active"} 0.0' in text
    assert 'celery_delayed_recurring_schedules{state="paused"} 1.0' in text


def test_bad_input_gets_one_clear_line(sapp):
    res = invoke(sapp, "schedules", "show", "nope")
    assert res.exit_code == 1 and "no recurring schedule named 'nope'" in res.output
    assert invoke(sapp, "schedules", "remove", "nope").exit_code == 1
    res = invoke(sapp, "schedules", "add", "x", "e2e.mark")
    assert res.exit_code == 2 and "--every" in res.output
    res = invoke(sapp, "schedules", "add", "x", "e2e.mark", "--cron", "61 * * * *")
    assert res.exit_code == 1 and "bad crontab" in res.output
    res = invoke(sapp, "schedules", "add", "x", "e2e.mark", "--every", "5", "--timezone", "Mars/Base")
    assert res.exit_code == 1 and "time zone" in res.output
    res = invoke(sapp, "schedules", "add", "x", "e2e.mark", "--every", "5", "--args", "{")
    assert res.exit_code == 2
    assert invoke(sapp, "schedules", "list").stdout == ""


def test_the_dashboard_lists_the_schedules(sapp):
    import urllib.request

    from celery_delayed import schedules
    from celery_delayed.web import make_server, serve_in_thread

    server = make_server(sapp, "127.0.0.1", 0)
    serve_in_thread(server)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/schedules"
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert "No recurring schedule" in resp.read().decode()
        schedules.add(sapp, "poll<x>", "e2e.mark", 30, strict=False)
        with urllib.request.urlopen(url, timeout=10) as resp:
            page = resp.read().decode()
        assert 'id="schedules"' in page and "poll&lt;x&gt;" in page and "every 30s" in page
        assert page.count('href="/jobs/') == 1  # its first occurrence, linked
    finally:
        server.shutdown()
        server.server_close()
