"""The shop's Celery app, configured from Django's settings (``CELERY_*``, celery-delayed's ``CELERY_DELAYED_*``)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

app = Celery("shop", include=["orders.tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")
