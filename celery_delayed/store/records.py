"""The job record and the values the gateway passes in and out.

A job record (``{p}:{s}:job:<id>``, a Redis hash; field names in
:class:`celery_delayed.vocab.Field`) holds:

=========  ==============================================================
st         the state (:class:`celery_delayed.vocab.JobState`)
due        due time, epoch ms
created    when it was scheduled, epoch ms (Redis clock)
released   when it was pushed or published, epoch ms
cancelled  when it was cancelled, epoch ms
task       task name
q, ex, rk  queue, exchange and routing key
msg        the kombu envelope, until the job starts (the reconciler sends it
           again if the broker loses it)
lk         direct path: the list key to push to (anonymous exchange)
bx, ps     direct path, named exchange: its binding set, priority suffix
ev         the task-sent event fields (JSON) when the app sends them
sk         the shard key, when one was given
ik         the idempotency key, when one was given
claims     publish path: how many times it was claimed
refused    publish path: how many times the broker refused its message
rr         how many times the reconciler sent it again (its message was lost)
ob         '1': indexed at a SQLAlchemy Core connection's commit, before the commit
           completed (the reconciler drops it if its row never appears)
exp        Celery's ``expires``, epoch ms: not sent when released at or after it
ml, mf     max lateness (ms) and misfire policy ('skip' or 'dead'; absent =
           run anyway), checked at release (``producer/misfire.py``)
reason     why it was not sent or did not finish (EXPIRED, SKIPPED, DEAD ...)
att        executions begun (start.lua increments it; 1 = the first run)
lo, lu     execution lease of a RUNNING job: owner token
           ("<hostname>|<pid>|<delivery tag>|<nonce>") and deadline, epoch ms;
           the worker's heartbeat (extend_lease.lua) pushes the deadline on
started    when the latest execution began, epoch ms
wk         hostname of the worker that ran it last
finished   when it SUCCEEDED / FAILED / was EXPIRED or SKIPPED, epoch ms
retries    retries scheduled (the ``retries`` header of its message; retry.lua)
first_at,  when the first and the latest failed attempt began, epoch ms
last_at
etype,     the last failure: exception type (module.Class), message, and (FAILED
emsg, tb   / DEAD only) traceback
host       hostname of the worker where it last failed
delay      the backoff delay of the pending retry, ms
died       when it was dead-lettered, epoch ms (DEAD; indexed in the dlq set)
args,      DEAD: the arguments (saferepr), and the attempts made
kwargs,
attempts
requeued,  how often it was requeued from the dead-letter queue, and when last
requeued_at
gen        the generation of a job scheduled again with an idempotency key
           after a cancel (absent = 0); its messages carry it as the
           ``delayed_gen`` header, and start.lua refuses older ones
dk         '1': the job of a debounce key; released when it is due, never
           ``delayed_lookahead_ms`` early, so a later call can still replace it
spr        the offset, ms, its spread window placed it at after the due time it
           was asked for (``spread=``; ``producer/spread.py``): due includes it
tn         its tenant (``tenant=``): the release takes due jobs round-robin across
           tenants, and ``tenant:`` rate limits apply to it
lw         the rate limit key it waits under (due, no token left; while it does)
=========  ==============================================================

Worker-side states: QUEUED or CLAIMED -> RUNNING (start.lua takes the
execution lease) -> SUCCEEDED (finish.lua; the record is the done marker) |
FAILED | DEAD | SCHEDULED again for a retry. At release: EXPIRED
(``expires`` passed), SKIPPED or DEAD (released later than ``max_lateness``
with misfire 'skip' or 'dead').

A released or cancelled record expires after ``delayed_record_ttl_s``; a
SUCCEEDED one after ``delayed_done_ttl_s`` (``delayed_idempotency_ttl_s``
when longer and the job has an idempotency key).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..vocab import SHARD_HEADER, Field, JobState, Reply
from .compact import FIELDS as COMPACT_FIELDS
from .compact import Template, fast_uuid4, render

#: Record fields a new job may carry, in the order schedule.lua receives them.
NEW_JOB_FIELDS = (Field.TASK, Field.QUEUE, Field.EXCHANGE, Field.ROUTING_KEY, Field.MESSAGE, Field.LIST_KEY,
                  Field.BINDINGS, Field.PRIORITY_SUFFIX, Field.SENT_EVENT, Field.SHARD_KEY, Field.IDEMPOTENCY_KEY,
                  Field.EXPIRES, Field.MAX_LATENESS, Field.MISFIRE, Field.GENERATION, Field.OUTBOX, Field.SPREAD,
                  Field.TENANT,
                  *COMPACT_FIELDS)


@dataclass(frozen=True)
class NewJob:
    """One job to schedule: its id, shard, due spec ('<ms>' or '+<ms>') and record fields."""

    id: str
    shard: int
    due: str
    fields: Mapping[str, str]
    #: fields this job shares with others (the same object for all of them):
    #: a hint that lets :meth:`Store.schedule` send them once per call.
    common: Mapping[str, str] | None = None
    #: a compact job's template (its fields are then those of ``store/compact.py``)
    template: Template | None = None

    def full_fields(self, due_ms: int | None = None) -> dict[str, str]:
        """The record fields of this job as a full record: a compact job's message rendered.

        What a database row keeps (it must rebuild the job without the template).
        ``due_ms``: the due time the row gives a delay (``due`` '+<ms>'), which
        the message's ``delayed_eta`` header may be rendered from.
        """
        if self.template is None:
            return dict(self.fields)
        t = self.template
        out = {k: v for k, v in self.fields.items() if k not in COMPACT_FIELDS}
        out.update(t.fields)
        if due_ms is None:  # a delay counts from this host's clock
            due_ms = int(time.time() * 1000) + int(self.due[1:]) if self.due.startswith("+") else int(self.due)
        rec = {**self.fields, Field.DUE: str(due_ms)}
        out[Field.MESSAGE] = render(t, self.id, self.shard, rec, fast_uuid4())
        return out


def rehome_message(msg: str, shard: int) -> str:
    """A stored kombu envelope (JSON) with its ``delayed_shard`` header set to ``shard`` (a job placed anew)."""
    envelope = json.loads(msg)
    headers = envelope.get("headers")
    if not isinstance(headers, dict) or headers.get(SHARD_HEADER) == shard:
        return msg
    headers[SHARD_HEADER] = shard
    return json.dumps(envelope)


def rehome(job: NewJob, shard: int) -> NewJob:
    """``job`` placed in ``shard`` instead (a reshard changed the count): its stored message says so too.

    A compact job's message is rendered at release with the shard it is in;
    a full one's ``delayed_shard`` header is rewritten.
    """
    msg = job.fields.get(Field.MESSAGE)
    fields = job.fields if not msg else {**job.fields, Field.MESSAGE: rehome_message(msg, shard)}
    return replace(job, shard=shard, fields=fields)


@dataclass(frozen=True)
class Scheduled:
    """The outcome of scheduling one job."""

    id: str
    shard: int
    due_ms: int
    created: bool  # False: a record with this id was there already
    state: str
    generation: int = 0


@dataclass
class Batch:
    """The outcome of one release or claim call on a shard."""

    count: int = 0
    skipped: int = 0
    next_due_ms: int | None = None
    now_ms: int = 0
    #: the earliest due time of the debounce jobs the call left for their due time (within the
    #: look-ahead, not yet due), or None; next_due_ms then leaves them out
    hold_ms: int | None = None
    #: several tenants had jobs due in the shard: the batch was shared between them
    tenants: bool = False
    ids: list[str] = field(default_factory=list)
    events: list[dict[str, Any] | None] = field(default_factory=list)
    # publish path only: per job (msg, exchange, routing_key, queue)
    messages: list[tuple[str, str, str, str]] = field(default_factory=list)
    #: due jobs not sent: (id, state, reason); state EXPIRED, SKIPPED or DEAD (misfire)
    not_sent: list[tuple[str, str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Membership:
    """What one scheduler heartbeat (``heartbeat.lua``) saw."""

    now_ms: int  # the Redis server's clock
    members: list[str]  # the live members, sorted (the caller among them unless it left)
    deadlines: dict[str, int] = field(default_factory=dict)  # live member -> membership deadline, ms
    #: this heartbeat added the caller to the set (its first, or it had been dropped as dead, or the set
    #: was lost): the shards it held may have been taken since
    joined: bool = False


@dataclass(frozen=True)
class Started:
    """What ``start.lua`` decided for one delivery."""

    code: Reply  # OK (run), NOT_FOUND (untracked), BUSY or WRONG_STATE
    state: str  # the record's state ('' without a record)
    attempt: int  # executions begun, this one included when code is OK
    lease_until_ms: int  # OK: our deadline; BUSY: the other execution's
    why: str = ""  # WRONG_STATE: 'superseded' (a message of an earlier generation), 'moved' (of a moved job)

    @property
    def superseded(self) -> bool:
        """The message is of an earlier generation of the job (cancelled, its key used again)."""
        return self.why == "superseded"

    @property
    def run(self) -> bool:
        """The delivery runs under the execution record."""
        return self.code == Reply.OK

    @property
    def untracked(self) -> bool:
        """The job has no record: the delivery runs without the execution record."""
        return self.code == Reply.NOT_FOUND

    @property
    def busy(self) -> bool:
        """Another execution holds a live lease."""
        return self.code == Reply.BUSY

    @property
    def cancelled(self) -> bool:
        """The job was cancelled before it began."""
        return self.code == Reply.WRONG_STATE and self.state == JobState.CANCELLED and not self.superseded


@dataclass(frozen=True)
class Outcome:
    """The reply of a script that acts on one job: a :class:`~celery_delayed.vocab.Reply` and the state."""

    code: Reply
    state: str
    due_ms: int = 0  # retry: the new due time; reschedule: likewise
    dropped: int = 0  # dead: letters trimmed

    @property
    def ok(self) -> bool:
        """The script did what was asked."""
        return self.code == Reply.OK


def arguments_of(fields: Mapping[str, str], message: str | None = None) -> tuple[str, str]:
    """A job's arguments as Celery's ``argsrepr`` and ``kwargsrepr``: what the app chose to show.

    ``apply_later(argsrepr=..., kwargsrepr=...)`` redacts them, so this never
    reads the message body. From the message's headers when there is one; a
    compact record's own ``a``/``k`` fields; a dead letter's ``args``/``kwargs``
    (saferepr). ``("", "")`` when the record keeps none of these.
    """
    if message:
        try:
            headers = json.loads(message).get("headers") or {}
            return str(headers.get("argsrepr") or ""), str(headers.get("kwargsrepr") or "")
        except (ValueError, AttributeError):
            return "", ""
    if fields.get(Field.C_ARGSREPR) is not None:
        try:
            return str(json.loads(fields[Field.C_ARGSREPR])), str(json.loads(fields.get(Field.C_KWARGSREPR) or '"{}"'))
        except ValueError:
            return "", ""
    return fields.get(Field.ARGS) or "", fields.get(Field.KWARGS) or ""
