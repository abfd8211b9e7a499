"""A tour of the public API: ``python -m proj.usage`` (from ``example_project/``).

Schedules a few reminders, looks at them, reschedules one and cancels one.
Run a worker and a scheduler beside it to see them executed.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from celery_delayed import apply_later, apply_later_many, cancel

from .celery import app
from .tasks import remind


def main() -> None:
    """Schedule, inspect, reschedule and cancel a few jobs."""
    # when: a timedelta, a number of seconds, or an aware datetime.
    soon = remind.apply_later(args=(1,), when=timedelta(seconds=5))
    later = remind.apply_later(args=(2,), kwargs={"text": "stand up"}, when=30)
    fixed = remind.apply_later(args=(3,), when=datetime.now(timezone.utc) + timedelta(minutes=1))
    for h in (soon, later, fixed):
        print(f"scheduled {h.id} due {h.eta.isoformat()} ({h.job_state})")

    # Move a job that has not been released yet; cancel another.
    print("rescheduled to", later.reschedule(when=timedelta(seconds=10)).isoformat())
    print("cancelled:", fixed.cancel())

    # By name, like send_task; Celery's options (queue, priority, ...) apply.
    by_name = apply_later(app, "proj.tasks.remind", args=(4,), when=2, priority=5)
    print("by name:", by_name.id, by_name.eta.isoformat())

    # Many jobs in few round trips; an idempotency key makes a repeat a no-op.
    handles = apply_later_many(app, "proj.tasks.remind", [
        {"args": (uid,), "when": 3, "idempotency_key": f"welcome-{uid}"} for uid in range(5, 10)
    ])
    again = remind.apply_later(args=(5,), when=3, idempotency_key="welcome-5")
    print(f"{len(handles)} scheduled in bulk; repeat created a new job: {again.created}")

    # By id, from anywhere (e.g. another process): the state it had is returned.
    print("cancelled", handles[-1].id, "which was", cancel(app, handles[-1].id))


if __name__ == "__main__":
    main()
