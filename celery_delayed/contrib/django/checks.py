"""``manage.py check`` for celery-delayed's settings: ``CELERY_DELAYED_*``, read through Celery's namespace.

Celery's Django guide loads the settings with
``app.config_from_object("django.conf:settings", namespace="CELERY")``: then
``CELERY_DELAYED_KEY_PREFIX`` is ``delayed_key_prefix``, and so on for every
setting of :data:`celery_delayed.config.SETTINGS`. The checks:

- ``celery_delayed.E001``: a setting's value is wrong (the message of
  :class:`~celery_delayed.errors.ConfigurationError`, which the app would
  raise on its first delayed call);
- ``celery_delayed.W001``: a ``CELERY_DELAYED_*`` name that is no setting (a
  misspelt one would be ignored without a word);
- ``celery_delayed.W002``: ``CELERY_DELAYED_*`` settings that the Celery app
  does not see (loaded without ``namespace="CELERY"``).
"""

from __future__ import annotations

import difflib
from typing import Any

from django.conf import settings
from django.core import checks

from ...config import SETTINGS, DelayedConfig
from ...errors import ConfigurationError

PREFIX = "CELERY_DELAYED_"


def register() -> None:
    """Register the checks (the app's ``ready``; registering twice is harmless)."""
    checks.register(check_settings, "celery_delayed")


def _current_app() -> Any:
    """The project's Celery app, or None when none was created (only Celery's fallback app exists)."""
    from celery import _state

    app = _state.get_current_app()
    return None if app.main == "default" and not app.configured else app


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The checks of the module docstring."""
    out: list[checks.CheckMessage] = []
    known = {s.name.upper() for s in SETTINGS}
    given = [name for name in dir(settings) if name.startswith(PREFIX)]
    for name in given:
        if name[len("CELERY_"):] not in known:
            near = difflib.get_close_matches(name[len("CELERY_"):], sorted(known), n=1)
            hint = f"did you mean CELERY_{near[0]}?" if near else "see the settings reference"
            out.append(checks.Warning(f"{name} is not a celery-delayed setting: it is ignored", hint=hint,
                                      id="celery_delayed.W001"))
    app = _current_app()
    if app is None:
        return out
    unseen = [name for name in given if name[len("CELERY_"):] in known
              and app.conf.get(name[len("CELERY_"):].lower()) is None]
    if unseen:
        out.append(checks.Warning(
            f"the Celery app {app.main!r} does not see {', '.join(sorted(unseen))}",
            hint="load Django's settings with app.config_from_object('django.conf:settings', namespace='CELERY')",
            id="celery_delayed.W002"))
    try:
        DelayedConfig.from_app(app)
    except ConfigurationError as exc:
        out.append(checks.Error(str(exc), hint="set it as CELERY_<NAME> in settings.py (see the settings "
                                "reference)", id="celery_delayed.E001"))
    return out
