"""celery-delayed as a Django app: ``INSTALLED_APPS``, ``manage.py migrate``, and the admin.

Install the extra (``pip install "celery-delayed[django]"``) and add
``"celery_delayed.contrib.django"`` to ``INSTALLED_APPS`` (app label
``celery_delayed``):

- :mod:`.migrations` create and upgrade the tables of the relational source of
  truth (``delayed_jobs``, ``delayed_schema``, ``delayed_stores``), the same
  ones ``celery -A proj delayed db init`` creates, on PostgreSQL and SQLite;
- :mod:`.admin` shows pending jobs, dead letters and recurring schedules in
  Django's admin and acts on them through celery-delayed's own API (the
  store in Redis is the one place they are read from and changed in), with
  Django's view, add, change and delete permissions;
- :mod:`.checks` validates the ``CELERY_DELAYED_*`` settings in ``manage.py
  check`` (a misspelt name, a wrong value).

The admin acts on ``celery.current_app``: the app your project's
``proj/__init__.py`` imports, as Celery's Django guide sets it up.
"""
