"""A fast path for :func:`~celery_delayed.producer.message.build_message`: envelope templates.

Building a message through Celery (router, ``create_task_message``,
``saferepr``, kombu serialization, the envelope JSON) costs far more than
storing it. For one task with one set of options, almost all of the envelope
is the same from call to call: only the task id, root and parent ids,
``argsrepr``/``kwargsrepr``, the ``delayed_shard`` and ``delayed_eta``
headers, the ``delivery_tag`` and the body change. A :class:`MessageTemplate`
is the envelope text that ``build_message`` produced once, cut at those
places; rendering it joins the constant parts with the per-call values,
encoded exactly as Celery and kombu encode them. (The store keeps its own
:class:`~celery_delayed.store.compact.Template`, made from this one, for
compact records.)

A template is made only when the result cannot depend on anything but the
cached key (JSON serializer, no compression, no task-sent events, routers
that look at the task name only, no relative ``expires``, no signatures),
and it is checked once against ``build_message`` before it is used: any
difference and the call takes the regular path. (``build_message`` also
reads its envelope back as a worker would; a rendered envelope differs from
a checked one only by JSON-encoded strings and the JSON body, so it needs no
second check.) Rendering returns None for
arguments it cannot encode the same way (then the regular path runs and
raises the regular errors).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

from celery import Celery
from celery.app.routes import MapRoute
from celery.utils.saferepr import saferepr
from kombu.serialization import registry
from kombu.utils.json import JSONEncoder
from kombu.utils.json import dumps as kombu_json_dumps

from ..store.broker_layout import Route
from ..store.compact import Template, body_head64, fast_uuid4, job_fields, make_template
from ..vocab import job_headers
from .message import build_message

# Options whose value is fixed per template (part of the cache key). Any other
# option (link, chain, chord, ...) sends the call down the regular path.
_KEYED = frozenset(
    {
        "queue", "routing_key", "exchange", "exchange_type", "priority", "expires",
        "serializer", "compression", "delivery_mode", "time_limit", "soft_time_limit",
        "ignore_result", "reply_to", "shadow", "group_id", "group_index",
    }
)
_PER_CALL = frozenset({"root_id", "parent_id", "headers"})
# Placeholders: ASCII words that no real value contains.
_TOKENS = {
    "id": "@@cd-id-9f1c@@", "root": "@@cd-root-9f1c@@", "parent": "@@cd-parent-9f1c@@",
    "argsrepr": "@@cd-argsrepr-9f1c@@", "kwargsrepr": "@@cd-kwargsrepr-9f1c@@",
    "shard": "@@cd-shard-9f1c@@", "tag": "@@cd-tag-9f1c@@", "body": "@@cd-body-9f1c@@",
    "eta": "@@cd-eta-9f1c@@", "ceta": "@@cd-ceta-9f1c@@",
}
_EXPECTED = {"id": 2, "root": 1, "parent": 1, "argsrepr": 1, "kwargsrepr": 1, "shard": 1, "tag": 1, "body": 1,
             "eta": 1, "ceta": 1}
_NAMES = tuple(_TOKENS)
_SLOT = {name: i for i, name in enumerate(_TOKENS)}
_ENCODE = JSONEncoder().encode  # what kombu's json dumps does, without its per-call set-up
_quote = encode_basestring_ascii  # the same for a str, without the encoder's dispatch
_SIMPLE = (int, float, bool, type(None))
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_EMBED_TAIL = ", " + _ENCODE(_EMBED) + "]"
_ATTR = "_celery_delayed_templates"


def _plain_str(s: str) -> bool:
    # saferepr() writes these exactly as repr() does; quotes, backslashes and
    # non-ASCII text it writes differently.
    return s.isascii() and s.isprintable() and "'" not in s and "\\" not in s


def _simple(v: Any) -> bool:
    t = type(v)
    return t in _SIMPLE or (t is str and _plain_str(v))


def fast_repr(value: Any, maxsize: int) -> str | None:
    """``saferepr(value, maxsize)`` for a flat tuple/list/dict of plain scalars, else None."""
    t = type(value)
    if t is tuple or t is list:
        if not all(_simple(v) for v in value):
            return None
    elif t is dict:
        for k, v in value.items():
            if type(k) is not str or not _plain_str(k) or not _simple(v):
                return None
    else:
        return None
    text = repr(value)
    return text if len(text) < maxsize else None


class MessageTemplate:
    """The envelope of one (task, options) pair with slots for the per-call values."""

    __slots__ = ("argsrepr_maxsize", "compacts", "kwargsrepr_maxsize", "maxlevels", "order", "parts", "records",
                 "route")

    def __init__(self, parts: list[str], order: list[int], route: Route, amqp: Any, maxlevels: int) -> None:
        self.parts = parts
        self.order = order
        self.route = route
        self.argsrepr_maxsize = int(amqp.argsrepr_maxsize)
        self.kwargsrepr_maxsize = int(amqp.kwargsrepr_maxsize)
        self.maxlevels = maxlevels
        #: the caller's cache of the record fields its jobs share (task, queue, destination)
        self.records: dict[Any, dict[str, str]] = {}
        #: the store's compact template of these messages, per set of routing fields
        self.compacts: dict[Any, Template] = {}

    def compact(self, route_fields: Mapping[str, str]) -> Template:
        """The store's template of these messages (``store/compact.py``), with their routing fields."""
        key = tuple(sorted(route_fields.items()))
        t = self.compacts.get(key)
        if t is None:
            t = make_template(self.parts, [_NAMES[i] for i in self.order], _EMBED_TAIL, route_fields)
            if len(self.compacts) < 64:
                self.compacts[key] = t
        return t

    def _reprs(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[str, str]:
        ar = fast_repr(args, self.argsrepr_maxsize)
        if ar is None:
            ar = saferepr(args, self.argsrepr_maxsize, maxlevels=self.maxlevels)
        kr = fast_repr(kwargs, self.kwargsrepr_maxsize) if kwargs else "{}"
        if kr is None:
            kr = saferepr(kwargs, self.kwargsrepr_maxsize, maxlevels=self.maxlevels)
        return ar, kr

    def compact_fields(
        self, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any], root_id: str | None,
        parent_id: str | None, eta: str | None = None, eta_from_due: bool = False,
    ) -> dict[str, str] | None:
        """The per-job fields of a compact record (``store/compact.py``), or None (the regular path).

        ``eta_from_due``: the ``delayed_eta`` header is the job's due time by the store's clock (no ``e``
        field: the template renders it from ``due``), instead of ``eta``.
        """
        if type(args) not in (tuple, list) or type(kwargs) is not dict:
            return None
        if not args:
            args = ()
        try:
            head = body_head64(_ENCODE(args), _ENCODE(kwargs) if kwargs else "{}")
        except (TypeError, ValueError):
            return None
        ar, kr = self._reprs(args, kwargs)
        eta_q = None if eta_from_due else "null" if eta is None else _quote(eta)
        return job_fields(task_id, _quote(ar), _quote(kr), head, eta_q, root_id, parent_id)

    def render(
        self, task_id: str, shard: int, args: Sequence[Any], kwargs: Mapping[str, Any],
        root_id: str | None, parent_id: str | None, tag: str | None = None, eta: str | None = None,
    ) -> str | None:
        """The envelope text for one call, or None when the regular path must build it."""
        if type(args) not in (tuple, list) or type(kwargs) is not dict:
            return None
        if not args:
            args = ()  # as Celery's ``args or ()``: an empty list is written as "()"
        try:  # what encoding (args, kwargs, _EMBED) gives, with the constant part encoded once
            body = "[" + _ENCODE(args) + ", " + (_ENCODE(kwargs) if kwargs else "{}") + _EMBED_TAIL
        except (TypeError, ValueError):
            return None
        ar, kr = self._reprs(args, kwargs)
        values = (
            _quote(task_id), _quote(root_id or task_id), "null" if parent_id is None else _quote(parent_id),
            _quote(ar), _quote(kr), str(shard), _quote(tag or fast_uuid4()),
            '"' + base64.b64encode(body.encode("utf-8")).decode("ascii") + '"',
            "null" if eta is None else _quote(eta), "null",
        )
        parts = self.parts
        out = [parts[0]]
        for i, slot in enumerate(self.order, 1):
            out.append(values[slot])
            out.append(parts[i])
        return "".join(out)


def _eligible(app: Celery) -> bool:
    conf = app.conf
    if conf.task_send_sent_event or conf.task_protocol != 2:
        return False
    codec = registry._encoders.get("json")
    if codec is None or codec.encoder is not kombu_json_dumps:
        return False
    return all(isinstance(r, MapRoute) for r in app.amqp.router.routes)


def _make(app: Celery, name: str, options: Mapping[str, Any], headers: Mapping[str, Any],
          task_type: Any, max_bytes: int, key_prefix: str) -> MessageTemplate | None:
    """Build the template from one real message (and check it against another)."""
    if not _eligible(app):
        return None
    opts = dict(options)
    opts["headers"] = {**headers, **job_headers(_TOKENS["shard"], key_prefix, _TOKENS["eta"])}
    opts["root_id"], opts["parent_id"] = _TOKENS["root"], _TOKENS["parent"]
    built = build_message(app, name, (), {}, _TOKENS["id"], opts, task_type, max_bytes=max_bytes)
    if built.sent_event is not None:
        return None
    env = json.loads(built.body)
    if env.get("content-type") != "application/json" or "compression" in env["headers"]:
        return None
    if env["headers"].get("eta", 0) is not None:
        return None  # Celery's eta header must be null here: a look-ahead release sets it
    env["headers"]["argsrepr"], env["headers"]["kwargsrepr"] = _TOKENS["argsrepr"], _TOKENS["kwargsrepr"]
    env["headers"]["eta"] = _TOKENS["ceta"]
    env["properties"]["delivery_tag"] = _TOKENS["tag"]
    env["body"] = _TOKENS["body"]
    text = kombu_json_dumps(env)
    quoted = {name: _ENCODE(tok) for name, tok in _TOKENS.items()}
    for slot, q in quoted.items():
        if text.count(q) != _EXPECTED[slot]:
            return None
    parts, order = _cut(text, quoted)
    # task_repr_maxlevels is new in Celery 5.7; before it, saferepr's own default (3) applied
    tmpl = MessageTemplate(parts, order, built.route, app.amqp, app.conf.get("task_repr_maxlevels", 3))
    if not _check(app, tmpl, name, options, headers, task_type, max_bytes, key_prefix):
        return None
    return tmpl


def _cut(text: str, quoted: Mapping[str, str]) -> tuple[list[str], list[int]]:
    """Split ``text`` at every quoted token; return the pieces and the slot of each gap."""
    hits: list[tuple[int, int, int]] = []
    for name, q in quoted.items():
        start = 0
        while (at := text.find(q, start)) >= 0:
            hits.append((at, len(q), _SLOT[name]))
            start = at + len(q)
    hits.sort()
    parts: list[str] = []
    order: list[int] = []
    pos = 0
    for at, n, slot in hits:
        parts.append(text[pos:at])
        order.append(slot)
        pos = at + n
    parts.append(text[pos:])
    return parts, order


def _check(app: Celery, tmpl: MessageTemplate, name: str, options: Mapping[str, Any],
           headers: Mapping[str, Any], task_type: Any, max_bytes: int, key_prefix: str) -> bool:
    """Render a sample call and compare it with what ``build_message`` makes of it."""
    args, kwargs = (1, "a", None, 2.5), {"k": [1, "é"]}
    opts = dict(options)
    eta = "2030-01-02T03:04:05.678901+00:00"
    opts["headers"] = {**headers, **job_headers(3, key_prefix, eta)}
    opts["root_id"], opts["parent_id"] = "root-sample", "parent-sample"
    ref = build_message(app, name, args, kwargs, "id-sample", opts, task_type, max_bytes=max_bytes)
    tag = json.loads(ref.body)["properties"]["delivery_tag"]
    got = tmpl.render("id-sample", 3, args, kwargs, "root-sample", "parent-sample", tag, eta)
    return got == ref.body and tmpl.route == ref.route


def template_for(
    app: Celery, name: str, options: Mapping[str, Any], headers: Mapping[str, Any],
    task_type: Any, max_bytes: int, key_prefix: str,
) -> MessageTemplate | None:
    """The cached template for this task and these options, or None (use ``build_message``).

    ``max_bytes`` and ``key_prefix`` are the store's ``max_payload_bytes``
    and key prefix (the prefix is in every message's headers).
    """
    if not options.keys() <= _KEYED:
        return None
    exp = options.get("expires")
    if exp is not None and not isinstance(exp, str) and isinstance(exp, (int, float)):
        return None  # relative expiry: computed from the clock at every call
    try:
        # the store's prefix is in every message's headers (the testing kit gives an app a store of its own)
        key: tuple[Any, ...] = (name, id(task_type), os.getpid(), app.thread_oid, max_bytes, key_prefix)
        if options or headers:
            key += (tuple(sorted(options.items())), tuple(sorted(headers.items())))
        cache: dict[Any, MessageTemplate | None] = app.__dict__.setdefault(_ATTR, {})
        return cache[key]
    except KeyError:
        pass
    except TypeError:
        return None  # an unhashable option value
    tmpl = _make(app, name, options, headers, task_type, max_bytes, key_prefix)
    if len(cache) < 1024:
        cache[key] = tmpl
    return tmpl
