"""Free trials: a reminder before a trial ends, a charge when it ends, both cancelled with the trial.

The code a team would test with ``celery_delayed.testing`` (see
``example_project/tests``): it schedules, cancels, retries and debounces, and
its tests run in milliseconds without a worker or a scheduler.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from celery import Task

from celery_delayed import DelayedTask, InvalidState, JobNotFound, cancel_by_key

from .celery import app

logger = logging.getLogger(__name__)

TRIAL = timedelta(days=14)
REMIND_BEFORE = timedelta(days=3)
RETRY_DECLINED = timedelta(hours=6)

#: A stand-in for the payment provider: users whose card is declined, and the charges made.
DECLINING: set[int] = set()
CHARGED: list[int] = []
REMINDED: list[int] = []
INDEXED: list[tuple[int, str]] = []


class CardDeclined(Exception):
    """The payment provider declined the card."""


@app.task(base=DelayedTask)
def trial_reminder(user_id: int) -> None:
    """Tell the user the trial ends soon."""
    REMINDED.append(user_id)


@app.task(base=DelayedTask, bind=True, max_attempts=3)
def charge_trial(self: Task, user_id: int) -> str:
    """Charge the user when the trial ends; a declined card is tried again every six hours, three times in all
    (then the job goes to the dead-letter queue)."""
    if user_id in DECLINING:
        raise self.retry_later(exc=CardDeclined(f"card of user {user_id} declined"),
                               countdown=RETRY_DECLINED.total_seconds())
    CHARGED.append(user_id)
    return f"charged {user_id}"


@app.task(base=DelayedTask)
def reindex_profile(user_id: int, reason: str) -> None:
    """Rebuild the search entry of a user's profile."""
    INDEXED.append((user_id, reason))


def start_trial(user_id: int) -> None:
    """Schedule the trial's reminder and its charge (once per user: idempotency keys)."""
    trial_reminder.apply_later(args=(user_id,), when=TRIAL - REMIND_BEFORE,
                               idempotency_key=f"trial-reminder:{user_id}")
    charge_trial.apply_later(args=(user_id,), when=TRIAL, idempotency_key=f"trial-charge:{user_id}")


def cancel_trial(user_id: int) -> None:
    """Cancel what the trial still has pending (a job already run stays run)."""
    for key in (f"trial-reminder:{user_id}", f"trial-charge:{user_id}"):
        try:
            cancel_by_key(app, key)
        except (JobNotFound, InvalidState) as exc:
            logger.info("nothing to cancel for %s: %s", key, exc)


def profile_changed(user_id: int, field: str) -> None:
    """Reindex a profile 30 s after its last change, at most 5 minutes after the first (a debounce)."""
    reindex_profile.apply_later(args=(user_id, field), when=30, debounce_key=f"reindex:{user_id}", max_wait=300)
