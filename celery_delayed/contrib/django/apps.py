"""The app's configuration: label ``celery_delayed``."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryDelayedConfig(AppConfig):  # type: ignore[misc]  # Django is not type-checked here
    """``celery_delayed.contrib.django``: the tables' migrations, the admin and the settings checks."""

    name = "celery_delayed.contrib.django"
    label = "celery_delayed"
    verbose_name = "Delayed tasks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # registers the system checks

        checks.register()
