"""Django settings of the processes the hand-over test starts (celery beat with django-celery-beat's
DatabaseScheduler, and the import command): the test session's SQLite database (E2E_DJANGO_DB)."""

from __future__ import annotations

import os

SECRET_KEY = "tests-only-beat"
USE_TZ = True
TIME_ZONE = "UTC"
#: E2E_DJANGO_NO_BEAT: a project without django-celery-beat (the import says so)
INSTALLED_APPS = [] if os.environ.get("E2E_DJANGO_NO_BEAT") else ["django_celery_beat"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ.get("E2E_DJANGO_DB", ":memory:"),
                         "OPTIONS": {"timeout": 20}}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
