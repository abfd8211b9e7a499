"""Redis goes down under a running scheduler: it logs, backs off, and resumes when Redis is back."""

from __future__ import annotations

import signal
import time

import pytest
import redis
from support import RedisServer, SchedulerProcess, make_app, wait_for

from celery_delayed import apply_later, apply_later_many, get_store

pytestmark = pytest.mark.e2e


def subscribed(client: redis.Redis, channel: str) -> bool:
    try:
        return int(dict(client.pubsub_numsub(channel)).get(channel, 0)) >= 1
    except redis.ConnectionError:
        return False


@pytest.mark.timeout(120)
def test_scheduler_survives_a_redis_restart(uid, workers):
    # AOF on: the jobs survive the restart, as they would in production.
    with RedisServer(appendonly=True) as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        app = make_app(server.url, uid)
        prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
        store = get_store(app)
        wake = f"{prefix}:wake"
        far = apply_later(app, "e2e.mark", when=3600, strict=False)
        s = SchedulerProcess(server.url, prefix, queue)
        workers.append(s)
        wait_for(lambda: client.zcard(f"{prefix}:schedulers") and subscribed(client, wake), 30,
                 what="the scheduler to start")
        # Due (and within the look-ahead window) only while Redis is down.
        when = store.config.lookahead_ms / 1000 + 1.5
        during = [h.id for h in apply_later_many(
            app, "e2e.mark", [{"args": (i,), "when": when} for i in range(20)], strict=False)]
        time.sleep(0.3)

        server.stop()  # SIGTERM: Redis writes its AOF and exits
        down_s = 3.0
        time.sleep(down_s)
        assert s.proc.poll() is None, "the scheduler died while Redis was down"
        server.start()
        restarted = time.monotonic()

        wait_for(lambda: client.llen(queue) >= len(during), 20, interval=0.05,
                 what="the jobs that came due during the outage")
        resumed = time.monotonic() - restarted
        assert all(store.lookup.get(j)["st"] == "QUEUED" for j in during)

        # The wake-up listener is subscribed again: a job 300 ms ahead is on time,
        # although the loop sleeps toward the far job (or its heartbeat, 7.5 s away).
        wait_for(lambda: subscribed(client, wake), 15, what="the listener to resubscribe")
        time.sleep(0.2)
        h = apply_later(app, "e2e.mark", when=0.3, strict=False)
        rec = wait_for(lambda: (r := store.lookup.get(h.id)).get("st") == "QUEUED" and r, 10, interval=0.01,
                       what="the release after the restart")
        late = int(rec["released"]) - int(rec["due"])
        print(f"\nRedis down {down_s:.0f}s: overdue jobs released {resumed:.2f}s after the restart; "
              f"a wake-up after it was {late} ms late")
        assert late < 1000
        assert client.llen(queue) == len(during) + 1
        assert store.lookup.get(far.id)["st"] == "SCHEDULED"
        assert s.proc.poll() is None
        out = s.output()
        assert "unavailable" in out and "resuming" in out, out[-3000:]
        s.stop()
        client.close()


@pytest.mark.timeout(60)
def test_sigterm_while_redis_is_down_is_prompt(uid, workers):
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        app = make_app(server.url, uid)
        prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
        apply_later(app, "e2e.mark", when=0.5, strict=False)
        s = SchedulerProcess(server.url, prefix, queue)
        workers.append(s)
        wait_for(lambda: client.zcard(f"{prefix}:schedulers"), 30, what="the scheduler to start")
        client.close()
        server.stop("kill")
        wait_for(lambda: "unavailable" in s.output(), 15, what="the scheduler to notice")
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(10)
        took = time.monotonic() - t0
        print(f"\nSIGTERM with Redis down: stopped in {took * 1000:.0f} ms")
        assert s.proc.returncode == 0, s.output()[-3000:]
        assert took < 3.0
