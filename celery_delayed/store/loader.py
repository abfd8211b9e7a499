"""Load the Lua scripts of ``lua/`` once per client and call them by SHA.

Each script is read from disk, its ``-- @include "name"`` lines replaced by
``lua/includes/name.lua``, loaded with SCRIPT LOAD on first use and run with
EVALSHA; on ``NOSCRIPT`` (a restarted or flushed server) it is loaded again.
Only the gateway (:mod:`celery_delayed.store.gateway`) runs them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import NoScriptError

_INCLUDE = re.compile(r'^-- @include "([a-z_]+)"$', re.MULTILINE)

Arg = str | int | float | bytes


def lua_dir() -> Path:
    """Return the folder of the Lua scripts.

    An installed wheel carries them in ``celery_delayed/lua``; a source
    checkout (editable install) has them in ``lua/`` beside the package.
    """
    here = Path(__file__).resolve().parent.parent  # the celery_delayed package
    for candidate in (here / "lua", here.parent / "lua"):
        if (candidate / "schedule.lua").is_file():
            return candidate
    raise FileNotFoundError(f"celery-delayed's Lua scripts are missing (looked in {here})")


@cache
def source(name: str) -> str:
    """Return the source of script ``name`` with its includes inlined."""
    base = lua_dir()
    text = (base / f"{name}.lua").read_text(encoding="utf-8")

    def include(m: re.Match[str]) -> str:
        return (base / "includes" / f"{m.group(1)}.lua").read_text(encoding="utf-8")

    return _INCLUDE.sub(include, text)


class Script:
    """One Lua script, run by SHA on a given client."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = source(name)
        self.sha = hashlib.sha1(self.source.encode("utf-8")).hexdigest()

    def __call__(
        self, client: redis.Redis, keys: Sequence[str], args: Sequence[Arg]
    ) -> Any:
        """Run the script; load it first if the server does not know it."""
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Arg]) -> None:
        """Add an EVALSHA of this script to a pipeline (see :meth:`ensure_loaded`)."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)

    def ensure_loaded(self, client: redis.Redis) -> None:
        """Load the script into the server unless it has it already."""
        if not client.script_exists(self.sha)[0]:
            client.script_load(self.source)


class Scripts:
    """Every script of celery-delayed (one attribute per ``lua/<name>.lua``)."""

    def __init__(self) -> None:
        # scheduling and job operations
        self.schedule = Script("schedule")
        self.cancel = Script("cancel")
        self.reschedule = Script("reschedule")
        # release (scheduler side)
        self.release_due = Script("release_due")
        self.claim_due = Script("claim_due")
        self.ack_claimed = Script("ack_claimed")
        self.heartbeat = Script("heartbeat")
        self.rebalance = Script("rebalance")
        # worker side: the execution ledger
        self.start = Script("start")
        self.extend_lease = Script("extend_lease")
        self.finish = Script("finish")
        # failures and the dead-letter queue
        self.retry = Script("retry")
        self.fail = Script("fail")
        self.dead = Script("dead")
        self.requeue = Script("requeue")
        self.purge_dead = Script("purge_dead")

    def all(self) -> list[Script]:
        """Every script, in declaration order."""
        return [v for v in vars(self).values() if isinstance(v, Script)]


@cache
def scripts() -> Scripts:
    """Return the process-wide script table (sources are read once)."""
    return Scripts()
