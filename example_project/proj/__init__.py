"""A small Celery project that schedules its tasks with celery-delayed."""

from __future__ import annotations

from .celery import app

__all__ = ["app"]
