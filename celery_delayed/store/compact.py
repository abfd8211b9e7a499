"""Compact job records: a pending job stores what differs per job; the rest of its message is shared.

A Celery message for one task with one set of options is the same from job to
job except for the ids, ``argsrepr``/``kwargsrepr``, the arguments, the
``delayed_eta``/``eta`` headers, the shard header and the delivery tag. A
compact record holds only those (fields below) and the id of a
:class:`Template` stored once per shard (``{p}:{s}:tpl:<id>``, a JSON string):
the envelope cut at those places, the base64 tail of the body, and the routing
fields every job of the template shares (task, queue, exchange, routing key,
list key ...). The release script joins them (``lua/includes/compact.lua``);
:func:`render` here is its twin, byte for byte, for the Python readers
(``Store.message``, the database rows).

Per-job fields (all JSON text as it goes into the envelope, short enough for
Redis to keep the record a listpack):

====  =====================================================================
tp    the template id
a     argsrepr (a JSON string)
k     kwargsrepr (absent: ``"{}"``)
b     base64 of the body's head, ``[<args>, <kwargs>`` padded with spaces to
      a multiple of 3 bytes, so that the template's base64 tail can follow it
e     the ``delayed_eta`` header as JSON (absent: the due time, see below)
i     the id as a JSON string, when quoting changes it (absent: ``"<id>"``)
r     root_id (absent: the id), pa: parent_id (absent: null)
tg    set at release: the delivery tag's suffix (the tag is ``"<id>.<tg>"``),
      so that the reconciler can find the released copy in kombu's unacked hash
====  =====================================================================

The body differs from Celery's own by the padding (up to two spaces before the
comma that precedes the embedded options): the JSON a worker decodes is the same.

Template version 2 (what this version writes) leaves ``e`` out when the
``delayed_eta`` header is the job's due time by the store's clock, as the
scripts that move a job write it (``iso_utc``: a ``when`` given as a delay,
in an app whose timezone is UTC): the header is rendered from the record's
``due``, and a null header is stored as ``e`` = ``null``. Version 1 records
(no ``e``: null) are rendered as before. With the template id a decimal
integer (which Redis stores as an integer in the record's listpack), a
pending job's record fits a smaller allocation: 32 bytes less per job.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..vocab import Field

#: The slots of a template, in the names the Lua include uses.
SLOTS = ("id", "root", "parent", "argsrepr", "kwargsrepr", "shard", "tag", "body", "eta", "ceta")
#: The per-job record fields of a compact job (besides st, due, created and the release fields).
FIELDS = (Field.TEMPLATE, Field.C_ARGSREPR, Field.C_KWARGSREPR, Field.C_BODY, Field.C_ETA, Field.C_ID, Field.C_ROOT,
          Field.C_PARENT)
#: The routing fields a template holds for its jobs (the record fields of a full job).
ROUTE_FIELDS = (Field.TASK, Field.QUEUE, Field.EXCHANGE, Field.ROUTING_KEY, Field.LIST_KEY, Field.BINDINGS,
                Field.PRIORITY_SUFFIX)
#: The template version this code writes (see the module docstring).
VERSION = 2


@dataclass(frozen=True)
class Template:
    """The shared part of the messages of one task and option set (see the module docstring)."""

    parts: tuple[str, ...]
    order: tuple[str, ...]  # the slot after each part but the last
    tail64: str  # base64 of the body's tail
    route: tuple[tuple[str, str], ...]  # (field, value) of ROUTE_FIELDS, non-empty ones
    version: int = VERSION  # 1: a record without ``e`` has a null delayed_eta; 2: its due time

    @functools.cached_property
    def text(self) -> str:
        """The JSON stored in Redis."""
        return json.dumps({"v": self.version, "p": list(self.parts), "o": list(self.order), "t": self.tail64,
                           "r": dict(self.route)}, separators=(",", ":"), ensure_ascii=False)

    @functools.cached_property
    def tid(self) -> str:
        """The template's id: a digest of its text (a changed template is another template).

        A decimal integer below 2**60 (a record's listpack stores it as an integer).
        """
        return str(int(hashlib.sha1(self.text.encode("utf-8")).hexdigest()[:15], 16))

    @functools.cached_property
    def fields(self) -> dict[str, str]:
        """The routing fields of its jobs (task, q, ex, rk, and lk or bx/ps)."""
        return dict(self.route)

    @classmethod
    def from_text(cls, text: str) -> Template:
        """The template stored in Redis as ``text``."""
        d = json.loads(text)
        return cls(tuple(d["p"]), tuple(d["o"]), str(d["t"]), tuple(sorted(d["r"].items())), int(d.get("v", 1)))


def quote(s: str) -> str:
    """A JSON string as the template's envelope writes it (kombu's json: ASCII, Python's escapes)."""
    return json.dumps(s)


def body_head64(args_json: str, kwargs_json: str) -> str:
    """Field ``b``: base64 of ``[<args>, <kwargs>`` padded with spaces to a multiple of 3 bytes."""
    head = ("[" + args_json + ", " + kwargs_json).encode("utf-8")
    head += b" " * (-len(head) % 3)
    return base64.b64encode(head).decode("ascii")


def job_fields(job_id: str, argsrepr_q: str, kwargsrepr_q: str, head64: str, eta_q: str | None,
               root_id: str | None, parent_id: str | None) -> dict[str, str]:
    """The per-job fields of a compact record of a version 2 template (template id excluded), empty ones left out.

    ``eta_q``: the ``delayed_eta`` header as JSON (``null`` included), or
    None for the due time (:func:`iso_utc` of the record's ``due``).
    """
    qid = quote(job_id)
    out = {"a": argsrepr_q, "b": head64}
    if kwargs_default(kwargsrepr_q) is None:
        out["k"] = kwargsrepr_q
    if eta_q is not None:
        out["e"] = eta_q
    if qid != '"' + job_id + '"':
        out["i"] = qid
    if root_id is not None and root_id != job_id:
        out["r"] = quote(root_id)
    if parent_id is not None:
        out["pa"] = quote(parent_id)
    return out


def kwargs_default(kwargsrepr_q: str) -> str | None:
    """``'"{}"'`` when the kwargsrepr is the default one (then field ``k`` is left out)."""
    return kwargsrepr_q if kwargsrepr_q == '"{}"' else None


def render(t: Template, job_id: str, shard: int, rec: Mapping[str, str], tag: str,
           celery_eta: str | None = None) -> str:
    """The message of a compact record: what ``lua/includes/compact.lua`` pushes, byte for byte.

    ``tag`` is the delivery tag's suffix (``tg``); ``celery_eta`` the value of
    Celery's ``eta`` header as JSON (a look-ahead release), else null. A
    version 2 record without ``e`` needs its ``due``.
    """
    qid = rec.get("i") or '"' + job_id + '"'
    eta = rec.get("e")
    if eta is None:
        eta = '"' + iso_utc(int(rec["due"])) + '"' if t.version >= 2 else "null"
    values = {
        "id": qid,
        "root": rec.get("r") or qid,
        "parent": rec.get("pa") or "null",
        "argsrepr": rec.get("a", '""'),
        "kwargsrepr": rec.get("k") or '"{}"',
        "shard": str(shard),
        "tag": qid[:-1] + "." + tag + '"',
        "body": '"' + rec.get("b", "") + t.tail64 + '"',
        "eta": eta,
        "ceta": celery_eta or "null",
    }
    out = [t.parts[0]]
    for i, slot in enumerate(t.order, 1):
        out.append(values[slot])
        out.append(t.parts[i])
    return "".join(out)


def iso_utc(ms: int) -> str:
    """Epoch ms as ``lua/includes/eta.lua`` writes it: ISO 8601 in UTC, with microseconds (ms * 1000)."""
    s, frac = divmod(ms, 1000)
    return f"{datetime.fromtimestamp(s, tz=timezone.utc):%Y-%m-%dT%H:%M:%S}.{frac:03d}000+00:00"


def fast_uuid4() -> str:
    """A random (version 4) UUID string, as ``str(uuid.uuid4())`` but cheaper."""
    h = os.urandom(16).hex()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_HEX_VARIANT[h[16]]}{h[17:20]}-{h[20:]}"


_HEX_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}


def make_template(parts: Sequence[str], order: Sequence[str], tail: str, route: Mapping[str, Any]) -> Template:
    """A template from an envelope cut at its slots, the body's tail (text) and the routing fields."""
    tail64 = base64.b64encode(tail.encode("utf-8")).decode("ascii")
    kept = tuple(sorted((k, str(v)) for k, v in route.items() if k in ROUTE_FIELDS and v not in (None, "")))
    return Template(tuple(parts), tuple(order), tail64, kept)
