"""``apply_later`` and friends: schedule, cancel and reschedule delayed jobs."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery
from celery._state import _task_stack

from .errors import DuplicateJob, InvalidOption, UnknownTask
from .keys import shard_for
from .message import BuiltMessage, build_message, check_options, task_defaults
from .misfire import release_fields
from .result import DelayedResult
from .store import NewJob, Store, get_store
from .template import Template, fast_uuid4, template_for
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
        task_id = fast_uuid4()
    if shard_key is not None:
        if isinstance(shard_key, bool) or not isinstance(shard_key, (str, int)):
            raise InvalidOption(f"shard_key must be a string or an int, got {type(shard_key).__name__}")
        shard_key = _check_str("shard_key", str(shard_key), 1024)
    shard = store.shard_of(task_id, shard_key)
    headers = options.pop("headers", None) or {}
    if not isinstance(headers, Mapping):
        raise InvalidOption(f"headers must be a mapping, got {type(headers).__name__}")
    headers = dict(headers)
    fast = _render_fast(app, store, name, args or (), kwargs or {}, task_id, shard, options, headers, task_type,
                        release)
    if fast is not None:
        common, fields = fast
        fields["sk"], fields["ik"] = shard_key or "", idempotency_key or ""
        return _Prepared(NewJob(task_id, shard, due, fields, common), idempotency_key is not None)
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


def _render_fast(
    app: Celery, store: Store, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], task_id: str,
    shard: int, options: dict[str, Any], headers: Mapping[str, Any], task_type: Any, release: Mapping[str, str],
) -> tuple[dict[str, str], dict[str, str]] | None:
    """(shared, all) record fields of a job whose message a cached template renders, else None.

    The shared fields are one object per template and release settings, so
    that :meth:`Store.schedule` sends them once per call.
    """
    root_id, parent_id = options.get("root_id"), options.get("parent_id")
    keyed = options
    if "root_id" in options or "parent_id" in options:
        keyed = {k: v for k, v in options.items() if k not in ("root_id", "parent_id")}
    max_bytes = store.config.max_payload_bytes
    tmpl = template_for(app, name, keyed, headers, task_type, max_bytes)
    if tmpl is None:
        return None
    if (not root_id or not parent_id) and _task_stack.top is not None:  # .top: cheap "not in a task"
        parent = app.current_worker_task
        if parent is not None:
            root_id = root_id or parent.request.root_id or parent.request.id
            parent_id = parent_id or parent.request.id
    text = tmpl.render(task_id, shard, args, kwargs, root_id, parent_id)
    if text is None or len(text) > max_bytes:
        return None  # the regular path builds it (and raises what it raises)
    common = _shared_fields(app, store, name, tmpl, release)
    fields = dict(common)
    fields["msg"] = text
    return common, fields


def _shared_fields(app: Celery, store: Store, name: str, tmpl: Template, release: Mapping[str, str]) -> dict[str, str]:
    """The record fields every job of a template (and release settings) has: one object, cached."""
    rkey = tuple(release.items())
    common = tmpl.records.get(rkey)
    if common is None:
        route = tmpl.route
        common = {"task": name, "q": route.queue, "ex": route.exchange, "rk": route.routing_key, **release}
        if store.direct:
            common.update(BuiltMessage("", route, None).destination(app.conf))
        if len(tmpl.records) < 64:
            tmpl.records[rkey] = common
    return common


_PLAIN_KEYS = frozenset({"args", "kwargs", "when"})


class _PlainCalls:
    """``prepare`` for the calls of a batch that give only args, kwargs and when.

    Such calls share everything but those (options, routing, release fields,
    the parent task), so that is resolved once per batch, not once per call.
    """

    __slots__ = ("common", "n_shards", "parent_id", "root_id", "store", "tmpl", "tz")

    def __init__(self, store: Store, tmpl: Template, common: dict[str, str], root_id: Any, parent_id: Any,
                 tz: Any) -> None:
        self.store, self.tmpl, self.common, self.tz = store, tmpl, common, tz
        self.root_id, self.parent_id = root_id, parent_id
        self.n_shards = store.config.shards

    @classmethod
    def create(cls, app: Celery, name: str, task: Any, defaults: Mapping[str, Any]) -> _PlainCalls | None:
        """The batch's shared part, or None when the calls need the regular path."""
        store = get_store(app)
        options = dict(defaults)
        try:
            release = release_fields(options, task, store.config)
            check_options(options)
        except InvalidOption:
            return None  # let the regular path raise it for the first call
        headers = options.pop("headers", None) or {}
        if not isinstance(headers, Mapping):
            return None
        root_id, parent_id = options.pop("root_id", None), options.pop("parent_id", None)
        tmpl = template_for(app, name, options, dict(headers), task, store.config.max_payload_bytes)
        if tmpl is None:
            return None
        if (not root_id or not parent_id) and _task_stack.top is not None:
            parent = app.current_worker_task
            if parent is not None:
                root_id = root_id or parent.request.root_id or parent.request.id
                parent_id = parent_id or parent.request.id
        common = _shared_fields(app, store, name, tmpl, release)
        return cls(store, tmpl, common, root_id, parent_id, app.timezone)

    def prepare(self, args: Any, kwargs: Any, when: object) -> _Prepared | None:
        """The job of one call, or None (then the regular path prepares it)."""
        due = due_spec(when, self.tz)
        task_id = fast_uuid4()
        shard = shard_for(task_id, self.n_shards)
        text = self.tmpl.render(task_id, shard, args or (), kwargs or {}, self.root_id, self.parent_id)
        if text is None or len(text) > self.store.config.max_payload_bytes:
            return None
        fields = dict(self.common)
        fields["msg"] = text
        return _Prepared(NewJob(task_id, shard, due, fields, self.common), False)


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
    plain = _PlainCalls.create(app, name, task, defaults)
    for call in calls:
        if not isinstance(call, Mapping):
            raise InvalidOption(
                f"each item of calls must be a mapping of apply_later keyword arguments, "
                f"got {type(call).__name__} {call!r:.80}"
            )
        if plain is not None and call.keys() <= _PLAIN_KEYS:
            fast = plain.prepare(call.get("args"), call.get("kwargs"), call.get("when", 0))
            if fast is not None:
                prepared.append(fast)
                continue
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
