"""Adopting celery-delayed with work in flight: the broker's ETA backlog moved into the store.

:func:`absorb` (``celery -A proj delayed absorb``) moves every task message
that waits in the broker for a future ``eta`` into the store, under its own
task id, due at its eta, and takes it from the broker only once its job is
stored (:mod:`.absorber`).
"""

from __future__ import annotations

from .absorber import Report, absorb

__all__ = ["Report", "absorb"]
