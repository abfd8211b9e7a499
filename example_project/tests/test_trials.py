"""Testing code that schedules delayed tasks with the pytest plugin of celery-delayed.

No worker, no scheduler, no sleeping: ``delayed_clock`` is the store's clock,
``delayed_kit.run_due()`` releases what is due by it and runs it here, as a
worker would (DelayedTask's retries go through the store, by that clock).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from proj import trials
from proj.trials import cancel_trial, charge_trial, profile_changed, reindex_profile, start_trial, trial_reminder

from celery_delayed.testing import DelayedClock, DelayedTestKit

pytestmark = pytest.mark.timeout(30)


def test_a_trial_schedules_its_reminder_and_charge(delayed_kit: DelayedTestKit, delayed_clock: DelayedClock) -> None:
    start_trial(7)
    start_trial(7)  # idempotent: still one of each
    now = delayed_clock.now()
    delayed_kit.assert_scheduled(trial_reminder, args=(7,), at=now + timedelta(days=11))
    delayed_kit.assert_scheduled(charge_trial, args=(7,), at=now + timedelta(days=14))
    assert len(delayed_kit.scheduled_jobs()) == 2


def test_the_reminder_and_the_charge_run_when_due(delayed_kit: DelayedTestKit, delayed_clock: DelayedClock) -> None:
    start_trial(7)
    delayed_clock.advance(days=11)
    [reminder] = delayed_kit.run_due()
    assert reminder.task == trial_reminder.name and trials.REMINDED == [7] and trials.CHARGED == []
    delayed_clock.advance(days=3)
    [charge] = delayed_kit.run_due()
    assert charge.result == "charged 7" and charge.job_state == "SUCCEEDED"
    assert trials.CHARGED == [7]
    assert delayed_kit.scheduled_jobs() == []


def test_a_cancelled_trial_runs_nothing(delayed_kit: DelayedTestKit, delayed_clock: DelayedClock) -> None:
    start_trial(7)
    start_trial(8)
    cancel_trial(7)
    delayed_kit.assert_not_scheduled(charge_trial, args=(7,))
    delayed_kit.assert_scheduled(charge_trial, args=(8,))
    delayed_clock.advance(days=30)
    ran = delayed_kit.run_due()
    assert sorted(job.args[0] for job in ran) == [8, 8]
    assert trials.CHARGED == [8] and trials.REMINDED == [8]


def test_a_declined_card_is_retried_every_six_hours(delayed_kit: DelayedTestKit, delayed_clock: DelayedClock) -> None:
    trials.DECLINING.add(7)
    start_trial(7)
    delayed_clock.advance(days=14)
    ran = delayed_kit.run_due()
    assert [job.state for job in ran if job.task == charge_trial.name] == ["RETRY"]
    delayed_kit.assert_scheduled(charge_trial, args=(7,), at=delayed_clock.now() + timedelta(hours=6))
    trials.DECLINING.clear()  # the user updated the card
    delayed_clock.advance(hours=6)
    [retry] = delayed_kit.run_due()
    assert retry.state == "SUCCESS" and trials.CHARGED == [7]


def test_a_card_declined_three_times_is_dead_lettered(delayed_kit: DelayedTestKit,
                                                       delayed_clock: DelayedClock) -> None:
    trials.DECLINING.add(7)
    handle = charge_trial.apply_later(args=(7,))
    states = []
    for _ in range(3):
        states += [job.state for job in delayed_kit.run_due()]
        delayed_clock.advance(hours=6)
    assert states == ["RETRY", "RETRY", "FAILURE"]
    assert delayed_kit.job_state(handle.id) == "DEAD"  # in the dead-letter queue (celery -A proj delayed dlq)
    assert trials.CHARGED == []


def test_propagate_raises_what_failed_for_good(delayed_kit: DelayedTestKit, delayed_clock: DelayedClock) -> None:
    trials.DECLINING.add(8)
    charge_trial.apply_later(args=(8,))
    for _ in range(2):
        delayed_kit.run_due(propagate=True)  # a retry is not a failure: nothing raised
        delayed_clock.advance(hours=6)
    with pytest.raises(trials.CardDeclined):
        delayed_kit.run_due(propagate=True)


def test_profile_changes_are_debounced(delayed_kit: DelayedTestKit, delayed_clock: DelayedClock) -> None:
    for field in ("name", "bio", "photo"):
        profile_changed(7, field)
        delayed_clock.advance(10)
    delayed_kit.assert_scheduled(reindex_profile, args=(7, "photo"), at=delayed_clock.now() + timedelta(seconds=20))
    assert len(delayed_kit.scheduled_jobs()) == 1
    delayed_clock.advance(20)
    delayed_kit.run_due()
    assert trials.INDEXED == [(7, "photo")]
