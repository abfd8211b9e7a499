"""Benchmarks of celery-delayed against Celery's ETA path, RQ, dramatiq, arq and PostgreSQL.

Run ``python -m bench all`` (or ``--quick``, or one scenario by name); see
``bench/README.md``.
"""
