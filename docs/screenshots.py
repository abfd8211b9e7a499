"""Take the dashboard screenshots of the docs (docs/img): ``PYTHONPATH=. python docs/screenshots.py``.

Starts a private redis-server, schedules a few thousand jobs of three tasks on
two queues, runs a scheduler in this process (which releases the due ones),
plays the worker side through the store (start, finish, a few failures into
the dead-letter queue), pauses a queue, serves the dashboard and has headless
chromium (Debian's, through chromedriver) take docs/img/overview.png and
docs/img/job.png.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

from celery import Celery

from celery_delayed import apply_later, apply_later_many, get_store, pause
from celery_delayed.scheduler import Scheduler
from celery_delayed.testing import RedisServer
from celery_delayed.web import make_server, serve_in_thread

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.browser import chromium  # noqa: E402


def main() -> None:
    out = ROOT / "docs" / "img"
    out.mkdir(parents=True, exist_ok=True)
    with RedisServer() as server:
        app = Celery("proj", broker=server.url, set_as_current=False)
        app.conf.update(delayed_key_prefix="shots", task_default_queue="default", delayed_shards=8)
        rnd = random.Random(7)
        for task, queue, n in (("proj.tasks.remind", "default", 2400), ("proj.tasks.send_invoice", "billing", 900),
                               ("proj.tasks.sync_account", "default", 600)):
            apply_later_many(app, task, ({"args": (i,), "when": rnd.uniform(1, 5400), "queue": queue}
                                         for i in range(n)), strict=False)
        apply_later_many(app, "proj.tasks.remind", ({"args": (i,), "when": rnd.uniform(0, 2)} for i in range(400)),
                         strict=False)
        for i in range(6):
            apply_later(app, "proj.tasks.send_invoice", args=(i,), when=0, queue="billing", max_lateness=0.01,
                        misfire="dead", strict=False)
        time.sleep(0.3)
        sched = Scheduler(app)
        thread = threading.Thread(target=sched.run, daemon=True)
        thread.start()
        time.sleep(3)
        store = get_store(app)
        released = []
        for s in range(store.config.shards):  # the released jobs, read back to play the worker side
            released += [str(k).rsplit(":", 1)[-1] for k in store.redis.client.scan_iter(
                match=f"shots:{{{s}}}:job:*", count=1000) if store.redis.client.hget(k, "st") == "QUEUED"]
        for i, jid in enumerate(released):
            shard = store.layout.shard_of(jid)
            time.sleep(0.0005)
            if store.executions.start(jid, shard, f"w{i}").run and i % 9:
                store.executions.finish(jid, shard, f"w{i}", "SUCCEEDED")
        pause(app, queue="billing")
        keyed = apply_later(app, "proj.tasks.remind", args=(42,), kwargs={"text": "your trial ends tomorrow"},
                            when=1800, idempotency_key="trial-end-42", strict=False)
        web = make_server(app, "127.0.0.1", 0)
        serve_in_thread(web)
        base = f"http://127.0.0.1:{web.server_address[1]}"
        try:
            with chromium(1360, 1500) as drv:
                drv.get(base + "/")
                drv.save_screenshot(str(out / "overview.png"))
                drv.set_window_size(1360, 1000)
                drv.get(f"{base}/jobs/{keyed.id}")
                drv.save_screenshot(str(out / "job.png"))
        finally:
            web.shutdown()
            sched.stop()
            thread.join(10)
    print(f"wrote {out / 'overview.png'} and {out / 'job.png'}")


if __name__ == "__main__":
    main()
