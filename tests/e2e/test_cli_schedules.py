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
    app = make_app(redis_url, uid, delayed_shards=4)
    app.task(name="e2e.mark", shared=False)(mark)  # registered (as a schedule's task must be, unless --no-strict)
    return app


def mark(*args: object) -> None:
    """The schedules' task."""


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


def test_an_interval_too_long_for_a_date_or_not_finite_is_refused_before_anything_is_stored(sapp):
    # 1e12 s: its fire times would be past the year 9999 (a traceback after storing it, before)
    for every in ("1e12", "inf", "-inf", "nan", "0.01"):
        res = invoke(sapp, "schedules", "add", "huge", "e2e.mark", "--every", every)
        assert res.exit_code == 1 and "an interval must be between 0.1 s and 10,000,000,000 s" in res.output, (
            every, res.output)
        assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    assert invoke(sapp, "schedules", "list").stdout == ""


def test_an_empty_timezone_is_refused_not_taken_for_the_default(sapp):
    res = invoke(sapp, "schedules", "add", "x", "e2e.mark", "--every", "5", "--timezone", "")
    assert res.exit_code == 1 and "timezone must be an IANA name such as 'Europe/Berlin', got ''" in res.output
    assert invoke(sapp, "schedules", "list").stdout == ""


def test_a_task_this_app_does_not_register_is_refused_unless_no_strict(sapp):
    """As apply_later refuses it unless strict=False."""
    res = invoke(sapp, "schedules", "add", "b17", "no.such.task", "--every", "5")
    assert res.exit_code == 1 and "schedule 'b17': no task named 'no.such.task' is registered" in res.output
    assert "pass --no-strict" in res.output and "strict=False" not in res.output
    assert invoke(sapp, "schedules", "list").stdout == ""
    res = invoke(sapp, "schedules", "add", "b17", "no.such.task", "--every", "5", "--no-strict")
    assert res.exit_code == 0, res.output
    assert [line.split()[:2] for line in invoke(sapp, "schedules", "list").stdout.splitlines()] == [
        ["b17", "no.such.task"]]


def test_a_broken_stored_schedule_is_shown_as_broken_and_breaks_no_listing(sapp):
    """A record an older version accepted (``--every 1e12``), written into the store directly."""
    import urllib.request

    from celery_delayed import get_store
    from celery_delayed.schedules.definition import definition
    from celery_delayed.web import make_server, serve_in_thread

    assert invoke(sapp, "schedules", "add", "poll", "e2e.mark", "--every", "30").exit_code == 0
    huge = definition(sapp, "huge", {"task": "e2e.mark", "schedule": 5}) | {"spec": {"every_ms": 10**15}}
    get_store(sapp).schedules.put_schedule("huge", huge, "api")
    res = invoke(sapp, "schedules", "list")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["huge", "poll"]
    assert lines[0].startswith("huge  e2e.mark  broken: an interval must be between 0.1 s and 10,000,000,000 s")
    assert "every 30s" in lines[1] and "next " in lines[1]
    rows = [json.loads(x) for x in invoke(sapp, "schedules", "list", "--json").stdout.splitlines()]
    assert rows[0]["error"].startswith("broken: ") and rows[1]["error"] == ""
    res = invoke(sapp, "schedules", "show", "huge")
    assert res.exit_code == 0 and json.loads(res.stdout)["error"].startswith("broken: an interval"), res.output
    assert "schedule huge: broken: an interval" in res.stderr
    res = invoke(sapp, "schedules", "run-now", "huge")
    assert res.exit_code == 1 and "schedule 'huge' is broken: an interval" in res.output
    server = make_server(sapp, "127.0.0.1", 0)
    serve_in_thread(server)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/schedules"
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200
            page = resp.read().decode()
        assert "broken: an interval must be between 0.1 s and 10,000,000,000 s" in page and "every 30s" in page
    finally:
        server.shutdown()
        server.server_close()
    assert invoke(sapp, "schedules", "remove", "huge").exit_code == 0


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
