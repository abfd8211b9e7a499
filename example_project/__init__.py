"""The example project of celery-delayed: a small Celery app and the demo.

``proj/`` is an ordinary Celery project (``celery -A proj worker`` from this
folder); ``demo.py`` runs it end to end (``scripts/demo``).
"""
