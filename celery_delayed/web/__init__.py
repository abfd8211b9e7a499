"""The web dashboard: ``celery -A proj delayed web`` (server-rendered pages, standard library only).

Overview (counts by state, jobs coming due, lateness, schedulers and their
shards, pauses, rate limits (set, lift, reset at run time) and the busiest
tenants, pending by task and queue, dead-letter volume), pending jobs
in due order (by task and queue, search by id or idempotency key), one job
(record, arguments, history; cancel, run now, reschedule) and the
dead-letter queue (show, requeue, purge). Its template and stylesheet ship
in the package (no CDN). See :mod:`.server` for authentication and CSRF.
"""

from __future__ import annotations

from .server import MIN_TOKEN_LENGTH, Auth, DashboardServer, is_loopback, make_server, new_token, serve_in_thread

__all__ = ["MIN_TOKEN_LENGTH", "Auth", "DashboardServer", "is_loopback", "make_server", "new_token", "serve_in_thread"]
