"""The Celery app the standalone scheduler runs with: ``celery -A celery_it_app delayed run``.

Built like Celery's integration-test app (``t/integration/conftest.py``,
fixture ``celery_config``): broker and backend from ``TEST_BROKER`` /
``TEST_BACKEND``, then the overrides of ``integration-tests-config.json``
(path in ``CELERY_IT_CONFIG``), so the scheduler sees the same broker, store
and ``delayed_*`` settings as the test process. It needs no task modules:
stored jobs carry their whole message. (``celery`` installs celery-delayed
into the app it loads.)
"""

from __future__ import annotations

import json
import os

from celery import Celery

app = Celery("celery_it")
config = {
    "broker_url": os.environ["TEST_BROKER"],
    "result_backend": os.environ.get("TEST_BACKEND", os.environ["TEST_BROKER"]),
    "result_extended": True,
}
path = os.environ.get("CELERY_IT_CONFIG")
if path and os.path.exists(path):
    with open(path) as fh:
        config.update(json.load(fh))
app.conf.update(config)
