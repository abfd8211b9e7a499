"""The worker side: the task base class, the execution record, failures, backoff, interception.

- :mod:`.task`: :class:`DelayedTask`, the base class that runs a job's body
  under its execution record and retries through the store.
- :mod:`.execution`: execution leases and their heartbeat.
- :mod:`.failures`: retry, dead-letter or fail a failed attempt.
- :mod:`.backoff`: the backoff policies (pure).
- :mod:`.intercept`: ``delayed_intercept_eta`` (``apply_async(countdown=)`` through the store).
- :mod:`.bootstep`: ``celery worker --delayed`` (an embedded scheduler).
"""
