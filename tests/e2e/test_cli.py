"""``celery -A app delayed status|list|show|cancel`` against the real app and store."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from datetime import datetime, timedelta, timezone

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from support import SchedulerProcess, free_port, make_app, run_celery, wait_for

from celery_delayed import apply_later, apply_later_many, dlq, get_store
from celery_delayed.cli import delayed
from celery_delayed.store import Pending


def _ctx(app) -> CLIContext:
    return CLIContext(app=app, no_color=True, workdir=None, quiet=True)


def invoke(app, *args: str) -> Result:
    """Run ``delayed <args>`` as ``celery -A app`` would (the same click context object)."""
    return CliRunner().invoke(delayed, list(args), obj=_ctx(app))


@pytest.fixture
def cli_app(redis_url, uid):
    return make_app(redis_url, uid, delayed_shards=4)


def later(app, n: int, task: str = "e2e.mark", **kw) -> list[str]:
    calls = [{"args": (i,), "when": 3600 + i, **kw} for i in range(n)]
    return [h.id for h in apply_later_many(app, task, calls, strict=False)]


def test_status_counts_pending_and_overdue(cli_app):
    later(cli_app, 3)
    past = datetime.now(timezone.utc) - timedelta(seconds=30)
    for _ in range(2):
        apply_later(cli_app, "e2e.mark", when=past, strict=False)
    res = invoke(cli_app, "status", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert len(data["shards"]) == 4
    assert sum(r["pending"] for r in data["shards"]) == 5
    assert sum(r["overdue"] for r in data["shards"]) == 2
    assert max(r["oldest_overdue_ms"] for r in data["shards"]) >= 29_000
    assert data["schedulers"] == []

    res = invoke(cli_app, "status")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split()[:4] == ["shard", "pending", "overdue", "inflight"]
    assert len(lines) == 1 + 4 + 1
    assert lines[-1].startswith("total: 5 pending, 2 overdue, next due ")
    assert lines[-1].endswith("; release path: direct (the broker is Redis on the store's server)")
    assert "oldest overdue" in res.stdout


def test_list_filters_by_task_and_pages(cli_app):
    marks = later(cli_app, 7)
    sleeps = later(cli_app, 3, task="e2e.sleep")

    res = invoke(cli_app, "list", "--task", "e2e.sleep")
    assert res.exit_code == 0, res.output
    rows = res.stdout.splitlines()
    assert sorted(r.split()[0] for r in rows) == sorted(sleeps)
    assert all("e2e.sleep" in r and f"queue={cli_app.conf.task_default_queue}" in r for r in rows)
    assert "(3 shown, offset 0)" in res.stderr

    seen: list[str] = []
    for offset in (0, 4, 8):
        res = invoke(cli_app, "list", "--limit", "4", "--offset", str(offset), "--json")
        assert res.exit_code == 0, res.output
        page = [json.loads(line) for line in res.stdout.splitlines()]
        assert len(page) == (4 if offset < 8 else 2)
        seen += [r["id"] for r in page]
    assert len(seen) == len(set(seen)) == 10
    assert set(seen) == set(marks) | set(sleeps)
    res = invoke(cli_app, "list", "--limit", "4")
    assert "next page: --offset 4" in res.stderr

    res = invoke(cli_app, "list", "--limit", "0")
    assert res.exit_code == 2 and "--limit" in res.output


def test_show_and_cancel(cli_app):
    (jid,) = later(cli_app, 1, shard_key="customer-1")
    res = invoke(cli_app, "show", jid, "--json")
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    assert rec["id"] == jid and rec["st"] == "SCHEDULED" and rec["task"] == "e2e.mark"
    assert "msg" not in rec and "(" in rec["due"]  # epoch ms and ISO time

    res = invoke(cli_app, "cancel", jid)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == f"cancelled {jid} (was SCHEDULED)"
    assert json.loads(invoke(cli_app, "show", jid, "--json").stdout)["st"] == "CANCELLED"

    res = invoke(cli_app, "cancel", jid)
    assert res.exit_code == 1 and "cannot cancel" in res.output and "CANCELLED" in res.output


def test_show_speaks_the_job_pages_words(cli_app):
    """``delayed show`` labels every line in words (the dashboard's labels, one mapping) and shows the arguments
    as the app's argsrepr; ``--json`` keeps the record as Redis keeps it."""
    h = apply_later(cli_app, "e2e.mark", args=("alice", 3), kwargs={"n": 1}, when=600, idempotency_key="order-7",
                    strict=False, argsrepr="('alice', '***')")
    res = invoke(cli_app, "show", h.id)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    summary = {line[:19].strip(): line[19:] for line in lines[:9]}
    assert list(summary)[:8] == ["job id", "state", "task", "arguments", "keyword arguments", "queue", "due",
                                 "attempts"]
    assert summary["job id"] == h.id and summary["state"] == "SCHEDULED" and summary["task"] == "e2e.mark"
    assert summary["arguments"] == "('alice', '***')" and summary["keyword arguments"] == "{'n': 1}"
    assert summary["queue"] == cli_app.conf.task_default_queue and summary["idempotency key"] == "order-7"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}Z \(in (9|10)m \d+s\)", summary["due"]), summary["due"]
    assert summary["attempts"] == "none yet"
    labels = [line.split("  ")[0] for line in lines[10:]]
    assert "broker list" in labels and "scheduled at" in labels
    for code in ("st", "lk", "rk", "tp", "q", "ik"):  # no record key is printed as a label
        assert not any(line.startswith(code + " ") for line in lines), code


@pytest.mark.parametrize("command", ["show", "cancel"])
def test_unknown_id_is_a_clear_error(cli_app, command):
    res = invoke(cli_app, command, "no-such-job")
    assert res.exit_code == 1
    assert "no job with id 'no-such-job'" in res.output
    assert "Traceback" not in res.output


def test_unreachable_store_is_a_clear_error(uid):
    app = make_app(f"redis://127.0.0.1:{free_port()}/0", uid)
    res = invoke(app, "status")
    assert res.exit_code == 1
    assert "cannot reach the celery-delayed store" in res.output
    assert "Traceback" not in res.output


@pytest.mark.timeout(60)
def test_celery_command_line(redis_url, uid):
    """The ``celery.commands`` entry point: ``celery -A e2e_app delayed ...`` in a real process."""
    prefix, queue = f"t{uid}", f"q{uid}"
    app = make_app(redis_url, uid)
    jid = apply_later(app, "e2e.mark", when=3600, strict=False).id

    def celery(*args: str) -> subprocess.CompletedProcess[str]:
        return run_celery(redis_url, prefix, queue, "delayed", *args)

    res = celery("list")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0] == jid
    res = celery("show", "nope")
    assert res.returncode == 1
    assert "no job with id 'nope'" in res.stderr


def test_run_with_a_bad_setting_says_which(redis_url, uid):
    app = make_app(redis_url, uid, delayed_lease_ms="soon")
    res = invoke(app, "run")
    assert res.exit_code == 1
    assert "delayed_lease_ms must be an int" in res.output
    assert "Traceback" not in res.output


def test_list_is_in_due_order_over_all_shards_with_numbers_in_json(cli_app):
    ids = [apply_later(cli_app, "e2e.mark", when=3600 + i * 10, strict=False).id for i in range(12)]
    res = invoke(cli_app, "list", "--limit", "5", "--json")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["id"] for r in rows] == ids[:5]  # the next five due, whatever their shards
    assert len({r["shard"] for r in rows}) > 1
    assert all(isinstance(r["due"], int) and isinstance(r["shard"], int) for r in rows)
    assert [r["due"] for r in rows] == sorted(r["due"] for r in rows)
    res = invoke(cli_app, "list", "--limit", "5", "--offset", "5", "--json")
    assert [json.loads(line)["id"] for line in res.stdout.splitlines()] == ids[5:10]


def test_show_formats_every_time_and_keeps_text_as_it_is(cli_app):
    h = apply_later(cli_app, "e2e.mark", args=("grüße 日本",), when=0, strict=False, shard_key="ünï")
    from celery_delayed import get_store

    store = get_store(cli_app)
    store.release.release_due(h.shard)
    assert store.executions.start(h.id, h.shard, "me", "host").run
    store.executions.finish(h.id, h.shard, "me", "SUCCEEDED")
    res = invoke(cli_app, "show", h.id, "--json")
    assert res.exit_code == 0, res.output
    rec = json.loads(res.stdout)
    for field in ("due", "created", "released", "started", "finished"):
        assert rec[field].endswith("Z)") or "+00:00)" in rec[field], (field, rec[field])
    assert '"sk": "ünï"' in res.stdout  # not \\u escapes


# -- the dead-letter queue -----------------------------------------------------------


def _letters(app, n: int) -> list[str]:
    """``n`` dead letters dying 1 ms apart (oldest first), alternately of tasks t.even and t.odd."""
    store = get_store(app)
    now = store.redis.now_ms()
    ids = []
    for k in range(n):
        jid = f"dead-{k:02d}"
        store.redis.client.hset(store.keys.shard(store.layout.shard_of(jid)).job(jid), mapping={"st": "QUEUED"})
        fields = {"task": "t.even" if k % 2 == 0 else "t.odd", "msg": f"m-{jid}", "lk": f"q{jid}",
                  "etype": "app.Boom", "emsg": f"boom {k}", "attempts": "3"}
        assert store.executions.dead(jid, store.layout.shard_of(jid), fields, now_ms=now - 60_000 + k).ok
        ids.append(jid)
    return ids


def test_dlq_list_options(cli_app):
    ids = _letters(cli_app, 7)
    newest = ids[::-1]
    res = invoke(cli_app, "dlq", "list")
    assert res.exit_code == 0, res.output
    assert [line.split()[0] for line in res.stdout.splitlines()] == newest
    assert "app.Boom: boom 6" in res.stdout.splitlines()[0] and "attempts=3" in res.stdout
    assert "(7 shown, offset 0, 7 in all)" in res.stderr
    res = invoke(cli_app, "dlq", "list", "--offset", "2", "--limit", "3", "--json")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["id"] for r in rows] == newest[2:5]
    assert rows[0]["error"] == "app.Boom: boom 4" and rows[0]["attempts"] == 3 and rows[0]["task"] == "t.even"
    assert res.stderr == ""  # JSON lines only
    res = invoke(cli_app, "dlq", "list", "--task", "t.odd")
    assert [line.split()[0] for line in res.stdout.splitlines()] == [i for i in newest if int(i[-2:]) % 2]
    assert "(3 shown, offset 0, 7 in all)" in res.stderr
    assert invoke(cli_app, "dlq", "list", "--offset", "-1").exit_code == 2


def test_dlq_requeue_all_with_and_without_task(cli_app):
    ids = _letters(cli_app, 6)
    store = get_store(cli_app)
    res = invoke(cli_app, "dlq", "requeue", "--all", "--task", "t.odd", "--when", "120")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "requeued 3 dead letter(s)"
    odd = [i for i in ids if int(i[-2:]) % 2]
    for jid in odd:
        rec = store.lookup.get(jid)
        assert rec["st"] == "SCHEDULED" and rec["retries"] == "0"
        assert 119_000 <= int(rec["due"]) - store.redis.now_ms() <= 120_000
    assert sorted(d.id for d in dlq.list_dead(cli_app)) == sorted(set(ids) - set(odd))
    res = invoke(cli_app, "dlq", "requeue", "--all")
    assert res.exit_code == 0 and res.stdout.strip() == "requeued 3 dead letter(s)", res.output
    assert dlq.count(cli_app) == 0
    assert {r["id"] for r in Pending(store).page()} == set(ids)
    # a job id or --all, not both, not neither; --task only with --all
    for args in ([], ["x", "--all"], ["x", "--task", "t.odd"]):
        res = invoke(cli_app, "dlq", "requeue", *args)
        assert res.exit_code == 2, (args, res.output)


def test_dlq_show_speaks_words_and_json_keeps_the_record(cli_app):
    (jid, *_) = _letters(cli_app, 1)
    store = get_store(cli_app)
    store.redis.client.hset(store.keys.shard(store.layout.shard_of(jid)).job(jid), "tb", "Traceback (most recent)")
    res = invoke(cli_app, "dlq", "show", jid)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["job", "id", jid] and lines[1].split() == ["state", "DEAD"]
    assert any(re.fullmatch(r"attempts +3 made", line) for line in lines)
    assert any(re.fullmatch(r"error +app\.Boom: boom 0", line) for line in lines)
    assert lines[-2:] == ["traceback:", "Traceback (most recent)"]
    res = invoke(cli_app, "dlq", "show", jid, "--json")
    rec = json.loads(res.stdout[: res.stdout.rindex("}") + 1])
    assert rec["etype"] == "app.Boom" and rec["st"] == "DEAD"
    assert res.stdout.rstrip().endswith("Traceback (most recent)")


def test_dlq_purge_asks_first_without_yes(cli_app):
    _letters(cli_app, 4)
    res = CliRunner().invoke(delayed, ["dlq", "purge"], obj=_ctx(cli_app), input="n\n")
    assert res.exit_code == 1 and "purge every dead letter?" in res.output and "Aborted" in res.output
    assert dlq.count(cli_app) == 4, "a refused purge deleted letters"
    res = CliRunner().invoke(delayed, ["dlq", "purge"], obj=_ctx(cli_app), input="y\n")
    assert res.exit_code == 0, res.output
    assert "purged 4 dead letter(s)" in res.output
    assert dlq.count(cli_app) == 0
    # --older-than does not ask (it cannot take everything that just died)
    _letters(cli_app, 2)
    res = invoke(cli_app, "dlq", "purge", "--older-than", "30")
    assert res.exit_code == 0 and res.stdout.strip() == "purged 2 dead letter(s)", res.output


# -- the scheduler's commands against a live scheduler --------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_status_with_live_schedulers_and_sigint_on_run(redis_url, uid, workers, rclient):
    app = make_app(redis_url, uid, delayed_shards=4)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    scheds = [SchedulerProcess(redis_url, prefix, queue, conf={"delayed_shards": 4}) for _ in range(2)]
    workers.extend(scheds)
    wait_for(lambda: rclient.zcard(f"{prefix}:schedulers") == 2, 30, what="two schedulers to join")
    tokens = sorted(rclient.zrange(f"{prefix}:schedulers", 0, -1))
    res = invoke(app, "status", "--json")
    assert res.exit_code == 0, res.output
    assert sorted(json.loads(res.stdout)["schedulers"]) == tokens
    res = invoke(app, "status")
    head, _, listed = res.stdout.splitlines()[-1].partition(" 2 scheduler(s) ")
    assert head.startswith("total: 0 pending") and sorted(listed.partition(";")[0].split()) == tokens, res.stdout

    # SIGINT (Ctrl-C) stops `delayed run` as SIGTERM does: promptly, leaving the membership.
    t0 = time.monotonic()
    scheds[0].proc.send_signal(signal.SIGINT)
    assert scheds[0].proc.wait(10) == 0, scheds[0].output()[-3000:]
    took = time.monotonic() - t0
    assert took < 5, took
    assert "stopped" in scheds[0].output()
    assert "Traceback" not in scheds[0].output() and "KeyboardInterrupt" not in scheds[0].output()
    left = sorted(rclient.zrange(f"{prefix}:schedulers", 0, -1))
    assert len(left) == 1 and left[0] in tokens
    res = invoke(app, "status", "--json")
    assert json.loads(res.stdout)["schedulers"] == left
