"""The admin's models: names and permissions only, no tables.

Pending jobs, dead letters and recurring schedules live in the store
(Redis); the admin (:mod:`.admin`) reads and changes them through
celery-delayed's API, never through these models' managers. The models give
them a place in Django's admin and their permissions:

==================  ==========================================================
``PendingJob``      view; change: cancel, run now, reschedule
``DeadLetter``      view; change: requeue; delete: purge
``Schedule``        view; add; change: edit, pause, resume, run now; delete
==================  ==========================================================

(The tables of the relational source of truth, ``delayed_jobs`` and its
companions, are made by the migrations; they are not models either.)
"""

from __future__ import annotations

from django.db import models


class _InStore(models.Model):  # type: ignore[misc]  # Django is not type-checked here
    """An object of the store, named by its id (a job id, or a schedule's name)."""

    id = models.CharField(max_length=512, primary_key=True, verbose_name="id")

    class Meta:
        abstract = True
        managed = False

    def __str__(self) -> str:
        return str(self.id)


class PendingJob(_InStore):
    """A job of the store (listed while it waits for its due time)."""

    class Meta:
        managed = False
        verbose_name = "pending job"
        verbose_name_plural = "pending jobs"
        default_permissions = ("view", "change")


class DeadLetter(_InStore):
    """A job whose attempts ran out (the dead-letter queue)."""

    class Meta:
        managed = False
        verbose_name = "dead letter"
        verbose_name_plural = "dead letters"
        default_permissions = ("view", "change", "delete")


class Schedule(_InStore):
    """A recurring schedule (its id is its name)."""

    class Meta:
        managed = False
        verbose_name = "recurring schedule"
        verbose_name_plural = "recurring schedules"
        default_permissions = ("view", "add", "change", "delete")
