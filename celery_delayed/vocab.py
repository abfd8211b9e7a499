"""The vocabulary every layer shares: job states, record fields, reply codes, the shard header.

Each name is defined here once. The Lua scripts use the same literals (a
Lua script cannot import Python); ``tests/unit/test_vocab.py`` checks that
the scripts use no state, field or reply code this module does not know.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, IntEnum
from typing import Any


class JobState(str, Enum):
    """The states of a job (the record's ``st`` field).

    ``SCHEDULED`` -> (``CLAIMED``, publish path) -> ``QUEUED`` -> ``RUNNING``
    -> ``SUCCEEDED`` | ``FAILED`` | ``DEAD``, or ``SCHEDULED`` again for a
    retry; ``CANCELLED`` from ``SCHEDULED``, ``CLAIMED`` or ``QUEUED``;
    ``EXPIRED``, ``SKIPPED`` or ``DEAD`` at release (``expires``, misfire).
    """

    SCHEDULED = "SCHEDULED"
    CLAIMED = "CLAIMED"
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    DEAD = "DEAD"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"
    SKIPPED = "SKIPPED"
    #: Being moved to another shard by ``delayed reshard`` (for milliseconds: its old
    #: state is kept in the ``mvst`` field; an operation on it is tried again).
    MOVING = "MOVING"

    def __str__(self) -> str:
        return self.value


#: States in which a job was released to its queue but has not started.
RELEASED = frozenset({JobState.CLAIMED, JobState.QUEUED})
#: States a job never leaves by itself (its record expires).
TERMINAL = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.DEAD, JobState.CANCELLED, JobState.EXPIRED, JobState.SKIPPED}
)
#: Terminal states reached without the task running; Celery reports them as REVOKED.
NEVER_RAN = frozenset({JobState.CANCELLED, JobState.EXPIRED, JobState.SKIPPED})


class Reply(IntEnum):
    """The reply codes of the Lua scripts (``lua/includes/common.lua`` documents the same table).

    A script that acts on one job returns ``{code, state, ...}``; the gateway
    turns a negative code into an exception with :func:`celery_delayed.errors.raise_for`.
    """

    OK = 1
    #: Nothing to do: the job is in the wanted state already (a retry already scheduled).
    UNCHANGED = 2
    #: No record under that id.
    NOT_FOUND = 0
    #: The record's state does not allow the operation; the reply carries the state.
    WRONG_STATE = -1
    #: The caller does not hold the lease it acts under (a shard's, or an execution's).
    NOT_OWNER = -2
    #: Another execution of the job holds a live execution lease.
    BUSY = -3
    #: A dead letter without a stored message: it cannot be requeued.
    NO_MESSAGE = -4


class ScheduleField:
    """Names of a recurring schedule's fields (a Redis hash per schedule; ``store/schedules.py``)."""

    NAME = "name"
    #: the definition, JSON: task, spec, args, kwargs, options, timezone, misfire, skip_if_running
    DEFINITION = "def"
    #: 'config' (from ``delayed_schedule``) or 'api' (changed at run time)
    SOURCE = "src"
    #: hash of the config entry it came from (absent: added at run time)
    CONFIG_HASH = "chash"
    #: when the scheduler that wrote the config entry started, epoch ms (an older one never overwrites it)
    CONFIG_SINCE = "csince"
    #: bumped on every change of definition or pause: occurrence ids derive from it
    VERSION = "ver"
    #: random, set when the schedule is created: occurrence ids derive from it too
    EPOCH = "epoch"
    #: an interval's anchor, epoch ms (set once, when the schedule is first seen)
    ORIGIN = "origin"
    #: the cursor: occurrences exist for every fire time up to it, epoch ms
    LAST = "last"
    PAUSED = "paused"
    UPDATED = "updated"
    #: '1' while ``delayed reshard`` moves it to another shard (the scripts leave it alone)
    MOVING = "mv"


class Field:
    """Names of the job record's fields (a Redis hash; the record schema is in ``store/records.py``)."""

    STATE = "st"
    #: MOVING (``delayed reshard``): the state it had, and the time it died (a dead letter)
    MOVED_STATE = "mvst"
    MOVED_DIED = "mvdlq"
    DUE = "due"
    CREATED = "created"
    RELEASED = "released"
    CANCELLED = "cancelled"
    TASK = "task"
    QUEUE = "q"
    EXCHANGE = "ex"
    ROUTING_KEY = "rk"
    MESSAGE = "msg"
    LIST_KEY = "lk"
    BINDINGS = "bx"
    PRIORITY_SUFFIX = "ps"
    SENT_EVENT = "ev"
    SHARD_KEY = "sk"
    IDEMPOTENCY_KEY = "ik"
    EXPIRES = "exp"
    MAX_LATENESS = "ml"
    MISFIRE = "mf"
    REASON = "reason"
    CLAIMS = "claims"
    ATTEMPT = "att"
    LEASE_OWNER = "lo"
    LEASE_UNTIL = "lu"
    STARTED = "started"
    WORKER = "wk"
    FINISHED = "finished"
    RETRIES = "retries"
    FIRST_AT = "first_at"
    LAST_AT = "last_at"
    ERROR_TYPE = "etype"
    ERROR_MESSAGE = "emsg"
    TRACEBACK = "tb"
    HOST = "host"
    DELAY = "delay"
    #: the offset (ms) a spread window gave the job after the due time it was asked for
    SPREAD = "spr"
    #: its tenant (``tenant=``): fair release across tenants, ``tenant:`` rate limits
    TENANT = "tn"
    #: the rate limit key it waits under (due, no token left)
    LIMIT_WAIT = "lw"
    DIED = "died"
    ARGS = "args"
    KWARGS = "kwargs"
    ATTEMPTS = "attempts"
    REQUEUED = "requeued"
    REQUEUED_AT = "requeued_at"
    GENERATION = "gen"
    #: '1': a debounce key's job, released when it is due, never a look-ahead early
    DEBOUNCED = "dk"
    REFUSED = "refused"
    COPIES = "rr"
    OUTBOX = "ob"
    #: a compact record's template id (``store/compact.py``: its other fields are a, k, b, e, i, r, pa)
    TEMPLATE = "tp"
    #: the delivery tag suffix of a compact record's released message
    TAG = "tg"
    #: a compact record's own part of its message (``store/compact.py``)
    C_ARGSREPR = "a"
    C_KWARGSREPR = "k"
    C_BODY = "b"
    C_ETA = "e"
    C_ID = "i"
    C_ROOT = "r"
    C_PARENT = "pa"


#: Record fields that hold epoch-ms times (shown as dates by the CLI).
TIME_FIELDS = (
    Field.DUE, Field.CREATED, Field.RELEASED, Field.CANCELLED, Field.STARTED, Field.FINISHED,
    Field.FIRST_AT, Field.LAST_AT, Field.DIED, Field.REQUEUED_AT, Field.EXPIRES, Field.LEASE_UNTIL,
)

#: The message header that names the shard of a released job.
SHARD_HEADER = "delayed_shard"
#: The message header that names the store (its key prefix) of a released job.
STORE_HEADER = "delayed_store"
#: The message header that carries the backoff delay before this attempt, ms (decorrelated jitter).
DELAY_HEADER = "delayed_backoff_ms"
#: The message header that names the job's generation (absent = 0): an idempotency key
#: used again after a cancel schedules the next generation under the same job id.
GENERATION_HEADER = "delayed_gen"
#: The message header that carries the job's due time as Celery writes an ``eta`` (ISO 8601), or null.
#: The stored message has no ``eta`` (a worker would hold it until then, by its own clock); the worker
#: side copies this header into ``request.eta`` before the body runs (see ``worker/eta.py``).
ETA_HEADER = "delayed_eta"


#: Fields of a shard's stats hash (``{p}:{s}:stats``): delayed sends interception sent to the
#: broker as ETA messages (a count), and the last one ("<epoch ms>|<task name>|<reason>").
ETA_FALLBACKS = "eta_fallbacks"
ETA_FALLBACK_LAST = "eta_fallback_last"


def job_headers(shard: int | str, prefix: str, eta: str | None = None) -> dict[str, Any]:
    """The headers of a stored job's message: its shard and store (to find its record), and its eta."""
    return {SHARD_HEADER: shard, STORE_HEADER: prefix, ETA_HEADER: eta}


def request_header(request: Any, name: str) -> Any:
    """A custom message header of a Celery request, or None.

    Celery copies protocol-2 headers onto the request as attributes; the
    ``headers`` mapping has the rest.
    """
    value = getattr(request, name, None)
    if value is None:
        headers = getattr(request, "headers", None)
        if isinstance(headers, Mapping):
            value = headers.get(name)
    return value


def request_shard(request: Any) -> int | None:
    """The shard a delivered message names in its ``delayed_shard`` header, or None."""
    value = request_header(request, SHARD_HEADER)
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
