"""Build the kombu message of a task once, at schedule time.

The release script pushes the stored message onto the broker's list as it is,
so it must be exactly what kombu's Redis transport would have pushed for
``task.apply_async()``: Celery's task protocol 2 headers and body (built by
Celery's own ``amqp.create_task_message``), routed by Celery's router,
serialized and compressed by kombu, wrapped in the envelope of kombu's
virtual channel (``prepare_message`` + ``_inplace_augment_message``): base64
body, ``body_encoding``, a unique ``delivery_tag``, ``delivery_info``. ``eta``
is left empty: the message leaves the store when it is due.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery
from celery._state import _task_stack
from celery.exceptions import QueueNotFound
from celery.utils.functional import maybe_list
from kombu import Exchange, Queue
from kombu.compression import compress, decompress
from kombu.compression import encoders as compression_encoders
from kombu.entity import maybe_delivery_mode
from kombu.exceptions import ContentDisallowed, EncodeError, SerializerNotInstalled
from kombu.serialization import dumps, loads, prepare_accept_content, registry
from kombu.utils.json import dumps as json_dumps

from ..errors import InvalidOption, PayloadTooLarge, SerializationError
from ..store.broker_layout import BrokerLayout, Route
from ..vocab import Field

#: Options ``apply_later`` accepts besides ``args``, ``kwargs`` and ``when`` (and, with
#: ``stamped_headers``, one option per stamp it names, as Celery's stamping passes them).
MESSAGE_OPTIONS = frozenset(
    {
        "queue", "routing_key", "exchange", "exchange_type", "priority", "expires",
        "headers", "serializer", "compression", "delivery_mode", "time_limit",
        "soft_time_limit", "ignore_result", "link", "link_error", "reply_to",
        "root_id", "parent_id", "shadow", "group_id", "group_index", "chord", "chain",
        "stamped_headers", "origin", "replaced_task_nesting",
        # what monitors and the dashboard show instead of the arguments (redaction), as apply_async
        "argsrepr", "kwargsrepr",
    }
)
#: Task attributes that are defaults for the options above (as ``apply_async``,
#: which also sends the task's ``ignore_result``).
_TASK_DEFAULTS = (
    "queue", "routing_key", "exchange", "priority", "expires", "serializer",
    "delivery_mode", "compression", "time_limit", "soft_time_limit", "ignore_result",
)


@dataclass(frozen=True)
class BuiltMessage:
    """A ready-to-push kombu envelope and what the store keeps beside it."""

    body: str  # the JSON envelope kombu's Redis transport LPUSHes
    route: Route
    sent_event: dict[str, Any] | None

    def record_fields(self, broker: BrokerLayout) -> dict[str, str]:
        """The record fields of a job carrying this message (see ``store/records.py``).

        Routing (task name is the caller's), the envelope, and on the direct
        path where the release script pushes it; the task-sent event fields
        when the app sends them.
        """
        return route_fields(self.route, broker, body=self.body, sent_event=self.sent_event)


def route_fields(
    route: Route, broker: BrokerLayout, *, body: str = "", sent_event: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Record fields of a message with this route: q, ex, rk, msg, and lk or bx/ps, ev (empty: absent)."""
    fields = {Field.QUEUE: route.queue, Field.EXCHANGE: route.exchange, Field.ROUTING_KEY: route.routing_key,
              Field.MESSAGE: body, Field.LIST_KEY: "", Field.BINDINGS: "", Field.PRIORITY_SUFFIX: "",
              Field.SENT_EVENT: ""}
    if broker.direct:
        fields.update(broker.destination(route))
    if sent_event is not None:
        fields[Field.SENT_EVENT] = json_dumps(sent_event)
    return fields


def task_defaults(task: Any) -> dict[str, Any]:
    """Return the execution options a task declares (like ``Task._get_exec_options``)."""
    out = {}
    for name in _TASK_DEFAULTS:
        value = getattr(task, name, None)
        if value is not None:
            out[name] = value
    return out


def stamp_names(options: Mapping[str, Any]) -> list[str]:
    """The stamps a call carries: the names its ``stamped_headers`` option lists (Celery's stamping).

    Celery passes each stamp as an option of its own (``stamp=42``) and lists
    the names in ``stamped_headers``; the message gets them as its ``stamps``
    and ``stamped_headers`` headers.

    Raises:
        InvalidOption: ``stamped_headers`` is not a list of names.
    """
    names = options.get("stamped_headers")
    if not names:
        return []
    if isinstance(names, str) or not isinstance(names, (list, tuple)) \
            or not all(isinstance(n, str) and n for n in names):
        raise InvalidOption(f"stamped_headers must be a list of option names, got {names!r}")
    return list(names)


def split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the options a stored message keeps: MESSAGE_OPTIONS and stamps; every other option)."""
    keep = MESSAGE_OPTIONS.union(stamp_names(options))
    kept = {k: v for k, v in options.items() if k in keep}
    return kept, {k: v for k, v in options.items() if k not in keep}


def check_options(options: Mapping[str, Any]) -> None:
    """Raise :class:`InvalidOption` for an option ``apply_later`` does not take, or a bad routing value."""
    unknown = set(options) - MESSAGE_OPTIONS.union(stamp_names(options))
    if not unknown:
        check_option_values(options)
        return
    hints = []
    if unknown & {"eta", "countdown"}:
        hints.append("give the due time as when=")
    raise InvalidOption(
        f"apply_later got unknown option(s) {sorted(unknown)}; it accepts when=, args=, "
        f"kwargs=, task_id=, shard_key=, idempotency_key=, strict=, max_lateness=, misfire=, "
        f"debounce_key= with max_wait=, throttle_key= with window= "
        f"and {sorted(MESSAGE_OPTIONS)}"
        + (f" ({'; '.join(hints)})" if hints else "")
    )


def build_message(
    app: Celery,
    name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    task_id: str,
    options: Mapping[str, Any],
    task_type: Any = None,
    *,
    retries: int = 0,
    max_bytes: int = 1 << 20,
    properties: Mapping[str, Any] | None = None,
) -> BuiltMessage:
    """Build the message ``apply_async`` would send for this task, without an eta.

    ``properties``: more message properties, as Celery passes the options it
    does not know to kombu's ``publish`` (a call's own routing, priority and
    delivery properties win).

    Raises:
        InvalidOption: a queue missing from ``task_queues`` or a bad option value.
        SerializationError: the arguments do not serialize with the serializer.
        PayloadTooLarge: the envelope is larger than ``max_bytes``.
    """
    opts = {k: v for k, v in options.items() if v is not None}
    extra_headers = opts.pop("headers", None) or {}
    _check_containers(args, kwargs, extra_headers)
    protocol = _protocol_options(opts)
    try:
        routed = app.amqp.router.route(opts, name, args, kwargs, task_type)
    except QueueNotFound as exc:
        raise InvalidOption(f"{exc}; declare it in task_queues or enable task_create_missing_queues") from exc
    protocol["root_id"], protocol["parent_id"] = parent_ids(app, protocol["root_id"], protocol["parent_id"])
    headers, props, body, sent_event = _create_task_message(app, name, args, kwargs, task_id, retries, protocol)
    headers.update(extra_headers)
    route = _route(app, routed)
    accepted = prepare_accept_content(app.conf.accept_content)
    content_type, content_encoding, raw = _serialize(app, name, body, headers, routed, accepted)
    if protocol["origin"] is not None:  # send_task hands it to kombu's publish too: a property as well
        props = {"origin": protocol["origin"], **props}
    if properties:
        props = {**properties, **props}
    _set_properties(app, props, route, routed)
    envelope = {
        "body": base64.b64encode(raw).decode("ascii"),
        "content-encoding": content_encoding,
        "content-type": content_type,
        "headers": headers,
        "properties": props,
    }
    try:
        text = json_dumps(envelope)
    except (TypeError, ValueError) as exc:
        raise SerializationError(f"a header or option of {name} is not JSON-serializable: {exc}") from exc
    if len(text) > max_bytes:
        raise PayloadTooLarge(
            f"the message of {name} is {len(text)} bytes, over delayed_max_payload_bytes "
            f"({max_bytes}); store large data elsewhere and pass a reference"
        )
    validate_envelope(text, accepted)
    if sent_event is not None:
        sent_event.update(queue=route.queue, exchange=route.exchange, routing_key=route.routing_key)
    return BuiltMessage(text, route, sent_event)


#: Options that go into the protocol-2 headers rather than the routing.
_PROTOCOL_OPTIONS = (
    "expires", "time_limit", "soft_time_limit", "ignore_result", "link", "link_error", "reply_to",
    "root_id", "parent_id", "shadow", "chain", "chord", "group_id", "group_index", "origin",
    "replaced_task_nesting", "argsrepr", "kwargsrepr",
)


def _check_containers(args: Any, kwargs: Any, headers: Any) -> None:
    if not isinstance(headers, Mapping):
        raise InvalidOption(f"headers must be a mapping, got {type(headers).__name__}")
    if not isinstance(args, (list, tuple)):
        raise InvalidOption(f"args must be a list or tuple, got {type(args).__name__}")
    if not isinstance(kwargs, Mapping):
        raise InvalidOption(f"kwargs must be a mapping, got {type(kwargs).__name__}")


def _protocol_options(opts: dict[str, Any]) -> dict[str, Any]:
    """Pop the options that become protocol headers (stamps too); check the time limits."""
    names = stamp_names(opts)
    protocol = {k: opts.pop(k, None) for k in _PROTOCOL_OPTIONS}
    opts.pop("stamped_headers", None)
    protocol["stamps"] = {n: opts.pop(n, None) for n in names}
    for opt in ("time_limit", "soft_time_limit"):
        limit = protocol[opt]
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                  or not 0 <= limit < float("inf")):
            raise InvalidOption(f"{opt} must be a non-negative number of seconds, got {limit!r}")
    return protocol


def parent_ids(app: Celery, root_id: Any, parent_id: Any) -> tuple[Any, Any]:
    """Inside a task, a new job's root and parent default to the running task's (as ``apply_async``)."""
    if (not root_id or not parent_id) and _task_stack.top is not None:  # .top: cheap "not in a task"
        parent = app.current_worker_task
        if parent is not None:
            root_id = root_id or parent.request.root_id or parent.request.id
            parent_id = parent_id or parent.request.id
    return root_id, parent_id


def _create_task_message(
    app: Celery, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], task_id: str, retries: int,
    p: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], Any, dict[str, Any] | None]:
    """Celery's own protocol-2 headers, properties and body (``amqp.create_task_message``), no eta."""
    stamps = p["stamps"]
    try:
        headers, properties, body, sent_event = app.amqp.create_task_message(
            task_id, name, args, kwargs, None, None, p["group_id"], p["group_index"],
            p["expires"], retries, p["chord"], maybe_list(p["link"]), maybe_list(p["link_error"]),
            p["reply_to"] or app.thread_oid, p["time_limit"], p["soft_time_limit"],
            app.conf.task_send_sent_event, p["root_id"], p["parent_id"], p["shadow"], p["chain"],
            ignore_result=p["ignore_result"], origin=p["origin"],
            replaced_task_nesting=p["replaced_task_nesting"] or 0, argsrepr=p["argsrepr"], kwargsrepr=p["kwargsrepr"],
            **({"stamped_headers": list(stamps), **stamps} if stamps else {}),
        )
    except (TypeError, ValueError) as exc:
        raise InvalidOption(str(exc)) from exc
    return headers, properties, body, sent_event


def _serialize(
    app: Celery, name: str, body: Any, headers: dict[str, Any], routed: Mapping[str, Any], accepted: Any,
) -> tuple[str, str, bytes]:
    """Serialize and compress the body as kombu would: (content type, encoding, raw bytes)."""
    conf = app.conf
    serializer = routed.get("serializer") or conf.task_serializer
    compression = routed.get("compression") or conf.task_compression
    try:
        content_type, content_encoding, data = dumps(body, serializer=serializer)
    except SerializerNotInstalled as exc:
        raise SerializationError(
            f"unknown serializer {serializer!r} for {name}: {exc}; use one of {sorted(registry._encoders)}"
        ) from exc
    except (EncodeError, ContentDisallowed, TypeError, ValueError) as exc:
        raise SerializationError(
            f"the arguments of {name} cannot be serialized with {serializer!r}: {exc}; "
            "pass JSON-compatible values or choose another task serializer"
        ) from exc
    # Workers refuse content types outside accept_content, so such a job could
    # never run: refuse it now (pickle only where the app enables it).
    if accepted and content_type not in accepted:
        raise SerializationError(
            f"serializer {serializer!r} ({content_type}) of {name} is not in accept_content "
            f"{sorted(accepted)}; workers would refuse the message. Use an accepted serializer, "
            "or add it to accept_content if every worker may trust it"
        )
    if compression:
        try:
            data, headers["compression"] = compress(data, compression)
        except KeyError as exc:
            raise InvalidOption(
                f"unknown compression {compression!r}; use one of {sorted(compression_encoders())}"
            ) from exc
    raw = data.encode(content_encoding or "utf-8") if isinstance(data, str) else data
    return content_type, content_encoding, raw


def _set_properties(app: Celery, properties: dict[str, Any], route: Route, routed: Mapping[str, Any]) -> None:
    """The kombu properties of the envelope (``prepare_message`` + the virtual channel's own)."""
    mode = (routed.get("delivery_mode") or _queue_delivery_mode(app.amqp, route)
            or app.conf.task_default_delivery_mode)
    try:
        properties["delivery_mode"] = maybe_delivery_mode(mode)
    except (KeyError, TypeError) as exc:
        raise InvalidOption(
            f"delivery_mode must be 1 or 2, 'transient' or 'persistent', got {mode!r}"
        ) from exc
    properties["delivery_info"] = {"exchange": route.exchange, "routing_key": route.routing_key}
    properties["priority"] = route.priority
    properties["body_encoding"] = "base64"
    properties["delivery_tag"] = str(uuid.uuid4())


_ENVELOPE_KEYS = ("body", "content-encoding", "content-type", "headers", "properties")
_PROPERTY_KEYS = ("correlation_id", "delivery_mode", "delivery_info", "priority", "body_encoding", "delivery_tag")


def validate_envelope(text: str, accept: Any = None) -> None:
    """Check that a worker can consume the envelope, before it is stored.

    A message a worker cannot decode makes it drop the message (or, for a
    malformed envelope, crash its consumer), long after ``apply_later``
    returned. So the stored text is read back as kombu's consumer would:
    JSON, the protocol-2 headers Celery needs, the kombu properties, the
    base64 body, decompressed and deserialized with ``accept``.

    Raises:
        SerializationError: the envelope would not decode on a worker.
    """
    try:
        env = json.loads(text)
        missing = [k for k in _ENVELOPE_KEYS if k not in env]
        missing += [f"headers.{k}" for k in ("id", "task") if not env["headers"].get(k)]
        missing += [f"properties.{k}" for k in _PROPERTY_KEYS if k not in env["properties"]]
        if missing:
            raise ValueError(f"missing {missing}")
        raw = base64.b64decode(env["body"], validate=True)
        if env["headers"].get("compression"):
            raw = decompress(raw, env["headers"]["compression"])
        loads(raw, env["content-type"], env["content-encoding"], accept=accept)
    except Exception as exc:
        raise SerializationError(
            f"the message built for this task would not decode on a worker ({type(exc).__name__}: {exc}); "
            "nothing was stored. Check the task's serializer, compression, headers and accept_content"
        ) from exc


def _queue_delivery_mode(amqp: Any, route: Route) -> Any:
    queue = amqp.queues.get(route.queue)
    return getattr(getattr(queue, "exchange", None), "delivery_mode", None)


def _route(app: Celery, routed: Mapping[str, Any]) -> Route:
    amqp = app.amqp
    queue = routed.get("queue")
    exchange = routed.get("exchange")
    routing_key = routed.get("routing_key")
    exchange_type = routed.get("exchange_type")
    qname = queue
    if queue is None and exchange is None:
        queue = amqp.default_queue
    if queue is not None:
        if isinstance(queue, str):
            qname, queue = queue, amqp.queues[queue]
        else:
            qname = queue.name
    if exchange_type is None:
        exchange_type = getattr(getattr(queue, "exchange", None), "type", None) or "direct"
    if (not exchange or not routing_key) and exchange_type == "direct":
        exchange, routing_key = "", qname
    elif exchange is None:
        qx: Any = queue
        exchange = qx.exchange.name or amqp.default_exchange
        routing_key = routing_key or qx.routing_key or app.conf.task_default_routing_key
    exname = getattr(exchange, "name", exchange) or ""
    priority = routed.get("priority")
    _check_priority(priority)
    return Route(str(qname or ""), str(exname), str(routing_key or ""), str(exchange_type), int(priority or 0))


#: The priorities AMQP allows; kombu's Redis transport maps them onto its priority steps (0-9).
MAX_PRIORITY = 255


def _check_priority(priority: Any) -> None:
    if priority is None:
        return
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY:
        raise InvalidOption(
            f"priority must be an integer from 0 to {MAX_PRIORITY} (the Redis broker uses 0-9; higher values "
            f"count as 9), got {type(priority).__name__} {priority!r}"
        )


def _check_name(option: str, value: Any, kinds: tuple[type, ...]) -> None:
    if value is None or (isinstance(value, kinds) and not isinstance(value, str)):
        return
    if not isinstance(value, str) or not value.strip() or not value.isprintable():
        raise InvalidOption(
            f"{option} must be a non-empty string without control characters, got "
            f"{type(value).__name__} {value!r}"
        )


def check_option_values(options: Mapping[str, Any]) -> None:
    """Raise :class:`InvalidOption` for a routing option of the wrong type or value (as ``apply_async`` needs)."""
    _check_name("queue", options.get("queue"), (Queue,))
    _check_name("exchange", options.get("exchange"), (Exchange,))
    if options.get("routing_key") is not None:
        _check_name("routing_key", options["routing_key"], ())
    if options.get("exchange_type") is not None:
        _check_name("exchange_type", options["exchange_type"], ())
    _check_priority(options.get("priority"))
