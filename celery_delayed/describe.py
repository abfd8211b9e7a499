"""A job record as an operator reads it: each field's label in words, its arguments, its times.

One mapping from record fields (:class:`celery_delayed.vocab.Field`, the
short names Redis keeps: ``st``, ``q``, ``lk`` ...) to labels, shared by the
dashboard's job page and ``celery -A proj delayed show``, so that both say
the same thing in the same words. :func:`summary` is what an operator reads
first; :func:`details` is the rest of the record, labelled too.
"""

from __future__ import annotations

from collections.abc import Mapping

from .rate_limits import format_rate
from .store.records import arguments_of
from .store.shaping import Limit
from .timeutil import from_ms
from .vocab import TIME_FIELDS, Field

#: Every record field, in words (``tests/unit/test_describe.py`` checks that none is missing).
LABELS: dict[str, str] = {
    "id": "job id",
    "shard": "shard",
    Field.STATE: "state",
    Field.MOVED_STATE: "state before the reshard move",
    Field.MOVED_DIED: "dead-lettered (before the reshard move)",
    Field.DUE: "due",
    Field.CREATED: "scheduled at",
    Field.RELEASED: "released to its queue",
    Field.CANCELLED: "cancelled at",
    Field.TASK: "task",
    Field.QUEUE: "queue",
    Field.EXCHANGE: "exchange",
    Field.ROUTING_KEY: "routing key",
    Field.MESSAGE: "message",
    Field.LIST_KEY: "broker list",
    Field.BINDINGS: "exchange bindings",
    Field.PRIORITY_SUFFIX: "priority suffix",
    Field.SENT_EVENT: "task-sent event",
    Field.SHARD_KEY: "shard key",
    Field.IDEMPOTENCY_KEY: "idempotency key",
    Field.DEBOUNCED: "debounced (released when due, not a look-ahead early)",
    Field.EXPIRES: "expires",
    Field.MAX_LATENESS: "max lateness (ms)",
    Field.MISFIRE: "misfire policy",
    Field.REASON: "reason",
    Field.CLAIMS: "claims (publish path)",
    Field.ATTEMPT: "executions begun",
    Field.LEASE_OWNER: "execution lease held by",
    Field.LEASE_UNTIL: "execution lease until",
    Field.STARTED: "started (latest execution)",
    Field.WORKER: "worker",
    Field.FINISHED: "finished",
    Field.RETRIES: "retries scheduled",
    Field.FIRST_AT: "first failed attempt",
    Field.LAST_AT: "latest failed attempt",
    Field.ERROR_TYPE: "error type",
    Field.ERROR_MESSAGE: "error message",
    Field.TRACEBACK: "traceback",
    Field.HOST: "failed on host",
    Field.DELAY: "retry backoff (ms)",
    Field.SPREAD: "spread offset (ms)",
    Field.TENANT: "tenant",
    Field.LIMIT_WAIT: "waiting for a token of the rate limit",
    Field.DIED: "dead-lettered",
    Field.ARGS: "arguments",
    Field.KWARGS: "keyword arguments",
    Field.ATTEMPTS: "attempts made",
    Field.REQUEUED: "times requeued",
    Field.REQUEUED_AT: "last requeued",
    Field.GENERATION: "generation",
    Field.REFUSED: "refused by the broker",
    Field.COPIES: "sent again by the reconciler",
    Field.OUTBOX: "awaiting its database row",
    Field.TEMPLATE: "message template",
    Field.TAG: "delivery tag suffix",
    Field.C_ARGSREPR: "arguments (compact record)",
    Field.C_KWARGSREPR: "keyword arguments (compact record)",
    Field.C_BODY: "message body head (compact record)",
    Field.C_ETA: "eta header (compact record)",
    Field.C_ID: "quoted id (compact record)",
    Field.C_ROOT: "root id (compact record)",
    Field.C_PARENT: "parent id (compact record)",
}

#: Fields :func:`summary` shows (so :func:`details` leaves them out), besides the arguments.
SUMMARY_FIELDS = frozenset({
    "id", Field.STATE, Field.REASON, Field.TASK, Field.QUEUE, Field.DUE, Field.ATTEMPT, Field.ATTEMPTS,
    Field.RETRIES, Field.IDEMPOTENCY_KEY, Field.SHARD_KEY, Field.ERROR_TYPE, Field.ERROR_MESSAGE, Field.ARGS,
    Field.KWARGS, Field.TRACEBACK, Field.TENANT, Field.LIMIT_WAIT,
})


def label(field: str) -> str:
    """A record field's label in words (an unknown field: its own name)."""
    return LABELS.get(field, field)


def when(ms: object) -> str:
    """An epoch-ms time as a UTC date to the millisecond ("2025-01-31 12:00:00.000Z"), or "-"."""
    if ms in (None, "", -1, "-1"):
        return "-"
    try:
        return from_ms(int(float(str(ms)))).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    except (ValueError, OverflowError, OSError):
        return str(ms)


def ago(ms: int, now_ms: int) -> str:
    """How far ``ms`` is from now, in words ("in 5m 3s", "12s ago")."""
    d = (ms - now_ms) / 1000.0
    a = abs(d) if abs(d) < 1 else float(round(abs(d)))  # whole seconds: never "9m 60s"
    if a < 1:
        text = f"{a * 1000:.0f}ms"
    elif a < 120:
        text = f"{a:.0f}s"
    elif a < 7200:
        text = f"{a // 60:.0f}m {a % 60:.0f}s"
    elif a < 172_800:
        text = f"{a // 3600:.0f}h {a % 3600 // 60:.0f}m"
    else:
        text = f"{a // 86400:.0f}d {a % 86400 // 3600:.0f}h"
    return f"in {text}" if d >= 0 else f"{text} ago"


def arguments(rec: Mapping[str, str], message: str | None) -> tuple[str, str]:
    """The job's ``argsrepr`` and ``kwargsrepr`` (see :func:`celery_delayed.store.records.arguments_of`)."""
    return arguments_of(rec, message)


def attempts(rec: Mapping[str, str]) -> str:
    """Executions begun (a dead letter: the attempts it made), and the retries scheduled, in words."""
    if rec.get(Field.ATTEMPTS):
        text = f"{rec[Field.ATTEMPTS]} made"
    else:
        begun = rec.get(Field.ATTEMPT) or "0"
        text = "none yet" if begun == "0" else f"{begun} begun"
    retries = rec.get(Field.RETRIES)
    return text + (f", {retries} retries scheduled" if retries not in (None, "", "0") else "")


def error(rec: Mapping[str, str]) -> str:
    """The last failure ("Type: message"), or the reason it did not run; "" when none."""
    if rec.get(Field.ERROR_TYPE):
        return f"{rec[Field.ERROR_TYPE]}: {rec.get(Field.ERROR_MESSAGE, '')}"
    return rec.get(Field.REASON, "")


def summary(rec: Mapping[str, str], message: str | None, now_ms: int) -> list[tuple[str, str]]:
    """What an operator reads first, as (label, text): job id, state, task, arguments, queue, due, attempts,
    and the tenant, the rate limit it waits under, idempotency key, shard key and last error when there are."""
    args, kwargs = arguments(rec, message)
    due = rec.get(Field.DUE)
    if not args and not kwargs:  # the message goes when the job starts or ends (a dead letter keeps a repr)
        args = "not kept: a job's message is dropped when it starts, is cancelled or ends"
    rows = [
        (LABELS["id"], rec.get("id", "")),
        (LABELS[Field.STATE], rec.get(Field.STATE, "")),
        (LABELS[Field.TASK], rec.get(Field.TASK, "")),
        (LABELS[Field.ARGS], args),
        (LABELS[Field.KWARGS], kwargs or "-"),
        (LABELS[Field.QUEUE], rec.get(Field.QUEUE, "")),
        (LABELS[Field.DUE], f"{when(due)} ({ago(int(float(due)), now_ms)})" if due else "-"),
        ("attempts", attempts(rec)),
    ]
    for field in (Field.TENANT, Field.LIMIT_WAIT, Field.IDEMPOTENCY_KEY, Field.SHARD_KEY):
        if rec.get(field):
            rows.append((LABELS[field], rec[field]))
    if error(rec):
        rows.append(("error" if rec.get(Field.ERROR_TYPE) else LABELS[Field.REASON], error(rec)))
    return rows


def details(rec: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """The rest of the record (what :func:`summary` leaves out, traceback too), as (field, label, text),
    times also as dates ("<ms> (<date>)"), in label order."""
    out = []
    for field, value in rec.items():
        if field in SUMMARY_FIELDS:
            continue
        text = f"{value} ({when(value)})" if field in TIME_FIELDS and value else value
        out.append((field, label(field), text))
    return sorted(out, key=lambda row: row[1])


def raw(rec: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """Every field of the record as it is kept, as (field, label, value), by field name (the "raw record")."""
    return [(field, label(field), rec[field]) for field in sorted(rec)]


def limit(row: Limit) -> tuple[str, str]:
    """A rate limit's rate in Celery's syntax ("50/s"; "none" when lifted) and where it comes from: "app"
    (``delayed_rate_limits``), "runtime" (set at run time) or "lifted" (no limit, jobs may still wait)."""
    if row.per_second is None:
        return "none", "lifted"
    return format_rate(row.per_second), row.source
