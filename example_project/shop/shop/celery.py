"""The shop's Celery app: celery-delayed keeps its jobs as rows of the shop's own database."""

from __future__ import annotations

import os

from celery import Celery

from .settings import DATABASE_URL

app = Celery("shop", broker=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), include=["orders.tasks"])
app.conf.update(
    # The same database as Django's: apply_later_on_commit writes the job's row in the order's transaction.
    delayed_database_url=DATABASE_URL.replace("postgresql://", "postgresql+psycopg://", 1),
    delayed_key_prefix=os.environ.get("DELAYED_KEY_PREFIX", "shop"),
    task_default_queue=os.environ.get("CELERY_QUEUE", "shop"),
    broker_connection_retry_on_startup=True,
)
