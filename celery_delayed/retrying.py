"""Retries through the store and the dead-letter queue (worker side).

Interface shared with ``task.py``: ``DelayedTask`` inherits :class:`RetryMixin`
and calls :meth:`RetryMixin.delayed_handle_failure` when the task body raises.
(Filled in by the retries/DLQ work; this is the contract.)
"""

from __future__ import annotations

from typing import Any


class RetryMixin:
    """Adds ``retry_later`` and failure handling (backoff, dead-letter queue) to a task."""

    def retry_later(self, exc: BaseException | None = None, countdown: float | None = None, **options: Any) -> Any:
        """Schedule the next attempt of the running job through the store (not as an ETA message)."""
        raise NotImplementedError("retry_later is not implemented yet")

    def delayed_handle_failure(self, exc: BaseException, einfo: Any) -> None:
        """Called by ``DelayedTask`` when the body raised: retry, dead-letter, or mark FAILED."""
        return None
