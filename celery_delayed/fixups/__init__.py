"""Corrections to Celery and kombu behaviour, applied in worker processes."""
