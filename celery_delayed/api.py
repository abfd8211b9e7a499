"""The public API: ``apply_later`` and friends (schedule, cancel, reschedule, look up).

Each function validates its input (:mod:`celery_delayed.producer`), calls the
store's gateway (:class:`celery_delayed.store.Store`) and returns a handle
(:class:`~celery_delayed.result.DelayedResult`) or a plain value.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from celery import Celery

from .announce import shared as shared_announcer
from .cancellation import cancel_job
from .errors import ConfigurationError, DuplicateJob, InvalidOption, StoreFull
from .producer.keyed import KeyedSpec, keyed_spec
from .producer.message import parent_ids, task_defaults
from .producer.prepare import PlainCalls, Prepared, job_id_for_key, lookup_task, prepare, refuse_taken
from .producer.spread import spread_ms
from .result import DelayedResult
from .store import NewJob, Store, get_store
from .timeutil import due_spec, from_ms
from .vocab import Field, JobState

__all__ = ["apply_later", "apply_later_many", "cancel", "cancel_by_key", "job_id_for_key", "lookup", "reschedule"]


#: apply_later's debounce and throttle arguments (apply_later_many does not take them).
_KEYED_ARGS = frozenset({"debounce_key", "max_wait", "throttle_key", "window"})

#: How often a call tries the next generation of an idempotency key whose job another call cancels meanwhile.
_GENERATION_TRIES = 5


def store_prepared(app: Celery, store: Store, prepared: Sequence[Prepared],
                   connection: Any = None) -> list[DelayedResult]:
    """Store jobs prepared for ``store`` (:func:`~celery_delayed.producer.prepare.prepare`; one round trip) and
    return their handles.

    A job with an idempotency key whose previous job was cancelled is stored
    again as that job's next generation (one more round trip, only then): a
    cancel frees the key. With ``delayed_database_url`` the rows are written
    first (:mod:`celery_delayed.sql.outbox`).
    """
    if store.config.database_url:
        # imported here: SQLAlchemy is an optional extra (celery-delayed[sql])
        from .sql.outbox import store_with_rows
        from .sql.rows import get_rows

        rows = get_rows(app)
        assert rows is not None
        return store_with_rows(app, store, rows, prepared, connection)
    if connection is not None:
        raise ConfigurationError("connection= needs delayed_database_url (the jobs are rows of that database)")
    try:
        results = store.jobs.schedule([p.job for p in prepared])
    except StoreFull as exc:  # (a Redis Cluster with one node full: the handles of the jobs stored anyway)
        exc.written = {i: DelayedResult(res.id, store=store, shard=res.shard, due_ms=res.due_ms,
                                        created=res.created) for i, res in exc.written.items()}
        raise
    for _ in range(_GENERATION_TRIES):
        again = [(i, p.regenerate) for i, (p, res) in enumerate(zip(prepared, results, strict=True))
                 if not res.created and p.regenerate is not None and res.state == JobState.CANCELLED]
        if not again:
            break
        redo = [regenerate(results[i].generation + 1) for i, regenerate in again]
        for (i, _), res in zip(again, store.jobs.schedule([p.job for p in redo]), strict=True):
            results[i] = res
    out = []
    for p, res in zip(prepared, results, strict=True):
        if not res.created and not p.idempotent:
            raise DuplicateJob(res.id, res.state)
        out.append(DelayedResult(res.id, store=store, shard=res.shard, due_ms=res.due_ms, created=res.created))
    # (a compact job's record keeps no sent event: its template is made only with the events off)
    if any(p.job.template is None for p in prepared) and app.conf.task_send_sent_event:
        _announce_scheduled(app, prepared, results)
    return out


def _announce_scheduled(app: Celery, prepared: Sequence[Prepared], results: Sequence[Any]) -> None:
    """``task-sent`` with the eta for each job just stored (its record's stored event fields)."""
    events = []
    for p, res in zip(prepared, results, strict=True):
        raw = p.job.fields.get(Field.SENT_EVENT) or (p.job.common or {}).get(Field.SENT_EVENT)
        if res.created and raw:
            events.append((json.loads(raw), from_ms(res.due_ms).isoformat()))
    shared_announcer(app).scheduled(events)


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
    connection: Any = None,
    debounce_key: str | None = None,
    max_wait: float | timedelta | None = None,
    throttle_key: str | None = None,
    window: float | timedelta | None = None,
    spread: float | timedelta | None = None,
    tenant: str | None = None,
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
        connection: with ``delayed_database_url``: the caller's open SQLAlchemy
            ``Session`` or ``Connection``, or Django connection; the job's row
            is written in its transaction and indexed in Redis once it
            commits (rolled back: the job never existed). See
            :mod:`celery_delayed.sql.outbox`.
        debounce_key: while this key's job waits, a call replaces its
            arguments and options and moves it to this call's ``when``
            (keeping its id; ``created`` False), but never later than
            ``max_wait`` (seconds or a timedelta) after the key's first call.
            It is released when it is due (never ``delayed_lookahead_ms``
            early, so calls until then still reach it); once it is released,
            the next call creates a new job.
        throttle_key: at most one job per key per ``window`` (seconds or a
            timedelta), counted from the call that created it; a call within
            the window returns that job (``created`` False) and changes nothing.
        spread: a window (seconds or a timedelta) after ``when`` in which the
            job is placed, at an offset its id decides (the task's
            ``delayed_spread`` by default): many jobs due at one moment become
            a ramp. The offset is kept in the job's record (``spr``, ms).
        tenant: the job's tenant: when more jobs are due than one release
            takes, the release takes them round-robin across tenants, so
            that one tenant's flood does not hold up another's jobs; the
            ``tenant:`` keys of ``delayed_rate_limits`` apply to it.
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
        ConfigurationError: a debounce or throttle key with
            ``delayed_database_url`` (not supported).
    """
    task = lookup_task(app, name, strict)
    opts = (task_defaults(task) if task is not None else {}) | options
    store = get_store(app)
    spec = keyed_spec(debounce_key, max_wait, throttle_key, window, task_id=task_id,
                      idempotency_key=idempotency_key, connection=connection,
                      database=bool(store.config.database_url))
    sp = task_spread(task, spread)
    if spec is not None:
        if sp:
            raise InvalidOption("spread does not apply to a debounced or throttled job: its key decides when it "
                                "goes; pass spread=0 (or leave it out) with debounce_key / throttle_key")
        return _apply_keyed(app, store, name, args, kwargs, when, spec, shard_key, task, opts, tenant)
    if not options and task_id is None and shard_key is None and idempotency_key is None:
        # Only args, kwargs, when (and a tenant): the path apply_later_many takes for such calls (the same job).
        plain = PlainCalls.cached(app, store, name, task, opts)
        fast = plain.prepare(args, kwargs, when, parent_ids(app, None, None), sp, tenant) if plain is not None \
            else None
        if fast is not None:
            return store_prepared(app, store, [fast], connection)[0]
    p = prepare(app, store, name, args, kwargs, when, task_id=task_id, shard_key=shard_key,
                idempotency_key=idempotency_key, task_type=task, options=opts, spread_ms=sp, tenant=tenant)
    return store_prepared(app, store, [p], connection)[0]


def task_spread(task: Any, spread: object) -> int:
    """The spread window of a call, ms: its own ``spread``, else the task's ``delayed_spread`` (0: none).

    Raises:
        InvalidOption: a bad value (naming where it came from).
    """
    if spread is not None:
        return spread_ms(spread, "spread")
    default = getattr(task, "delayed_spread", None)
    return spread_ms(default, f"{getattr(task, 'name', 'task')}.delayed_spread") if default is not None else 0


def _apply_keyed(app: Celery, store: Store, name: str, args: Sequence[Any] | None,
                 kwargs: Mapping[str, Any] | None, when: object, spec: KeyedSpec, shard_key: str | int | None,
                 task: Any, opts: Mapping[str, Any], tenant: str | None = None) -> DelayedResult:
    """``apply_later`` with a debounce or throttle key: one script on the key's shard."""
    p = prepare(app, store, name, args, kwargs, when, shard_key=spec.key if shard_key is None else shard_key,
                task_type=task, options=opts, tenant=tenant)
    res = store.jobs.schedule_keyed(p.job, spec.mode, spec.key, spec.limit_ms)
    if res.created and app.conf.task_send_sent_event:
        _announce_scheduled(app, [p], [res])
    # (a throttled call whose job's record is gone gets due 0: the handle then reads it when asked)
    return DelayedResult(res.id, store=store, shard=res.shard, due_ms=res.due_ms or None, created=res.created)


def apply_later_many(
    app: Celery, name: str, calls: Iterable[Mapping[str, Any]], *, strict: bool = True, connection: Any = None,
    spread: float | timedelta | None = None, tenant: str | None = None,
) -> list[DelayedResult]:
    """Schedule many jobs of one task in one round trip (one script call per shard, in one ``MULTI``/``EXEC``).

    Each item of ``calls`` is a mapping of ``apply_later`` keyword arguments
    (``args``, ``kwargs``, ``when``, ``task_id``, options ...). Every call is
    validated before anything is written: one bad item stores nothing. A
    store at ``maxmemory`` refuses the whole batch (``StoreFull``), also when
    it fills up part way; on a Redis Cluster each shard's part is written on
    its own. ``spread`` and ``tenant``: as :func:`apply_later`'s, for every
    call (a call's own ``spread`` or ``tenant`` wins).
    """
    task = lookup_task(app, name, strict)
    defaults = task_defaults(task) if task is not None else {}
    store = get_store(app)
    sp = task_spread(task, spread)
    prepared = []
    chosen: list[NewJob] = []  # jobs whose task_id the caller chose
    plain = PlainCalls.create(app, store, name, task, defaults)
    for call in calls:
        if not isinstance(call, Mapping):
            raise InvalidOption(
                f"each item of calls must be a mapping of apply_later keyword arguments, "
                f"got {type(call).__name__} {call!r:.80}"
            )
        if plain is not None and PlainCalls.accepts(call):
            fast = plain.prepare(call.get("args"), call.get("kwargs"), call.get("when", 0), spread_ms=sp,
                                 tenant=call.get("tenant", tenant))
            if fast is not None:
                prepared.append(fast)
                continue
        c = dict(call)
        if _KEYED_ARGS.intersection(c):
            raise InvalidOption(
                f"apply_later_many does not take {sorted(_KEYED_ARGS.intersection(c))}: a debounced or "
                "throttled call decides on the key's job one at a time; call apply_later for it")
        own_spread = spread_ms(c.pop("spread"), "spread") if "spread" in c else sp
        p = prepare(
            app, store, name, c.pop("args", None), c.pop("kwargs", None), c.pop("when", 0),
            task_id=c.pop("task_id", None), shard_key=c.pop("shard_key", None),
            idempotency_key=c.pop("idempotency_key", None), spread_ms=own_spread,
            tenant=c.pop("tenant") if "tenant" in c else tenant, task_type=task, options=defaults | c,
        )
        prepared.append(p)
        if call.get("task_id") is not None:
            chosen.append(p.job)
    if not prepared:
        return []
    if chosen and not store.config.database_url:  # with a database its primary key refuses them
        refuse_taken(store, chosen)
    return store_prepared(app, store, prepared, connection)


def cancel(app: Celery, job_id: str, *, terminate: bool = False, signal: str = "SIGTERM") -> str:
    """Cancel job ``job_id``; return the state it had (SCHEDULED, CLAIMED or QUEUED).

    The job is then reported as Celery reports a revoked task: REVOKED in the
    result backend, so ``AsyncResult(job_id).get()`` raises
    ``TaskRevokedError`` at once, and a ``task-revoked`` event.

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
    return cancel_job(get_store(app), job_id, terminate=terminate, signal=signal)


def cancel_by_key(app: Celery, idempotency_key: str) -> str:
    """Cancel the job scheduled with ``idempotency_key`` (see :func:`cancel`)."""
    return cancel(app, job_id_for_key(idempotency_key))


def reschedule(app: Celery, job_id: str, when: object) -> int:
    """Move a still-scheduled job to ``when``; return its new due time (epoch ms)."""
    return get_store(app).jobs.reschedule(job_id, due_spec(when, app.timezone))


def lookup(app: Celery, job_id: str) -> DelayedResult:
    """The handle of an existing job, from its id (in any process): its state and ETA are read from the store.

    Raises:
        JobNotFound: no such job (or its record expired).
    """
    store = get_store(app)
    rec = store.lookup.get(job_id)
    return DelayedResult(job_id, store=store, shard=int(rec["shard"]), due_ms=int(float(rec[Field.DUE])),
                         created=False)
