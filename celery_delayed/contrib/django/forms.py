"""The recurring schedule's form: crontab or interval, time zone, enabled, args and kwargs as JSON.

Validated as the API validates a schedule (:func:`celery_delayed.schedules.definition.definition`:
the task, the crontab fields, the zone, and the occurrence's call as
``apply_later`` checks it), so that what the form accepts is what the
schedulers run.
"""

from __future__ import annotations

import json
from typing import Any
from zoneinfo import available_timezones

from django import forms

from ...errors import DelayedError, UnknownTask
from ...schedules.definition import MISFIRE_POLICIES, definition

KINDS = (("interval", "Interval (every N seconds of elapsed time)"),
         ("crontab", "Crontab (wall-clock times, in the time zone below)"))
CRON_FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")


class ScheduleForm(forms.Form):  # type: ignore[misc]  # Django is not type-checked here
    """One recurring schedule (see the module docstring)."""

    name = forms.CharField(max_length=200, help_text="Unique; occurrences' ids derive from it.")
    task = forms.CharField(max_length=255, help_text="The task's registered name.",
                           widget=forms.TextInput(attrs={"list": "celery-delayed-tasks", "size": 60}))
    enabled = forms.BooleanField(required=False, initial=True,
                                 help_text="Disabled: no occurrence is created; the pending ones are cancelled.")
    kind = forms.ChoiceField(choices=KINDS, initial="interval", widget=forms.RadioSelect, label="Schedule")
    every = forms.FloatField(required=False, min_value=0.1, label="Every (seconds)")
    minute = forms.CharField(max_length=64, initial="*", required=False)
    hour = forms.CharField(max_length=64, initial="*", required=False)
    day_of_month = forms.CharField(max_length=64, initial="*", required=False, label="Day of month")
    month_of_year = forms.CharField(max_length=64, initial="*", required=False, label="Month of year")
    day_of_week = forms.CharField(max_length=64, initial="*", required=False, label="Day of week",
                                  help_text="0 or sun = Sunday; mon-fri, ...")
    timezone = forms.CharField(max_length=64, required=False, label="Time zone",
                               widget=forms.TextInput(attrs={"list": "celery-delayed-zones"}),
                               help_text="An IANA zone (Europe/Berlin) for a crontab; empty: the Celery app's.")
    args = forms.CharField(initial="[]", widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
                           help_text='A JSON list: ["main", 3]')
    kwargs = forms.CharField(initial="{}", widget=forms.Textarea(attrs={"rows": 2, "cols": 60}),
                             help_text='A JSON object: {"full": true}')
    queue = forms.CharField(max_length=255, required=False, help_text="Empty: the task's own routing.")
    misfire = forms.ChoiceField(choices=[(m, m) for m in MISFIRE_POLICIES], initial="latest",
                                help_text="Occurrences an outage missed: run the latest once, none, or each.")
    skip_if_running = forms.BooleanField(required=False, label="Skip if running",
                                         help_text="Skip an occurrence while the previous one still runs.")

    def __init__(self, *args: Any, app: Any, editing: bool = False, options: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.app = app
        self.options = dict(options or {})  # the schedule's other options (priority ...), kept
        self.editing = editing
        if editing:
            self.fields["name"].disabled = True
            self.fields["name"].help_text = "A schedule's name cannot change: add a new one and delete this one."
        self.entry: dict[str, Any] = {}

    @staticmethod
    def zones() -> list[str]:
        """The IANA zones the time zone field suggests."""
        return sorted(available_timezones())

    def _json(self, field: str, kind: type, what: str) -> Any:
        text = self.cleaned_data.get(field) or ("[]" if kind is list else "{}")
        try:
            value = json.loads(text)
        except ValueError as exc:
            self.add_error(field, f"not JSON: {exc}")
            return None
        if not isinstance(value, kind):
            self.add_error(field, f"must be a JSON {what}, got {type(value).__name__}")
            return None
        return value

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean()
        args, kwargs = self._json("args", list, "list"), self._json("kwargs", dict, "object")
        if data.get("kind") == "interval":
            if data.get("every") is None:
                self.add_error("every", "give the interval in seconds")
                return data
            spec: object = float(data["every"])
        else:
            spec = " ".join((data.get(f) or "*").strip() for f in CRON_FIELDS)
        if self.errors or not data.get("name") or not data.get("task"):
            return data
        options = {k: v for k, v in self.options.items() if k != "queue"}
        if data.get("queue"):
            options["queue"] = data["queue"]
        self.entry = {"task": data["task"], "schedule": spec, "args": args, "kwargs": kwargs, "options": options,
                      "timezone": (data.get("timezone") or "").strip() or None, "misfire": data["misfire"],
                      "skip_if_running": bool(data.get("skip_if_running"))}
        try:
            self.definition = definition(self.app, data["name"], self.entry, strict=True)
        except UnknownTask as exc:
            self.add_error("task", str(exc))
        except DelayedError as exc:
            self.add_error(None, str(exc))
        return data
