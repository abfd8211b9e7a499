"""The Django example (example_project/shop): a job scheduled in the order's transaction.

``manage.py migrate`` makes the jobs' tables (the app celery_delayed.contrib.django);
``manage.py check`` passes (the CELERY_DELAYED_* settings). Committed: the order
and its reminder both exist (a row, then a Redis entry), the admin lists the
reminder, and a real worker runs it. Rolled back: neither exists, anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis as redis_py
from support import RedisServer, wait_for
from support.databases import postgres_database

SHOP = Path(__file__).resolve().parents[2] / "example_project" / "shop"

SCENARIO = """
import json, django
django.setup()
from orders.models import Order
from orders.services import place_order
from celery_delayed import get_store, lookup
from celery_delayed.sql.rows import get_rows
from shop.celery import app

ok = place_order("ada", 1200, remind_after_s=1)
try:
    place_order("bob", 990, fail=True)
except RuntimeError:
    pass
rows = get_rows(app)
from django.contrib.auth.models import User
from django.test import Client
admin = Client()
admin.force_login(User.objects.create_superuser("ops", "ops@example.com", "a-long-password-for-ops"))
pending = admin.get("/admin/celery_delayed/pendingjob/")
order_page = admin.get("/admin/orders/order/")
print(json.dumps({
    "admin": [pending.status_code, ok.reminder_job in pending.content.decode(),
              order_page.status_code, ok.reminder_job in order_page.content.decode()],
    "orders": sorted(Order.objects.values_list("customer", flat=True)),
    "job": ok.reminder_job,
    "state": lookup(app, ok.reminder_job).job_state,
    "rows": rows.counts(),
}))
"""


def _run(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, *args], cwd=SHOP, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_place_order_commits_order_and_reminder_together_or_neither(uid: str) -> None:
    with postgres_database() as sa_url, RedisServer() as redis:
        env = dict(os.environ, DJANGO_SETTINGS_MODULE="shop.settings", REDIS_URL=redis.url,
                   DATABASE_URL=sa_url.replace("postgresql+psycopg://", "postgresql://"),
                   DELAYED_KEY_PREFIX=f"shop{uid}", CELERY_QUEUE=f"shop{uid}", ALLOWED_HOSTS="testserver",
                   PYTHONPATH=os.pathsep.join([str(SHOP), os.environ.get("PYTHONPATH", "")]))
        _run(env, "manage.py", "migrate", "-v", "0")  # the orders, and celery-delayed's tables
        _run(env, "manage.py", "check", "--fail-level", "WARNING")
        out = json.loads(_run(env, "-c", SCENARIO).stdout.strip().splitlines()[-1])
        assert out["orders"] == ["ada"]  # bob's order rolled back ...
        assert out["rows"] == {"SCHEDULED": 1}  # ... and so did his reminder: one job in all
        assert out["state"] == "SCHEDULED"  # ada's is indexed in Redis since the commit
        assert out["admin"] == [200, True, 200, True]  # the admin lists it, and links it from the order
        procs = [subprocess.Popen([sys.executable, "-m", "celery", "-A", "shop", *args], cwd=SHOP, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for args in (["worker", "-P", "threads", "-c", "2", "-Q", f"shop{uid}", "--without-gossip",
                               "--without-mingle"], ["delayed", "run"])]
        try:
            client = redis_py.Redis.from_url(redis.url, decode_responses=True)
            [key] = [k for s in range(16) if client.exists(k := f"shop{uid}:{{{s}}}:job:{out['job']}")]
            wait_for(lambda: client.hget(key, "st") == "SUCCEEDED", 60, what="the reminder to run")
        finally:
            for p in procs:
                p.terminate()
                p.wait(15)
