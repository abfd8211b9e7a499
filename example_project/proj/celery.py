"""The Celery app, configured from the environment.

REDIS_URL            the Redis server (broker and delayed-task store; default
                     redis://127.0.0.1:6379/0). With the store on the broker's
                     Redis server, due tasks are pushed onto their queues by a
                     Lua script: the exactly-once "direct" path.
DELAYED_KEY_PREFIX   prefix of the store's keys (default "proj")
CELERY_QUEUE         the default queue (default "proj")

Run it from this folder::

    celery -A proj worker -l INFO         # executes tasks
    celery -A proj delayed run            # releases due tasks onto the queue
    python -m proj.usage                  # schedules, cancels, reschedules
"""

from __future__ import annotations

import os

from celery import Celery

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("proj", broker=REDIS_URL, include=["proj.tasks", "proj.trials"])
app.conf.update(
    delayed_key_prefix=os.environ.get("DELAYED_KEY_PREFIX", "proj"),
    task_default_queue=os.environ.get("CELERY_QUEUE", "proj"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
