"""How an attempt of a released job ends: one store call, made by one object.

An attempt begins with ``start.lua`` (:mod:`.tracking`) and ends with exactly
one of these scripts:

================  ==============================================================
``finish.lua``    it succeeded (or ended itself with ``Ignore``), failed with no
                  failure handling of its own, or queued itself again outside
                  the store (Celery's own ``retry``, ``Reject(requeue=True)``)
``retry.lua``     its next attempt is scheduled through the store
``dead.lua``      the job is dead-lettered (its last attempt, or ``dlq_all_failures``)
``fail.lua``      a final failure, recorded with its exception
================  ==============================================================

The last three also give the execution lease back, so a finish after one of
them could only be refused. An attempt can end inside its body
(``retry_later``, ``retry`` and Celery's ``autoretry_for``, which calls it; an
intercepted ``Task.retry`` of a plain task) or after it (:mod:`.tracking`):
both go through the attempt's :class:`AttemptEnd`, which makes the one store
call and answers every later request with the :class:`Ended` it returned.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..store import Outcome, Store
from ..vocab import JobState

logger = logging.getLogger("celery_delayed.worker")

#: The request attribute that carries the running attempt's :class:`AttemptEnd`
#: (Celery copies the request's attributes into the context the body sees).
REQUEST_ATTR = "delayed_attempt_end"


class End(str, Enum):
    """The script that ended an attempt."""

    FINISH = "finish"
    RETRY = "retry"
    DEAD = "dead"
    FAIL = "fail"


@dataclass(frozen=True)
class Ended:
    """How an attempt ended: the script, what it was asked to record, and its reply.

    ``outcome`` is None for a finish sent without waiting for its reply (a
    success; the reply is checked when it is read).
    """

    by: End
    state: str  # the job's state this end asked for: SUCCEEDED, FAILED, QUEUED, SCHEDULED or DEAD
    outcome: Outcome | None = None


class AttemptEnd:
    """Ends one attempt of a job with one store call, whichever caller asks first.

    A tracked run makes one per execution, with the execution lease's owner
    token (:func:`~celery_delayed.worker.tracking.run_tracked`); a retry or a
    failure handled with no tracked execution (a task called with a pushed
    request, a body run without the execution record) ends the attempt
    through one made for the call, with no owner: the scripts then check no
    lease.

    A store call that raises (the store is down) does not end the attempt: a
    later request tries again.
    """

    def __init__(self, store: Store, job_id: str, shard: int, owner: str = "", task_name: str = "") -> None:
        self.store = store
        self.job_id = job_id
        self.shard = shard
        self.owner = owner
        self.task_name = task_name
        self._ended: Ended | None = None

    @property
    def ended(self) -> Ended | None:
        """How the attempt ended, or None while it has not."""
        return self._ended

    def finish(self, state: str, reason: str = "") -> Ended:
        """Record the attempt's outcome, SUCCEEDED, FAILED or QUEUED, with ``finish.lua``.

        A success is sent without waiting for the reply (read with this
        thread's next store call). The body's outcome stands even if it
        cannot be recorded: the error is logged, the lease then passes and a
        later redelivery may run the body again (documented).
        """
        if self._ended is not None:
            return self._ended
        ex = self.store.executions
        try:
            if state == JobState.SUCCEEDED:
                ex.finish_later(self.job_id, self.shard, self.owner, state, reason,
                                on_outcome=functools.partial(_recorded, self.task_name, self.job_id, state))
                return self._end(End.FINISH, state, None)
            outcome = ex.finish(self.job_id, self.shard, self.owner, state, reason)
        except Exception as exc:  # the store is down, full, or refused the write
            _recorded(self.task_name, self.job_id, state, exc)
            return Ended(End.FINISH, str(state))
        _recorded(self.task_name, self.job_id, state, outcome)
        return self._end(End.FINISH, state, outcome)

    def retry(self, due: str, retries: int, fields: Mapping[str, str]) -> Ended:
        """Schedule the next attempt at ``due`` ('<ms>' or '+<ms>') with ``retry.lua``."""
        if self._ended is not None:
            return self._ended
        outcome = self.store.executions.retry(self.job_id, self.shard, due, retries, fields, owner=self.owner)
        return self._end(End.RETRY, JobState.SCHEDULED, outcome)

    def dead(self, fields: Mapping[str, str]) -> Ended:
        """Move the job to the dead-letter queue with ``dead.lua``."""
        if self._ended is not None:
            return self._ended
        outcome = self.store.executions.dead(self.job_id, self.shard, fields, owner=self.owner)
        return self._end(End.DEAD, JobState.DEAD, outcome)

    def fail(self, fields: Mapping[str, str]) -> Ended:
        """Mark the job FAILED with its exception's fields, with ``fail.lua``."""
        if self._ended is not None:
            return self._ended
        outcome = self.store.executions.fail(self.job_id, self.shard, fields, owner=self.owner)
        return self._end(End.FAIL, JobState.FAILED, outcome)

    def _end(self, by: End, state: str, outcome: Outcome | None) -> Ended:
        self._ended = Ended(by, str(state), outcome)
        return self._ended


def of_request(request: Any) -> AttemptEnd | None:
    """The :class:`AttemptEnd` of the tracked attempt a Celery request runs, or None."""
    end = getattr(request, REQUEST_ATTR, None)
    return end if isinstance(end, AttemptEnd) else None


def _recorded(name: str, job_id: str, state: str, result: Outcome | Exception) -> None:
    if isinstance(result, Exception):
        logger.error("Could not record %s of %s[%s]: %s", state, name, job_id, result)
    elif state == JobState.SUCCEEDED and not result.ok and result.state and result.state != state:
        logger.warning("Job %s[%s] finished, but its record says %s: not marked SUCCEEDED",
                       name, job_id, result.state)
