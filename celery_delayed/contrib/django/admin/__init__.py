"""celery-delayed in Django's admin: pending jobs, dead letters, recurring schedules.

Each admin reads and acts through celery-delayed's API (the one the CLI and
the dashboard use): the objects live in the store, the models only name them
and carry their permissions (:mod:`celery_delayed.contrib.django.models`).
"""

from __future__ import annotations

from django.contrib import admin

from ..models import DeadLetter, PendingJob, Schedule
from .dead_letters import DeadLetterAdmin
from .jobs import PendingJobAdmin
from .schedules import ScheduleAdmin

admin.site.register(PendingJob, PendingJobAdmin)
admin.site.register(DeadLetter, DeadLetterAdmin)
admin.site.register(Schedule, ScheduleAdmin)

__all__ = ["DeadLetterAdmin", "PendingJobAdmin", "ScheduleAdmin"]
