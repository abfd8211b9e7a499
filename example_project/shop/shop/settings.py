"""Settings of the shop example, from the environment.

DATABASE_URL  PostgreSQL, e.g. postgresql://postgres@127.0.0.1:5432/shop (Django's
              and celery-delayed's database: the jobs' rows live beside the orders)
REDIS_URL     the broker and celery-delayed's store (default redis://127.0.0.1:6379/0)

Celery reads every ``CELERY_*`` setting below (``shop/celery.py``:
``config_from_object("django.conf:settings", namespace="CELERY")``), celery-delayed's
as ``CELERY_DELAYED_*``.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/shop")
_db = urlsplit(DATABASE_URL)

SECRET_KEY = os.environ.get("SECRET_KEY", "example-only")
DEBUG = False
ALLOWED_HOSTS = os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost").split(",")
USE_TZ = True
TIME_ZONE = "Europe/Berlin"  # the admin shows due times in it
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "celery_delayed.contrib.django",  # migrate makes the jobs' tables; the admin shows them
    "orders",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "shop.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": ["django.template.context_processors.request",
                                       "django.contrib.auth.context_processors.auth",
                                       "django.contrib.messages.context_processors.messages"]},
}]
STATIC_URL = "/static/"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.path.lstrip("/"),
        "USER": _db.username or "postgres",
        "PASSWORD": _db.password or "",
        "HOST": _db.hostname or "127.0.0.1",
        "PORT": str(_db.port or 5432),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Celery and celery-delayed (namespace CELERY).
CELERY_BROKER_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_QUEUE", "shop")
# The same database as Django's: apply_later_on_commit writes the job's row in the order's transaction.
CELERY_DELAYED_DATABASE_URL = DATABASE_URL.replace("postgresql://", "postgresql+psycopg://", 1)
CELERY_DELAYED_KEY_PREFIX = os.environ.get("DELAYED_KEY_PREFIX", "shop")
CELERY_DELAYED_SCHEDULE = {
    # Recurring, declared here; the admin can edit it (a change there wins until this entry changes).
    "unpaid-digest": {"task": "orders.unpaid_digest", "schedule": "0 8 * * mon-fri", "timezone": TIME_ZONE},
}
