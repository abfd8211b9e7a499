"""Reading jobs one at a time (or a few by id): where a job is, its record, its message.

Reads only: no script runs here. Listing many jobs is :mod:`.views`' job.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..errors import InvalidOption, JobNotFound
from ..vocab import Field
from . import compact
from .compact import Template
from .facet import Facet
from .layout import ShardLayout
from .records import NewJob
from .runner import Runner

#: Record fields that hold a job's message (full, or a compact record's own part).
_MESSAGE_FIELDS = (Field.MESSAGE, Field.TAG, *(f for f in compact.FIELDS if f != Field.TEMPLATE))


class Lookup(Facet):
    """Single-job reads, for every side: locate, get, message, template, states."""

    def __init__(self, redis: Runner, layout: ShardLayout) -> None:
        super().__init__(redis, layout)
        #: templates read back from the server, by id (a template never changes: its id is its digest)
        self._templates: dict[str, Template] = {}

    def states(self, jobs: Sequence[NewJob]) -> list[str | None]:
        """The state of each job's record (None: there is none), in one round trip."""
        pipe = self.redis.client.pipeline(transaction=False)
        for job in jobs:
            pipe.hget(self.keys.shard(job.shard).job(job.id), Field.STATE)
        return [None if st is None else str(st) for st in pipe.execute()]

    def locate(self, job_id: str, shard: int | None = None) -> int:
        """Return the shard holding ``job_id``; raise :class:`JobNotFound`.

        Tries the given shard, then the id's own shard, then (a job scheduled
        with a ``shard_key``) every shard in one round trip.

        Raises:
            InvalidOption: ``job_id`` is not a non-empty string.
        """
        if not isinstance(job_id, str) or not job_id:
            raise InvalidOption(f"a job id must be a non-empty string, got {type(job_id).__name__} {job_id!r}")
        for _ in range(2):
            seen = (self.layout.shards, self.layout.span)
            tried = []
            for s in (shard, self.layout.shard_of(job_id)):
                if s is not None and s not in tried:
                    tried.append(s)
                    if self.redis.client.exists(self.keys.shard(s).job(job_id)):
                        return s
            pipe = self.redis.client.pipeline(transaction=False)
            for s in self.layout.shard_range():
                pipe.exists(self.keys.shard(s).job(job_id))
            for s, hit in enumerate(pipe.execute()):
                if hit:
                    return s
            # A reshard this process has not seen yet may have moved it. Compared with the view this
            # search used, not by what reload() says: another thread's read may have changed it meanwhile.
            self.layout.reload(1.0)
            if (self.layout.shards, self.layout.span) == seen:
                break
        raise JobNotFound(job_id)

    def locate_many(self, job_ids: Sequence[str]) -> dict[str, int]:
        """The shard of each of ``job_ids`` that has a record, in one round trip (the others are left out)."""
        n = self.layout.span
        pipe = self.redis.client.pipeline(transaction=False)
        for job_id in job_ids:
            for s in range(n):
                pipe.exists(self.keys.shard(s).job(job_id))
        hits = pipe.execute()
        out: dict[str, int] = {}
        for i, job_id in enumerate(job_ids):
            found = next((s for s in range(n) if hits[i * n + s]), None)
            if found is not None:
                out[job_id] = found
        return out

    def get(self, job_id: str, shard: int | None = None) -> dict[str, str]:
        """Return the job's record (without its message) or raise :class:`JobNotFound`."""
        s = self.locate(job_id, shard)
        rec = {str(k): str(v) for k, v in self.redis.client.hgetall(self.keys.shard(s).job(job_id)).items()}
        if not rec:
            raise JobNotFound(job_id)
        for f in _MESSAGE_FIELDS:
            rec.pop(f, None)
        if Field.TEMPLATE in rec and Field.TASK not in rec:  # a compact pending job: its template routes it
            t = self.template(s, rec[Field.TEMPLATE])
            if t is not None:
                rec.update(t.fields)
        rec["id"], rec["shard"] = job_id, str(s)
        return rec

    def message(self, job_id: str, shard: int) -> str | None:
        """The job's stored kombu envelope (JSON), while it has one (until it starts), else None."""
        return self.messages([(shard, job_id)])[0]

    def messages(self, jobs: Sequence[tuple[int, str]]) -> list[str | None]:
        """The stored envelopes of (shard, id) pairs, one round trip (a compact record's rendered)."""
        pipe = self.redis.client.pipeline(transaction=False)
        for shard, job_id in jobs:
            pipe.hmget(self.keys.shard(shard).job(job_id), Field.MESSAGE, Field.TEMPLATE, Field.TAG, Field.DUE,
                       *compact.FIELDS)
        out: list[str | None] = []
        for (shard, job_id), got in zip(jobs, pipe.execute(), strict=True):
            msg, tid, tag = got[0], got[1], got[2]
            if msg is not None:
                out.append(str(msg))
                continue
            rec = {k: str(v) for k, v in zip((Field.DUE, *compact.FIELDS), got[3:], strict=True) if v is not None}
            t = self.template(shard, str(tid)) if tid is not None and "b" in rec else None
            out.append(None if t is None else compact.render(t, job_id, shard, rec, str(tag or "0")))
        return out

    def template(self, shard: int, tid: str) -> Template | None:
        """A compact records' template of ``shard`` (cached: a template never changes), or None."""
        t = self._templates.get(tid)
        if t is None:
            text = self.redis.client.get(self.keys.shard(shard).template(tid))
            if text is None:
                return None
            t = Template.from_text(str(text))
            if len(self._templates) < 1024:
                self._templates[tid] = t
        return t

    def route_of(self, shard: int, task: str | None, queue: str | None, tid: str | None) -> tuple[str, str]:
        """(task, queue) of a record: its own fields, or its template's (a compact pending job)."""
        if task is None and tid:
            t = self.template(shard, tid)
            if t is not None:
                fields = t.fields
                return fields.get(Field.TASK, ""), fields.get(Field.QUEUE, "")
        return task or "", queue or ""

    def records(self, shard: int, ids: Sequence[str]) -> dict[str, dict[str, str]]:
        """The records of ``ids`` in one shard (message included; {} for a job without one), one round trip.

        A compact record comes back as a full one (its routing fields and its
        rendered message): what a database row keeps.
        """
        shard_keys = self.keys.shard(shard)
        pipe = self.redis.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hgetall(shard_keys.job(job_id))
        out = {j: {str(k): str(v) for k, v in rec.items()} for j, rec in zip(ids, pipe.execute(), strict=True)}
        for job_id, rec in out.items():
            if Field.MESSAGE not in rec and "b" in rec and Field.TEMPLATE in rec:
                t = self.template(shard, rec[Field.TEMPLATE])
                if t is None:
                    continue
                msg = compact.render(t, job_id, shard, rec, rec.get(Field.TAG) or compact.fast_uuid4())
                for f in _MESSAGE_FIELDS:
                    rec.pop(f, None)
                rec.update({k: v for k, v in t.fields.items() if k not in rec})
                rec[Field.MESSAGE] = msg
        return out

    def record_states(self, shard: int, ids: Sequence[str]) -> dict[str, str | None]:
        """The state of each job's record in one shard (None: no record), one round trip."""
        return dict(zip(ids, self.field_of(shard, ids, Field.STATE).values(), strict=True))

    def field_of(self, shard: int, ids: Sequence[str], name: str) -> dict[str, str | None]:
        """One field of each job's record in one shard (None: absent), one round trip."""
        shard_keys = self.keys.shard(shard)
        pipe = self.redis.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(shard_keys.job(job_id), name)
        return {j: (None if v is None else str(v)) for j, v in zip(ids, pipe.execute(), strict=True)}

    def scheduled_pages(self, shard: int, size: int = 1000) -> Iterator[list[str]]:
        """The scheduled job ids of one shard, a page at a time (due order)."""
        for key in ([self.keys.shard(shard).due] if self.config.bucket_ms <= 0
                    else [str(k) for k in self.redis.client.zrange(self.keys.shard(shard).buckets, 0, -1)]):
            start = 0
            while True:
                page = [str(j) for j in self.redis.client.zrange(key, start, start + size - 1)]
                if not page:
                    break
                yield page
                start += len(page)
