"""Settings of the shop example, from the environment.

DATABASE_URL  PostgreSQL, e.g. postgresql://postgres@127.0.0.1:5432/shop (Django's
              and celery-delayed's database: the jobs' rows live beside the orders)
REDIS_URL     the broker and celery-delayed's store (default redis://127.0.0.1:6379/0)
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/shop")
_db = urlsplit(DATABASE_URL)

SECRET_KEY = "example-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["orders"]
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
