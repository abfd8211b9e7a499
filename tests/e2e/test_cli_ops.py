"""``delayed pause | resume | promote | cancel --task | doctor`` and ``run --metrics-port`` (issue 12)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from support import SchedulerProcess, WorkerProcess, free_port, make_app, need, port_open, ran, wait_for

from celery_delayed import apply_later_many, get_store
from celery_delayed.cli import delayed
from celery_delayed.store.stats import FleetStats


def invoke(app, *args: str) -> Result:
    ctx = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    return CliRunner().invoke(delayed, list(args), obj=ctx)


@pytest.fixture
def oapp(redis_url, uid):
    return make_app(redis_url, uid, delayed_shards=4)


def later(app, n: int, task: str = "e2e.mark", when: float = 3600, **kw) -> list[str]:
    return [h.id for h in apply_later_many(app, task, [{"args": (i,), "when": when + i, **kw} for i in range(n)],
                                           strict=False)]


def test_pause_shows_in_status_and_resume_lifts_it(oapp):
    res = invoke(oapp, "pause", "--task", "e2e.sleep")
    assert res.exit_code == 0 and res.stdout.strip() == "paused: task:e2e.sleep"
    res = invoke(oapp, "status", "--json")
    assert list(json.loads(res.stdout)["paused"]) == ["task:e2e.sleep"]
    assert "paused: task:e2e.sleep (since " in invoke(oapp, "status").stdout
    res = invoke(oapp, "resume")
    assert res.exit_code == 0 and res.stdout.startswith("resumed: 0 held job(s)")
    assert json.loads(invoke(oapp, "status", "--json").stdout)["paused"] == {}


def test_promote_and_bulk_cancel(oapp):
    marks = later(oapp, 5)
    sleeps = later(oapp, 4, task="e2e.sleep", when=7200)
    res = invoke(oapp, "promote", marks[0])
    assert res.exit_code == 0 and res.stdout.startswith(f"promoted {marks[0]}: due ")
    assert invoke(oapp, "promote", "--task", "e2e.mark").stdout.strip() == "promoted 4 job(s)"
    res = invoke(oapp, "cancel", "--task", "e2e.sleep", "--due-after", "7200.5", "--due-before", "7202.5")
    assert res.exit_code == 0 and res.stdout.strip() == "cancelled 2 job(s)", res.output
    store = get_store(oapp)
    assert [store.lookup.get(j)["st"] for j in sleeps] == ["SCHEDULED", "CANCELLED", "CANCELLED", "SCHEDULED"]
    assert invoke(oapp, "cancel", "--task", "e2e.sleep").stdout.strip() == "cancelled 2 job(s)"
    assert invoke(oapp, "cancel").exit_code == 2
    assert invoke(oapp, "promote").exit_code == 2


def test_doctor_finds_no_scheduler_and_no_aof(oapp):
    res = invoke(oapp, "doctor")
    assert res.exit_code == 1, res.output
    assert "[PROBLEM] schedulers: no scheduler is running" in res.stdout
    # AOF off is what a development Redis has: a warning that says what production needs, not a problem
    assert "[WARNING] persistence: the store's Redis has AOF off: fine for development" in res.stdout
    assert "what to do: for production: CONFIG SET appendonly yes" in res.stdout
    assert "[ok] visibility_timeout: visibility_timeout 3600 s" in res.stdout
    assert "[ok] clock: " in res.stdout
    found = {f["check"]: f for f in json.loads(invoke(oapp, "doctor", "--json").stdout)}
    assert found["memory"]["level"] == "ok"

    short = make_app(oapp.conf.broker_url, oapp.conf.delayed_key_prefix[1:], delayed_shards=4,
                     delayed_done_ttl_s=60, broker_transport_options={"visibility_timeout": 600})
    res = invoke(short, "doctor")
    assert "[PROBLEM] visibility_timeout: broker_transport_options visibility_timeout is 600 s but " \
           "delayed_done_ttl_s is 60 s" in res.stdout
    other = make_app(oapp.conf.broker_url, oapp.conf.delayed_key_prefix[1:], delayed_shards=8)
    later(oapp, 1)  # records the layout (4 shards)
    assert "[PROBLEM] layout: delayed_shards is 8" in invoke(other, "doctor").stdout


def test_doctor_reports_rabbitmq_consumer_timeout(redis_url, rabbitmq_url, uid):
    need("RabbitMQ's management API on 127.0.0.1:15672", port_open("127.0.0.1", 15672))
    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, delayed_shards=4)
    found = {f["check"]: f for f in json.loads(invoke(app, "doctor", "--json").stdout)}
    f = found["consumer_timeout"]
    assert f["level"] == "ok" and "consumer_timeout per queue" in f["message"] and "RabbitMQ 3" in f["message"]


def test_doctor_says_when_it_could_not_check_consumer_timeout(redis_url, rabbitmq_url, uid):
    closed = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, delayed_shards=4,
                      delayed_rabbitmq_api_url=f"http://guest:guest@127.0.0.1:{free_port()}")
    f = {f["check"]: f for f in json.loads(invoke(closed, "doctor", "--json").stdout)}["consumer_timeout"]
    assert f["level"] == "unchecked" and f["message"].startswith("could not check RabbitMQ's consumer_timeout")
    res = invoke(closed, "doctor")
    assert "[not checked] consumer_timeout: could not check" in res.stdout


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_run_serves_fleet_metrics_and_doctor_passes_with_a_scheduler(redis_url, uid, workers):
    prefix, queue = f"t{uid}", f"q{uid}"
    port = free_port()
    app = make_app(redis_url, uid, delayed_shards=4)
    sched = SchedulerProcess(redis_url, prefix, queue, conf={"delayed_shards": 4})
    workers.append(sched)
    # a second scheduler process serves the metrics: any one exporter tells the whole fleet's figures
    exporter = SchedulerProcess(redis_url, prefix, queue, conf={"delayed_shards": 4, "delayed_metrics_port": port})
    workers.append(exporter)
    worker = WorkerProcess(redis_url, prefix, queue, conf={"delayed_shards": 4})
    workers.append(worker)
    worker.wait_ready()
    ids = later(app, 20, when=0.5)
    later(app, 3, task="e2e.sleep", when=3600)
    client = get_store(app).redis.client
    wait_for(lambda: len(ran(client, prefix)) >= 20, 30, what="the jobs to run")

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    text = wait_for(lambda: "celery_delayed_succeeded_total 20.0" in scrape() and scrape(), 20,
                    what="the metrics to count 20 successes")
    assert "celery_delayed_released_total 20.0" in text
    assert "celery_delayed_scheduled_total 23.0" in text
    assert f'celery_delayed_pending_jobs{{queue="{queue}",task="e2e.sleep"}} 3.0' in text
    assert "celery_delayed_start_lateness_seconds_count 20.0" in text
    assert "celery_delayed_release_lateness_seconds_count 20.0" in text
    assert "celery_delayed_schedulers 2.0" in text
    assert "celery_delayed_unowned_shards 0.0" in text
    assert "celery_delayed_running_jobs 0.0" in text and "celery_delayed_queued_jobs 0.0" in text
    snap = FleetStats(get_store(app)).snapshot()
    assert sorted(len(s) for s in snap.shards_of().values()) == [2, 2]
    res = invoke(app, "doctor")
    assert "[ok] schedulers: 2 live scheduler(s) hold all 4 shards" in res.stdout
    assert len(set(ids)) == 20


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_worker_with_delayed_serves_metrics_and_logs_the_doctor_at_start(redis_url, uid, workers):
    prefix, queue = f"t{uid}", f"q{uid}"
    port = free_port()
    worker = WorkerProcess(redis_url, prefix, queue, conf={"delayed_metrics_port": port}, extra=["--delayed"])
    workers.append(worker)
    worker.wait_ready()
    app = make_app(redis_url, uid)
    later(app, 2, when=3600)

    def scrape() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                return resp.read().decode()
        except OSError:
            return ""

    text = wait_for(lambda: "celery_delayed_scheduled_total 2.0" in scrape() and scrape(), 20,
                    what="the embedded scheduler's exporter")
    assert "celery_delayed_schedulers 1.0" in text
    aof = [line for line in worker.output().splitlines() if "the store's Redis has AOF off" in line]
    assert aof and all("WARNING" in line and "ERROR" not in line for line in aof), aof
