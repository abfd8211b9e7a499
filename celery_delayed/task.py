"""``DelayedTask``: a Celery task base class that can be scheduled through the store."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from celery import Task

from . import api
from .result import DelayedResult


class DelayedTask(Task):  # type: ignore[misc]
    """Base class for tasks scheduled with ``apply_later``.

    Example::

        @app.task(base=DelayedTask)
        def remind(user_id): ...

        h = remind.apply_later(args=(42,), when=timedelta(minutes=5))
        h.cancel()
    """

    abstract = True

    def apply_later(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        when: object = 0,
        **options: Any,
    ) -> DelayedResult:
        """Schedule this task for ``when``; see :func:`celery_delayed.apply_later`."""
        return api.apply_later(self._get_app(), self.name, args, kwargs, when, **options)

    def apply_later_many(self, calls: Iterable[Mapping[str, Any]]) -> list[DelayedResult]:
        """Schedule many calls of this task in few round trips.

        Each item is a mapping of ``apply_later`` keyword arguments::

            remind.apply_later_many({"args": (uid,), "when": 60} for uid in users)
        """
        return api.apply_later_many(self._get_app(), self.name, calls)
