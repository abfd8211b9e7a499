"""Turn ``apply_later`` calls into jobs: validate, choose the id and shard, build the record.

Nothing here writes to Redis; :func:`celery_delayed.api.apply_later` stores
what :func:`prepare` returns. Each function is handed the app's store (what it
reads of the settings, the shard layout and kombu's layout) by its caller,
which looked it up once for the call. A call is validated whole before anything is
stored (bad input raises a typed error and leaves nothing behind).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery

from ..errors import DuplicateJob, InvalidOption, UnknownTask
from ..store import NewJob, Store, shard_for
from ..store.compact import Template, fast_uuid4
from ..timeutil import due_spec, eta_is_due, eta_iso
from ..vocab import ETA_HEADER, GENERATION_HEADER, SHARD_HEADER, STORE_HEADER, Field, job_headers
from .message import build_message, check_options, parent_ids, route_fields
from .misfire import check_expiry, release_fields
from .spread import offset_ms, spread_when
from .template import MessageTemplate, template_for

#: Namespace of job ids derived from idempotency keys (uuid5).
IDEMPOTENCY_NAMESPACE = uuid.UUID("5b0e7a4c-2f47-4f3e-9d0a-6c3e1f0d9a11")
MAX_ID_BYTES = 512
MAX_KEY_BYTES = 1024
#: ``prepare(eta=FROM_WHEN)``: the message's ``delayed_eta`` header is ``when`` as Celery writes an eta.
FROM_WHEN: Any = object()
#: Headers celery-delayed writes itself into a stored job's message (a caller's copy is dropped).
_OWN_HEADERS = frozenset({SHARD_HEADER, STORE_HEADER, ETA_HEADER, GENERATION_HEADER})


@dataclass(frozen=True)
class Prepared:
    """A validated job, ready to store."""

    job: NewJob
    idempotent: bool  # scheduled with an idempotency key: a taken id returns the existing job
    #: for an idempotency key's job: the same call as generation ``n`` (after a cancel freed the key)
    regenerate: Callable[[int], Prepared] | None = None


def job_id_for_key(idempotency_key: str) -> str:
    """The job id an idempotency key maps to (stable, uuid5)."""
    if not isinstance(idempotency_key, str):
        raise InvalidOption(
            f"idempotency_key must be a string, got {type(idempotency_key).__name__} {idempotency_key!r}"
        )
    return str(uuid.uuid5(IDEMPOTENCY_NAMESPACE, idempotency_key))


def lookup_task(app: Celery, name: str, strict: bool) -> Any:
    """The registered task ``name`` (None when unknown and not ``strict``).

    Raises:
        UnknownTask: a bad name, or an unregistered one with ``strict``.
    """
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


def check_str(name: str, value: object, limit: int) -> str:
    """A non-empty, printable string of at most ``limit`` UTF-8 bytes, else :class:`InvalidOption`."""
    if not isinstance(value, str):
        raise InvalidOption(f"{name} must be a string, got {type(value).__name__} {value!r}")
    if not value or not value.strip():
        raise InvalidOption(f"{name} must not be empty")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise InvalidOption(
            f"{name} must not contain control or invisible characters (found {bad!r} in {value!r}): "
            "ids and keys are shown in listings, logs and the CLI"
        )
    if len(value.encode("utf-8")) > limit:
        raise InvalidOption(f"{name} is {len(value.encode('utf-8'))} bytes, over the limit of {limit}")
    return value


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


def _job_id(task_id: str | None, idempotency_key: str | None) -> str:
    if idempotency_key is not None:
        if task_id is not None:
            raise InvalidOption("pass either task_id or idempotency_key, not both")
        return job_id_for_key(check_str("idempotency_key", idempotency_key, MAX_KEY_BYTES))
    if task_id is not None:
        return check_str("task_id", task_id, MAX_ID_BYTES)
    return fast_uuid4()


def _shard_key(shard_key: object) -> str | None:
    if shard_key is None:
        return None
    if isinstance(shard_key, bool) or not isinstance(shard_key, (str, int)):
        raise InvalidOption(f"shard_key must be a string or an int, got {type(shard_key).__name__}")
    return check_str("shard_key", str(shard_key), MAX_KEY_BYTES)


def prepare(
    app: Celery,
    store: Store,
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
    generation: int = 0,
    eta: str | None = FROM_WHEN,
    properties: Mapping[str, Any] | None = None,
    spread_ms: int = 0,
    tenant: str | None = None,
) -> Prepared:
    """Validate a call and build its job for ``store``; write nothing.

    ``generation`` > 0 (an idempotency key's job scheduled again after a
    cancel) goes into the record and the message's ``delayed_gen`` header.
    ``eta`` is the message's ``delayed_eta`` header, what the task sees as
    ``request.eta`` (default: ``when``, see :func:`~celery_delayed.timeutil.eta_iso`).
    ``properties``: more message properties (interception: the options Celery
    would hand to kombu's ``publish``). ``spread_ms``: a window after ``when``
    in which the job is placed at an offset its id decides (:mod:`.spread`).
    ``tenant``: the job's tenant (see :func:`check_tenant`), kept in its record.

    Raises:
        InvalidWhen, InvalidOption, SerializationError, PayloadTooLarge: bad input.
    """
    regenerate = None
    if idempotency_key is not None:
        def regenerate(generation: int) -> Prepared:
            return prepare(app, store, name, args, kwargs, when, task_id=task_id, shard_key=shard_key,
                           idempotency_key=idempotency_key, task_type=task_type, options=options,
                           generation=generation, eta=eta, properties=properties, spread_ms=spread_ms,
                           tenant=tenant)
    options = dict(options or {})
    release = release_fields(options, task_type, store.config)  # pops max_lateness / misfire
    check_options(options)
    _check_arguments(name, task_type, args, kwargs)
    job_id = _job_id(task_id, idempotency_key)
    offset = offset_ms(job_id, spread_ms)
    if spread_ms:
        when = spread_when(when, offset, app.timezone)
    due = due_spec(when, app.timezone)
    # A delay's eta is the due time by the store's clock in a compact record (rendered from `due`).
    eta_from_due = eta is FROM_WHEN and eta_is_due(due, app.timezone)
    if eta is FROM_WHEN:
        eta = eta_iso(when, app.timezone)
    check_expiry(options.get("expires"), due)
    skey = _shard_key(shard_key)
    shard = store.layout.shard_of(job_id, skey)
    headers = options.pop("headers", None) or {}
    if not isinstance(headers, Mapping):
        raise InvalidOption(f"headers must be a mapping, got {type(headers).__name__}")
    if not _OWN_HEADERS.isdisjoint(headers):  # e.g. a retry's copy of the request's headers
        headers = {k: v for k, v in headers.items() if k not in _OWN_HEADERS}
    per_job = {Field.SHARD_KEY: skey or "", Field.IDEMPOTENCY_KEY: idempotency_key or "",
               Field.SPREAD: str(offset) if spread_ms else "", Field.TENANT: check_tenant(tenant)}
    if generation:
        headers = {**headers, GENERATION_HEADER: generation}
        per_job[Field.GENERATION] = str(generation)
    fast = None if properties else _render_fast(
        app, store, name, args or (), kwargs or {}, job_id, shard, options, headers, task_type, release, eta,
        eta_from_due)
    if fast is not None:
        common, fields, compact = fast
        return Prepared(NewJob(job_id, shard, due, fields | per_job, common, compact), regenerate is not None,
                        regenerate)
    built = build_message(
        app, name, args or (), kwargs or {}, job_id,
        options | {"headers": {**headers, **job_headers(shard, store.config.key_prefix, eta)}},
        task_type, max_bytes=store.config.max_payload_bytes, properties=properties,
    )
    fields = {Field.TASK: name, **built.record_fields(store.broker), **per_job, **release}
    return Prepared(NewJob(job_id, shard, due, fields), regenerate is not None, regenerate)


#: The longest tenant name (it is part of a key per shard).
MAX_TENANT_LEN = 200


def check_tenant(tenant: object) -> str:
    """A call's ``tenant`` checked ('' for none).

    Raises:
        InvalidOption: not a non-empty string of at most 200 characters, or ``*``.
    """
    if tenant is None:
        return ""
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_LEN or tenant == "*":
        raise InvalidOption(f"tenant must be a non-empty string of at most {MAX_TENANT_LEN} characters other than "
                            f"'*' (which means every tenant in a rate limit's key), got {tenant!r:.80}")
    return tenant


def _render_fast(
    app: Celery, store: Store, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], job_id: str,
    shard: int, options: dict[str, Any], headers: Mapping[str, Any], task_type: Any, release: Mapping[str, str],
    eta: str | None, eta_from_due: bool = False,
) -> tuple[dict[str, str], dict[str, str], Template] | None:
    """(shared, all) record fields of a compact job, and its template; None when a cached template
    cannot make it (the regular path builds its whole message).

    The shared fields are one object per template and release settings, so
    that :meth:`Store.schedule` sends them once per call.
    """
    keyed = options
    if "root_id" in options or "parent_id" in options:
        keyed = {k: v for k, v in options.items() if k not in ("root_id", "parent_id")}
    max_bytes = store.config.max_payload_bytes
    tmpl = template_for(app, name, keyed, headers, task_type, max_bytes, store.config.key_prefix)
    if tmpl is None:
        return None
    root_id, parent_id = parent_ids(app, options.get("root_id"), options.get("parent_id"))
    own = tmpl.compact_fields(job_id, args, kwargs, root_id, parent_id, eta, eta_from_due)
    if own is None or _too_large(own, max_bytes):
        return None  # the regular path builds it (and raises what it raises)
    common, compact = compact_shared(store, name, tmpl, release)
    return common, common | own, compact


def shared_fields(store: Store, name: str, tmpl: MessageTemplate, release: Mapping[str, str]) -> dict[str, str]:
    """The record fields every job of a template (and release settings) has: one object, cached."""
    rkey = tuple(release.items())
    common = tmpl.records.get(rkey)
    if common is None:
        fields = route_fields(tmpl.route, store.broker)
        del fields[Field.MESSAGE]  # each job's own
        common = {Field.TASK: name, **fields, **release}
        if len(tmpl.records) < 64:
            tmpl.records[rkey] = common
    return common


def compact_shared(store: Store, name: str, tmpl: MessageTemplate,
                   release: Mapping[str, str]) -> tuple[dict[str, str], Template]:
    """The shared record fields of a template's compact jobs (the template id and the release
    fields: one object, cached) and the store's template."""
    rkey = ("compact", tuple(release.items()))
    common = tmpl.records.get(rkey)
    route = shared_fields(store, name, tmpl, {})
    compact = tmpl.compact(route)
    if common is None or common.get(Field.TEMPLATE) != compact.tid:
        common = {Field.TEMPLATE: compact.tid, **release}
        if len(tmpl.records) < 64:
            tmpl.records[rkey] = common
    return common, compact


def _too_large(own: Mapping[str, str], max_bytes: int) -> bool:
    """Whether a compact job may be over ``max_payload_bytes``: then the regular path decides."""
    return sum(len(v) for v in own.values()) > max_bytes // 2


_PLAIN_KEYS = frozenset({"args", "kwargs", "when", "tenant"})
#: the app attribute that keeps :meth:`PlainCalls.cached`'s instances
_PLAIN_ATTR = "_celery_delayed_plain_calls"


class PlainCalls:
    """``prepare`` for the calls of a batch that give only args, kwargs and when.

    Such calls share everything but those (options, routing, release fields,
    the parent task), so that is resolved once per batch, not once per call.
    """

    __slots__ = ("common", "compact", "expires", "name", "parent_id", "root_id", "store", "task", "tmpl", "tz")

    def __init__(self, store: Store, tmpl: MessageTemplate, common: dict[str, str], compact: Template,
                 root_id: Any, parent_id: Any, tz: Any, expires: Any, name: str, task: Any) -> None:
        self.store, self.tmpl, self.common, self.compact, self.tz = store, tmpl, common, compact, tz
        self.root_id, self.parent_id = root_id, parent_id
        self.expires = expires
        self.name, self.task = name, task  # the task's signature checks each call's arguments

    @staticmethod
    def accepts(call: Mapping[str, Any]) -> bool:
        """Whether a call gives only what this fast path handles."""
        return call.keys() <= _PLAIN_KEYS

    @classmethod
    def create(cls, app: Celery, store: Store, name: str, task: Any,
               defaults: Mapping[str, Any]) -> PlainCalls | None:
        """The batch's shared part for ``store``, or None when the calls need the regular path."""
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
        tmpl = template_for(app, name, options, dict(headers), task, store.config.max_payload_bytes,
                            store.config.key_prefix)
        if tmpl is None:
            return None
        root_id, parent_id = parent_ids(app, root_id, parent_id)
        common, compact = compact_shared(store, name, tmpl, release)
        return cls(store, tmpl, common, compact, root_id, parent_id, app.timezone, options.get("expires"),
                   name, task)

    @classmethod
    def cached(cls, app: Celery, store: Store, name: str, task: Any,
               defaults: Mapping[str, Any]) -> PlainCalls | None:
        """:meth:`create`, kept per app, task, process, thread and task defaults (a single call's short path).

        What it holds does not depend on the call; the caller passes each
        call's root and parent ids to :meth:`prepare`. Like the message
        templates it rests on, it follows the task's defaults and ``store``
        (another store gets its own), not later changes to the app's configuration.
        """
        try:
            key = (name, id(task), os.getpid(), app.thread_oid, tuple(defaults.items()),
                   getattr(task, "misfire", None), getattr(task, "max_lateness", None))
            cache: dict[Any, tuple[Store, Any, PlainCalls | None]] = app.__dict__.setdefault(_PLAIN_ATTR, {})
            hit = cache.get(key)
        except TypeError:  # an unhashable default
            return cls.create(app, store, name, task, defaults)
        if hit is not None and hit[0] is store and hit[1] is task:
            return hit[2]
        plain = cls.create(app, store, name, task, defaults)
        if len(cache) >= 256:
            cache.clear()
        cache[key] = (store, task, plain)
        return plain

    def prepare(self, args: Any, kwargs: Any, when: object, ids: tuple[Any, Any] | None = None,
                spread_ms: int = 0, tenant: str | None = None) -> Prepared | None:
        """The job of one call, or None (then the regular path prepares it).

        ``ids``: the call's root and parent ids (default: the batch's).
        ``spread_ms`` and ``tenant``: as :func:`prepare`'s.

        Raises:
            InvalidWhen, InvalidOption: bad input (as :func:`prepare`).
        """
        _check_arguments(self.name, self.task, args, kwargs)
        tn = check_tenant(tenant)
        job_id = fast_uuid4()
        offset = 0
        if spread_ms:
            offset = offset_ms(job_id, spread_ms)
            when = spread_when(when, offset, self.tz)
        due = due_spec(when, self.tz)
        if self.expires is not None:
            check_expiry(self.expires, due)
        shard = shard_for(job_id, self.store.layout.shards)
        from_due = eta_is_due(due, self.tz)
        root_id, parent_id = (self.root_id, self.parent_id) if ids is None else ids
        own = self.tmpl.compact_fields(job_id, args or (), kwargs or {}, root_id, parent_id,
                                       None if from_due else eta_iso(when, self.tz), from_due)
        if own is None or _too_large(own, self.store.config.max_payload_bytes):
            return None
        if spread_ms:
            own[Field.SPREAD] = str(offset)
        if tn:
            own[Field.TENANT] = tn
        return Prepared(NewJob(job_id, shard, due, self.common | own, self.common, self.compact), False)


def refuse_taken(store: Store, jobs: Sequence[NewJob]) -> None:
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
    for job, state in zip(jobs, store.lookup.states(jobs), strict=True):
        if state is not None:
            raise DuplicateJob(job.id, state)
