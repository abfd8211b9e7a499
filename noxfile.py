"""The supported-versions matrix: the package installed at the lowest and the highest
versions it declares, on the oldest and the newest Python it declares, running a
smoke selection of the suite against real Redis, RabbitMQ and PostgreSQL.

    python -m nox                  # all six sessions (about 8 minutes)
    python -m nox -s "matrix-3.10(bound='lowest')"

Each session needs that Python on PATH as ``python3.10``, ``python3.12``, ``python3.13``
(e.g. ``pyenv install 3.10 3.12 3.13`` and their ``bin`` folders on PATH; ``.ci/run`` does).
The pins here, the ranges in ``pyproject.toml`` and the table in
``docs/reference/versions.md`` are kept in step by ``tests/unit/test_versions.py``.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["matrix"]
nox.options.reuse_existing_virtualenvs = True

#: The oldest and the newest Python the package declares (requires-python and the classifiers), and
#: 3.12 between them (the whole suite runs on 3.11).
PYTHONS = ["3.10", "3.12", "3.13"]

#: The declared ranges' ends: pyproject.toml's dependencies (and the django extra).
PINS = {
    "lowest": ["celery[redis]==5.6.0", "kombu==5.6.0", "redis==6.4.0", "django==4.2.*"],
    "highest": ["celery[redis]==5.7.*", "kombu==5.7.*", "redis==8.*", "django==5.2.*"],
}

#: The smoke selection: scheduling, release on both paths (the store's Redis broker and
#: RabbitMQ through the publish path), the SQL ledger, a retry, interception of
#: apply_async(eta=), the Django app, and every Celery/kombu fixup's own test.
SMOKE = [
    "tests/store/test_api.py",
    "tests/store/test_sql.py",
    "tests/e2e/test_roundtrip.py",
    "tests/e2e/test_publish.py::test_publish_path_rabbitmq_end_to_end",
    "tests/e2e/test_publish.py::test_publish_path_with_a_separate_redis_broker",
    "tests/e2e/test_retry.py::test_fails_twice_then_succeeds_with_the_documented_delays",
    "tests/e2e/test_intercept.py",
    "tests/e2e/test_lookahead.py",
    "tests/e2e/test_kombu_fix.py",
    "tests/unit/test_fixups.py",
    "tests/django_app/test_django_migrations.py",
    "tests/django_app/test_django_settings.py",
    "tests/django_app/test_django_admin.py",
]

#: What the smoke selection needs besides the package (the test extra also brings linters,
#: the browser driver, Flower and the docs tools, which the matrix does not run).
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.2", "hiredis>=2"]


@nox.session(python=PYTHONS)
@nox.parametrize("bound", list(PINS))
def matrix(session: nox.Session, bound: str) -> None:
    """The smoke selection with the package at the ``bound`` end of every declared range."""
    session.install("-e", ".[sql,django]", *TEST_DEPS, *PINS[bound])
    session.run("python", "-c", "import celery, kombu, redis, django, sys; print("
                "'python', sys.version.split()[0], 'celery', celery.__version__, 'kombu', kombu.__version__,"
                " 'redis', redis.__version__, 'django', django.__version__)")
    session.run("python", "-m", "pytest", *SMOKE, "-q", "-rs", "-p", "no:cacheprovider",
                *session.posargs)
