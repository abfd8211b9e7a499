"""Django settings of the processes the hand-over test starts (celery beat with django-celery-beat's
DatabaseScheduler, and the import command): the test session's SQLite database (E2E_DJANGO_DB)."""

from __future__ import annotations

import os

SECRET_KEY = "tests-only-beat"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["E2E_DJANGO_DB"],
                         "OPTIONS": {"timeout": 20}}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
