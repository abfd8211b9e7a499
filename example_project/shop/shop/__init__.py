"""A small Django shop that schedules its reminders in the same transaction as its orders."""

from .celery import app as celery_app

__all__ = ["celery_app"]
