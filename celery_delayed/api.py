"""``apply_later`` and friends: schedule, cancel and reschedule delayed jobs."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery

from .errors import DuplicateJob, InvalidOption, UnknownTask
from .message import build_message, check_options, task_defaults
from .misfire import release_fields
from .result import DelayedResult
from .store import NewJob, get_store
from .timeutil import due_spec

#: Namespace of job ids derived from idempotency keys (uuid5).
IDEMPOTENCY_NAMESPACE = uuid.UUID("5b0e7a4c-2f47-4f3e-9d0a-6c3e1f0d9a11")
_MAX_ID = 512


@dataclass(frozen=True)
class _Prepared:
    job: NewJob
    idempotent: bool


def job_id_for_key(idempotency_key: str) -> str:
    """The job id an idempotency key maps to (stable, uuid5)."""
    if not isinstance(idempotency_key, str):
        raise InvalidOption(
            f"idempotency_key must be a string, got {type(idempotency_key).__name__} {idempotency_key!r}"
        )
    return str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, idempotency_key))


def _check_arguments(
    name: str, task_type: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> None:
    """Refuse arguments the task's signature rejects, as ``apply_async`` does (``Task.typing``)."""
    header = getattr(task_type, "__header__", None) if getattr(task_type, "typing", False) else None
    if header is None or not isinstance(args or (), (list, tuple)) or not isinstance(kwargs or {}, Mapping):
        return  # no signature to check; build_message reports wrong container types
    try:
        header(*(args or ()), **(kwargs or {}))
    except TypeError as exc:
        raise InvalidOption(
            f"the arguments do not match the signature of {name}: {exc}; fix the call "
            "(or set typing=False on the task to skip this check)"
        ) from exc


def _check_str(name: str, value: object, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidOption(f"{name} must be a string, got {type(value).__name__} {value!r}")
    if not value or not value.strip():
        raise InvalidOption(f"{name} must not be empty")
    if len(value.encode("utf-8")) > limit:
        raise InvalidOption(f"{name} is {len(value.encode('utf-8'))} bytes, over the limit of {limit}")
    return value


def prepare(
    app: Celery,
    name: str,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    when: object = 0,
    *,
    task_id: str | None = None,
    shard_key: str | int | None = None,
    idempotency_key: str | None = None,
    task_type: Any = None,
    options: Mapping[str, Any] | None = None,
) -> _Prepared:
    """Validate a call and build its job; write nothing."""
    store = get_store(app)
    options = dict(options or {})
    release = release_fields(options, task_type, store.config)  # pops max_lateness / misfire
    check_options(options)
    _check_arguments(name, task_type, args, kwargs)
    due = due_spec(when, app.timezone)
    if idempotency_key is not None:
        if task_id is not None:
            raise InvalidOption("pass either task_id or idempotency_key, not both")
        task_id = job_id_for_key(_check_str("idempotency_key", idempotency_key, 1024))
    elif task_id is not None:
        task_id = _check_str("task_id", task_id, _MAX_ID)
    else:
        task_id = str(uuid.uuid4())
    if shard_key is not None:
        if isinstance(shard_key, bool) or not isinstance(shard_key, (str, int)):
            raise InvalidOption(f"shard_key must be a string or an int, got {type(shard_key).__name__}")
        shard_key = _check_str("shard_key", str(shard_key), 1024)
    shard = store.shard_of(task_id, shard_key)
    headers = options.pop("headers", None) or {}
    if not isinstance(headers, Mapping):
        raise InvalidOption(f"headers must be a mapping, got {type(headers).__name__}")
    headers = dict(headers)
    headers["delayed_shard"] = shard
    built = build_message(
        app, name, args or (), kwargs or {}, task_id, options | {"headers": headers}, task_type,
        max_bytes=store.config.max_payload_bytes,
    )
    fields = {
        "task": name, "q": built.route.queue, "ex": built.route.exchange,
        "rk": built.route.routing_key, "msg": built.body,
        "sk": shard_key or "", "ik": idempotency_key or "", **release,
    }
    if store.direct:
        fields.update(built.destination(app.conf))
    if built.sent_event is not None:
        from kombu.utils.json import dumps

        fields["ev"] = dumps(built.sent_event)
    return _Prepared(NewJob(task_id, shard, due, fields), idempotency_key is not None)


def _lookup_task(app: Celery, name: str, strict: bool) -> Any:
    if not isinstance(name, str) or not name:
        raise UnknownTask(f"task name must be a non-empty string, got {name!r}")
    task = app.tasks.get(name)
    if task is None and strict:
        raise UnknownTask(
            f"no task named {name!r} is registered with app {app.main!r}; import the module "
            "that defines it (or list it in imports/include), or pass strict=False to "
            "schedule a task that only the workers define"
        )
    return task


def schedule_prepared(app: Celery, prepared: Sequence[_Prepared]) -> list[DelayedResult]:
    """Store prepared jobs (one round trip) and return their handles."""
    store = get_store(app)
    out = []
    for p, res in zip(prepared, store.schedule([p.job for p in prepared]), strict=True):
        if not res.created and not p.idempotent:
            raise DuplicateJob(res.id, res.state)
        out.append(DelayedResult(res.id, store=store, shard=res.shard, due_ms=res.due_ms, created=res.created))
    return out


def apply_later(
    app: Celery,
    name: str,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    when: object = 0,
    *,
    task_id: str | None = None,
    shard_key: str | int | None = None,
    idempotency_key: str | None = None,
    strict: bool = True,
    **options: Any,
) -> DelayedResult:
    """Schedule task ``name`` to be sent to its queue at ``when`` (like ``send_task``).

    Args:
        app: the Celery app.
        name: the task's registered name.
        args, kwargs: the task's arguments.
        when: an aware datetime (a naive one is read in the app's timezone, as
            Celery reads ``eta``), a timedelta, or seconds from now; a past
            time means "as soon as possible".
        task_id: the job's id (default: a new uuid4).
        shard_key: jobs with one shard key share a shard and are released in
            due-time order (default: the job id).
        idempotency_key: schedule at most one job per key: a second call
            returns the existing job (``created`` False).
        strict: refuse a task name this app does not define.
        **options: Celery's ``apply_async`` options: queue, routing_key,
            exchange, priority, expires, headers, serializer, ...; and
            ``max_lateness`` (seconds) with ``misfire`` ("run", "skip" or
            "dead"): what to do with a job released later than that (see
            :mod:`celery_delayed.misfire`). A job released after ``expires``
            is not sent (state EXPIRED).

    Raises:
        InvalidWhen, InvalidOption, SerializationError, PayloadTooLarge,
        UnknownTask: bad input; nothing is stored.
        DuplicateJob: ``task_id`` is taken.
        StoreUnavailable: Redis cannot be reached; nothing is stored.
    """
    task = _lookup_task(app, name, strict)
    opts = (task_defaults(task) if task is not None else {}) | options
    p = prepare(app, name, args, kwargs, when, task_id=task_id, shard_key=shard_key,
                idempotency_key=idempotency_key, task_type=task, options=opts)
    return schedule_prepared(app, [p])[0]


def apply_later_many(
    app: Celery, name: str, calls: Iterable[Mapping[str, Any]], *, strict: bool = True
) -> list[DelayedResult]:
    """Schedule many jobs of one task in few round trips (one per call, all shards pipelined).

    Each item of ``calls`` is a mapping of ``apply_later`` keyword arguments
    (``args``, ``kwargs``, ``when``, ``task_id``, options ...). Every call is
    validated before anything is written: one bad item stores nothing.
    """
    task = _lookup_task(app, name, strict)
    defaults = task_defaults(task) if task is not None else {}
    prepared = []
    chosen: list[NewJob] = []  # jobs whose task_id the caller chose
    for call in calls:
        c = dict(call)
        p = prepare(
            app, name, c.pop("args", None), c.pop("kwargs", None), c.pop("when", 0),
            task_id=c.pop("task_id", None), shard_key=c.pop("shard_key", None),
            idempotency_key=c.pop("idempotency_key", None), task_type=task, options=defaults | c,
        )
        prepared.append(p)
        if call.get("task_id") is not None:
            chosen.append(p.job)
    if not prepared:
        return []
    if chosen:
        _refuse_taken(app, chosen)
    return schedule_prepared(app, prepared)


def _refuse_taken(app: Celery, jobs: Sequence[NewJob]) -> None:
    """Refuse a batch whose caller-chosen task ids are taken, before anything is written.

    schedule.lua reports a taken id only after the batch's other jobs were
    written; this check (one round trip) leaves that to an id taken between
    the check and the write.
    """
    seen: set[str] = set()
    for job in jobs:
        if job.id in seen:
            raise InvalidOption(f"task_id {job.id!r} is given twice in this batch; give each job its own id")
        seen.add(job.id)
    for job, state in zip(jobs, get_store(app).states(jobs), strict=True):
        if state is not None:
            raise DuplicateJob(job.id, state)


def cancel(app: Celery, job_id: str, *, terminate: bool = False, signal: str = "SIGTERM") -> str:
    """Cancel job ``job_id``; return the state it had (SCHEDULED, CLAIMED or QUEUED).

    A RUNNING job is not cancelled (InvalidState with state RUNNING) unless
    ``terminate`` is set: then its record becomes CANCELLED and Celery's
    ``app.control.revoke(job_id, terminate=True, signal=signal)`` asks the
    workers to kill the process running it, which Celery can do in the
    prefork pool only (a thread or solo pool lets the body finish; its
    outcome is then not recorded). Returns "RUNNING" in that case.

    Raises:
        JobNotFound: no such job (or its record expired).
        InvalidState: it is finished or cancelled already, or running
            (without ``terminate``).
    """
    prev = get_store(app).cancel(job_id, running=terminate)
    if prev == "RUNNING":
        app.control.revoke(job_id, terminate=True, signal=signal)
    return prev


def cancel_by_key(app: Celery, idempotency_key: str) -> str:
    """Cancel the job scheduled with ``idempotency_key`` (see :func:`cancel`)."""
    return cancel(app, job_id_for_key(idempotency_key))


def reschedule(app: Celery, job_id: str, when: object) -> int:
    """Move a still-scheduled job to ``when``; return its new due time (epoch ms)."""
    return get_store(app).reschedule(job_id, due_spec(when, app.timezone))
