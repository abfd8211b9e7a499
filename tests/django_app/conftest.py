"""The Django app's tests (``celery_delayed.contrib.django``): Django configured in this process, once.

Django reads its settings once per process, so the first test of this
folder configures it (:func:`django_setup`): the admin, auth, sessions and
messages, and the app, on a SQLite database migrated once; PostgreSQL
databases are added as aliases by the tests that need them
(:func:`database_alias`). No other test of the suite uses Django in its own
process (the shop's test runs it in subprocesses).

Run alone: ``pytest tests/django_app`` (about a minute).
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from celery import Celery

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from support import make_app  # noqa: E402

PASSWORD = "a-long-test-password"
#: django-celery-beat's app, for the import's tests (the test extra installs it; the version matrix,
#: which runs only the Django app's own tests, does not)
_BEAT = ["django_celery_beat"] if importlib.util.find_spec("django_celery_beat") else []


def django_databases(url: str) -> dict[str, Any]:
    """Django's DATABASES entry for a SQLAlchemy URL (``postgresql+psycopg://...`` or ``sqlite:///path``)."""
    if url.startswith("sqlite"):
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": url.split(":///", 1)[1]}
    u = urlsplit(url)
    return {"ENGINE": "django.db.backends.postgresql", "NAME": u.path.lstrip("/"), "USER": u.username or "",
            "PASSWORD": u.password or "", "HOST": u.hostname or "", "PORT": str(u.port or 5432)}


@pytest.fixture(scope="session")
def django_setup(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Configure Django (once), migrate its SQLite database, make the users; the database's SQLAlchemy URL."""
    import django
    from django.conf import settings

    db = tmp_path_factory.mktemp("django") / "admin.sqlite3"
    if not settings.configured:
        settings.configure(
            DEBUG=False, SECRET_KEY="tests-only-" + uuid.uuid4().hex, USE_TZ=True, TIME_ZONE="UTC",
            ALLOWED_HOSTS=["*"], ROOT_URLCONF="admin_urls",
            INSTALLED_APPS=["django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
                            "django.contrib.sessions", "django.contrib.messages", "django.contrib.staticfiles",
                            "celery_delayed.contrib.django", *_BEAT],
            MIDDLEWARE=["django.contrib.sessions.middleware.SessionMiddleware",
                        "django.middleware.common.CommonMiddleware", "django.middleware.csrf.CsrfViewMiddleware",
                        "django.contrib.auth.middleware.AuthenticationMiddleware",
                        "django.contrib.messages.middleware.MessageMiddleware"],
            TEMPLATES=[{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
                        "OPTIONS": {"context_processors": [
                            "django.template.context_processors.request", "django.contrib.auth.context_processors.auth",
                            "django.contrib.messages.context_processors.messages"]}}],
            DATABASES={"default": django_databases(f"sqlite:///{db}")},
            STATIC_URL="/static/", DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
            PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],
        )
        django.setup()
        from django.test.utils import setup_test_environment

        setup_test_environment()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    _users()
    return f"sqlite:///{settings.DATABASES['default']['NAME']}"


def _users() -> None:
    """admin (superuser); viewer (staff, view only); operator (staff, view and change; not add or delete)."""
    from django.contrib.auth.models import Permission, User

    if User.objects.filter(username="admin").exists():
        return
    User.objects.create_superuser("admin", "admin@example.com", PASSWORD)
    perms = Permission.objects.filter(content_type__app_label="celery_delayed")
    viewer = User.objects.create_user("viewer", password=PASSWORD, is_staff=True)
    viewer.user_permissions.set(perms.filter(codename__startswith="view_"))
    operator = User.objects.create_user("operator", password=PASSWORD, is_staff=True)
    operator.user_permissions.set(perms.filter(codename__regex=r"^(view|change)_"))


@pytest.fixture(autouse=True)
def _celery_app_put_back() -> Iterator[None]:
    """The tests make their app the current and default one (the admin acts on it): the previous ones after."""
    from celery import _state

    default, current = _state.default_app, getattr(_state._tls, "current_app", None)
    yield
    _state.set_default_app(default)
    _state._set_current_app(current)


@pytest.fixture
def dj(django_setup: str) -> str:
    """Django is set up (the SQLite database's URL)."""
    return django_setup


@pytest.fixture
def admin_app(dj: str, redis_url: str, uid: str) -> Celery:
    """A Celery app on the private Redis (its own prefix and queue), the current app: the admin acts on it."""
    from celery_delayed import DelayedTask

    app = make_app(redis_url, uid)

    @app.task(base=DelayedTask, name="shop.remind", shared=False)
    def remind(order: int, **kwargs: Any) -> int:
        return order

    @app.task(base=DelayedTask, name="e2e.mark", shared=False)
    def mark(*args: Any, **kwargs: Any) -> None:
        return None

    app.set_current()
    app.set_default()
    return app


def client_for(username: str) -> Any:
    """A Django test client logged in as ``username``."""
    from django.contrib.auth.models import User
    from django.test import Client

    c = Client()
    c.force_login(User.objects.get(username=username))
    return c


@contextmanager
def database_alias(url: str) -> Iterator[str]:
    """A Django database alias for the SQLAlchemy ``url`` while the block runs."""
    from django.db import connections

    alias = "db_" + uuid.uuid4().hex[:8]
    connections.settings[alias] = connections.configure_settings({"default": {}, alias: django_databases(url)})[alias]
    try:
        yield alias
    finally:
        connections[alias].close()
        if hasattr(connections._connections, alias):
            delattr(connections._connections, alias)
        del connections.settings[alias]
