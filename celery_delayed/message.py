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
from bisect import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery
from celery.exceptions import QueueNotFound
from celery.utils.functional import maybe_list
from kombu.compression import compress, decompress
from kombu.compression import encoders as compression_encoders
from kombu.entity import maybe_delivery_mode
from kombu.exceptions import ContentDisallowed, EncodeError, SerializerNotInstalled
from kombu.serialization import dumps, loads, prepare_accept_content, registry
from kombu.utils.json import dumps as json_dumps

from .errors import InvalidOption, PayloadTooLarge, SerializationError

#: Options ``apply_later`` accepts besides ``args``, ``kwargs`` and ``when``.
MESSAGE_OPTIONS = frozenset(
    {
        "queue", "routing_key", "exchange", "exchange_type", "priority", "expires",
        "headers", "serializer", "compression", "delivery_mode", "time_limit",
        "soft_time_limit", "ignore_result", "link", "link_error", "reply_to",
        "root_id", "parent_id", "shadow", "group_id", "group_index", "chord", "chain",
    }
)
#: Task attributes that are defaults for the options above (as ``apply_async``,
#: which also sends the task's ``ignore_result``).
_TASK_DEFAULTS = (
    "queue", "routing_key", "exchange", "priority", "expires", "serializer",
    "delivery_mode", "compression", "time_limit", "soft_time_limit", "ignore_result",
)
_SEP = "\x06\x16"  # kombu.transport.redis.Channel.sep
_BINDING = "_kombu.binding.%s"  # kombu.transport.redis.Channel.keyprefix_queue


@dataclass(frozen=True)
class Route:
    """Where a message goes, resolved as Celery's ``send_task_message`` does."""

    queue: str
    exchange: str
    routing_key: str
    exchange_type: str
    priority: int


@dataclass(frozen=True)
class BuiltMessage:
    """A ready-to-push kombu envelope and what the store keeps beside it."""

    body: str  # the JSON envelope kombu's Redis transport LPUSHes
    route: Route
    sent_event: dict[str, Any] | None

    def destination(self, conf: Any) -> dict[str, str]:
        """Record fields telling the release script where to push (direct path).

        ``lk``: the list key for the anonymous exchange (kombu's ``_put``:
        ``global_keyprefix + queue``, plus ``sep + step`` for a priority above
        the lowest step). For a named direct exchange, ``bx`` (its binding
        set), ``rk`` and ``ps``: the script pushes to each bound queue whose
        routing key matches, as kombu's ``DirectExchange`` does.
        """
        opts = conf.broker_transport_options or {}
        gkp = opts.get("global_keyprefix", "") or ""
        steps = list(opts.get("priority_steps", [0, 3, 6, 9]))
        pri = steps[bisect(steps, self.route.priority) - 1]
        ps = f"{_SEP}{pri}" if pri else ""
        if not self.route.exchange:
            return {"lk": f"{gkp}{self.route.routing_key or self.route.queue}{ps}"}
        if self.route.exchange_type != "direct":
            raise InvalidOption(
                f"exchange {self.route.exchange!r} is a {self.route.exchange_type} exchange; "
                "the direct release path handles direct exchanges only: set "
                "delayed_release_mode = 'publish' to publish through kombu"
            )
        return {"bx": gkp + _BINDING % self.route.exchange, "rk": self.route.routing_key, "ps": ps}


def task_defaults(task: Any) -> dict[str, Any]:
    """Return the execution options a task declares (like ``Task._get_exec_options``)."""
    out = {}
    for name in _TASK_DEFAULTS:
        value = getattr(task, name, None)
        if value is not None:
            out[name] = value
    return out


def check_options(options: Mapping[str, Any]) -> None:
    """Raise :class:`InvalidOption` for an option ``apply_later`` does not take."""
    unknown = set(options) - MESSAGE_OPTIONS
    if not unknown:
        return
    hints = []
    if unknown & {"eta", "countdown"}:
        hints.append("give the due time as when=")
    raise InvalidOption(
        f"apply_later got unknown option(s) {sorted(unknown)}; it accepts when=, args=, "
        f"kwargs=, task_id=, shard_key= and {sorted(MESSAGE_OPTIONS)}"
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
) -> BuiltMessage:
    """Build the message ``apply_async`` would send for this task, without an eta.

    Raises:
        InvalidOption: a queue missing from ``task_queues`` or a bad option value.
        SerializationError: the arguments do not serialize with the serializer.
        PayloadTooLarge: the envelope is larger than ``max_bytes``.
    """
    conf = app.conf
    amqp = app.amqp
    opts = {k: v for k, v in options.items() if v is not None}
    extra_headers = opts.pop("headers", None) or {}
    if not isinstance(extra_headers, Mapping):
        raise InvalidOption(f"headers must be a mapping, got {type(extra_headers).__name__}")
    if not isinstance(args, (list, tuple)):
        raise InvalidOption(f"args must be a list or tuple, got {type(args).__name__}")
    if not isinstance(kwargs, Mapping):
        raise InvalidOption(f"kwargs must be a mapping, got {type(kwargs).__name__}")
    expires = opts.pop("expires", None)
    time_limit = opts.pop("time_limit", None)
    soft_time_limit = opts.pop("soft_time_limit", None)
    for opt, limit in (("time_limit", time_limit), ("soft_time_limit", soft_time_limit)):
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                  or not 0 <= limit < float("inf")):
            raise InvalidOption(f"{opt} must be a non-negative number of seconds, got {limit!r}")
    ignore_result = opts.pop("ignore_result", None)
    link, link_error = opts.pop("link", None), opts.pop("link_error", None)
    reply_to = opts.pop("reply_to", None)
    root_id, parent_id = opts.pop("root_id", None), opts.pop("parent_id", None)
    shadow, chain, chord = opts.pop("shadow", None), opts.pop("chain", None), opts.pop("chord", None)
    group_id, group_index = opts.pop("group_id", None), opts.pop("group_index", None)
    try:
        routed = amqp.router.route(opts, name, args, kwargs, task_type)
    except QueueNotFound as exc:
        raise InvalidOption(f"{exc}; declare it in task_queues or enable task_create_missing_queues") from exc
    if not root_id or not parent_id:
        parent = app.current_worker_task
        if parent is not None:
            root_id = root_id or parent.request.root_id or parent.request.id
            parent_id = parent_id or parent.request.id
    try:
        headers, properties, body, sent_event = amqp.create_task_message(
            task_id, name, args, kwargs, None, None, group_id, group_index,
            expires, retries, chord, maybe_list(link), maybe_list(link_error),
            reply_to or app.thread_oid, time_limit, soft_time_limit,
            conf.task_send_sent_event, root_id, parent_id, shadow, chain,
            ignore_result=ignore_result,
        )
    except (TypeError, ValueError) as exc:
        raise InvalidOption(str(exc)) from exc
    headers.update(extra_headers)
    route = _route(app, routed)
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
    accepted = prepare_accept_content(conf.accept_content)
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
    mode = routed.get("delivery_mode") or _queue_delivery_mode(amqp, route) or conf.task_default_delivery_mode
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
    raw = data.encode(content_encoding or "utf-8") if isinstance(data, str) else data
    envelope = {
        "body": base64.b64encode(raw).decode("ascii"),
        "content-encoding": content_encoding,
        "content-type": content_type,
        "headers": headers,
        "properties": properties,
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
    try:
        pri = max(min(int(priority or 0), 9), 0)
    except (TypeError, ValueError) as exc:
        raise InvalidOption(f"priority must be an integer 0-9, got {priority!r}") from exc
    return Route(str(qname or ""), str(exname), str(routing_key or ""), str(exchange_type), pri)
