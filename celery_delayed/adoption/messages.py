"""What an ETA message in a broker becomes in the store: one job, under the message's own task id.

A broker hands :func:`read` a message as kombu gives it (the Redis
transport's JSON envelope, or an AMQP message's body, headers and
properties); :func:`read` says whether it is to be absorbed (a Celery
protocol-2 task message whose ``eta`` is at least ``min_delay_s`` ahead) and
why not when it is not. :func:`job_of` turns one to absorb into the job
``apply_later`` would have stored for it: the same body bytes, content type
and encoding, every header (``retries``, stamps, ``root_id``/``parent_id``,
``expires``, custom headers) and delivery property kept as they were, the
``eta`` moved into the ``delayed_eta`` header (what the task sees as
``request.eta``) and the job due at that eta. It is routed straight to the
queue it was taken from, so a message an exchange fanned out to several
queues is absorbed once per queue, as it would have run once per queue.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery import Celery
from kombu.utils.json import dumps as json_dumps

from ..errors import InvalidOption
from ..producer.message import route_fields, validate_envelope
from ..producer.misfire import release_fields
from ..producer.prepare import Prepared
from ..store import NewJob, Store
from ..store.broker_layout import Route
from ..timeutil import localize, to_ms
from ..vocab import GENERATION_HEADER, SHARD_HEADER, STORE_HEADER, Field, job_headers

#: AMQP basic properties a task message carries besides its body and headers (kombu's names).
PROPERTIES = ("correlation_id", "reply_to", "delivery_mode", "priority", "user_id", "app_id", "type",
              "message_id", "timestamp")
#: Why a message is left in its queue (the summary counts each).
NO_ETA = "no eta"
DUE = "due or about to be"
NOT_A_TASK = "not a Celery protocol-2 task message"
FROM_THE_STORE = "released from the store already"


@dataclass(frozen=True)
class Envelope:
    """One broker message, as the transports hold it: raw body bytes, headers and properties."""

    body: bytes
    content_type: str
    content_encoding: str
    headers: Mapping[str, Any]
    properties: Mapping[str, Any]

    @classmethod
    def from_redis(cls, raw: str | bytes | Mapping[str, Any]) -> Envelope:
        """A message of kombu's Redis transport (its JSON envelope, base64 body)."""
        from kombu.utils.json import loads

        env = loads(raw) if isinstance(raw, (str, bytes)) else raw
        if not isinstance(env, Mapping) or "body" not in env:
            raise ValueError("not a kombu message envelope")
        props = dict(env.get("properties") or {})
        body = env["body"]
        if props.get("body_encoding") == "base64":
            body = base64.b64decode(body)
        elif isinstance(body, str):
            body = body.encode(env.get("content-encoding") or "utf-8")
        return cls(body, env.get("content-type") or "", env.get("content-encoding") or "",
                   env.get("headers") or {}, props)

    @classmethod
    def from_amqp(cls, message: Any) -> Envelope:
        """A message ``Queue.get()`` returned on an AMQP transport (py-amqp)."""
        props = dict(getattr(message, "properties", None) or {})
        body = message.body
        if isinstance(body, str):
            body = body.encode(message.content_encoding or "utf-8")
        return cls(body, message.content_type or "", message.content_encoding or "", message.headers or {},
                   props)


@dataclass(frozen=True)
class EtaMessage:
    """A task message to absorb: its id, task, due time and the envelope it came in."""

    id: str
    task: str
    eta: datetime
    envelope: Envelope


def read(env: Envelope, now: datetime, min_delay_s: float, tz: Any) -> EtaMessage | str:
    """The message to absorb, or why it stays in its queue (one of the module's reasons)."""
    headers = env.headers
    task_id, task = headers.get("id"), headers.get("task")
    if not isinstance(task_id, str) or not task_id or not isinstance(task, str) or not task:
        return NOT_A_TASK
    if headers.get(SHARD_HEADER) is not None:
        return FROM_THE_STORE  # a look-ahead release: a worker is to run it at its eta
    raw = headers.get("eta")
    if not raw:
        return NO_ETA
    try:
        eta = datetime.fromisoformat(str(raw))
    except ValueError:
        return NO_ETA  # Celery itself would refuse it: not ours to move
    if eta.tzinfo is None or eta.utcoffset() is None:
        eta = localize(eta, tz)  # Celery reads a naive eta in the app's timezone
    if (eta - now).total_seconds() < min_delay_s:
        return DUE
    return EtaMessage(task_id, task, eta, env)


def job_of(app: Celery, store: Store, msg: EtaMessage, queue: str, route: Route | None = None) -> Prepared:
    """The job that holds ``msg`` in ``store``, due at its eta, released into ``queue``.

    ``route``: where to release it instead (kombu's unacked messages, which
    name their exchange and routing key, not their queue).

    Raises:
        InvalidOption, SerializationError, PayloadTooLarge: a message the store cannot hold.
    """
    env = msg.envelope
    shard = store.layout.shard_of(msg.id)
    headers = {k: v for k, v in env.headers.items() if k not in (SHARD_HEADER, STORE_HEADER, GENERATION_HEADER)}
    headers["eta"] = None  # it leaves the store when due; the task still sees its eta (delayed_eta)
    headers.update(job_headers(shard, store.config.key_prefix, msg.eta.isoformat()))
    priority = _priority(env.properties.get("priority"))
    if route is None:
        route = Route(queue, "", queue, "direct", priority)
    info = env.properties.get("delivery_info") or {}
    props = {k: env.properties[k] for k in PROPERTIES if env.properties.get(k) is not None}
    props.update(
        priority=priority,
        body_encoding="base64",
        delivery_tag=str(uuid.uuid4()),
        # what the worker's request shows (Task.retry routes by it): where the message was sent
        delivery_info={"exchange": info.get("exchange", route.exchange) or "",
                       "routing_key": info.get("routing_key", route.routing_key) or route.routing_key},
    )
    envelope = {
        "body": base64.b64encode(env.body).decode("ascii"),
        "content-encoding": env.content_encoding,
        "content-type": env.content_type,
        "headers": headers,
        "properties": props,
    }
    text = json_dumps(envelope)
    max_bytes = store.config.max_payload_bytes
    if len(text) > max_bytes:
        from ..errors import PayloadTooLarge

        raise PayloadTooLarge(f"the message of {msg.task}[{msg.id}] is {len(text)} bytes, over "
                              f"delayed_max_payload_bytes ({max_bytes}); raise it to absorb this message")
    validate_envelope(text)
    options: dict[str, Any] = {}
    expires = _expires(headers.get("expires"), app.timezone)
    if expires is not None:
        options["expires"] = expires
    fields = {
        Field.TASK: msg.task,
        **route_fields(route, store.broker, body=text),
        Field.SHARD_KEY: "",
        Field.IDEMPOTENCY_KEY: "",
        **release_fields(options, app.tasks.get(msg.task), store.config),
    }
    return Prepared(NewJob(msg.id, shard, str(to_ms(msg.eta.astimezone(timezone.utc))), fields), idempotent=False)


def _expires(value: Any, tz: Any) -> datetime | None:
    """The ``expires`` header (ISO 8601, as Celery writes it) as an aware datetime, or None."""
    if not value:
        return None
    try:
        when = datetime.fromisoformat(str(value))
    except ValueError:
        return None  # the worker reads it as Celery does; the store keeps no expiry of its own
    return when if when.tzinfo is not None and when.utcoffset() is not None else localize(when, tz)


def _priority(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise InvalidOption(f"the message's priority {value!r} is not an AMQP priority (0-255)")
    return value
