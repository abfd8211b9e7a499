"""Load the Lua scripts of ``lua/`` once per client and call them by SHA.

Each script is read from disk, its ``-- @include "name"`` lines replaced by
``lua/includes/name.lua``, loaded with SCRIPT LOAD on first use and run with
EVALSHA; on ``NOSCRIPT`` (a restarted or flushed server) it is loaded again.
Only the store's runner (:mod:`celery_delayed.store.runner`) runs them, for the facets.

A script whose header says ``-- @flags allow-oom`` may run when Redis is at
``maxmemory`` (Redis 7's script flags, given as a ``#!lua flags=...`` first
line): the scripts that release jobs, keep memberships and end executions,
which free memory or hold it steady, so a full store keeps draining. On a
server older than 7.0 the flags are left out (:func:`scripts` ``flags=False``).
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
_FLAGS = re.compile(r"^-- @flags ([a-z-]+(?: [a-z-]+)*)$", re.MULTILINE)

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
def source(name: str, flags: bool = False) -> str:
    """Return the source of script ``name`` with its includes inlined (and its flags' shebang line)."""
    base = lua_dir()
    text = (base / f"{name}.lua").read_text(encoding="utf-8")

    def include(m: re.Match[str]) -> str:
        return (base / "includes" / f"{m.group(1)}.lua").read_text(encoding="utf-8")

    text = _INCLUDE.sub(include, text)
    declared = _FLAGS.search(text)
    if flags and declared:
        text = f"#!lua flags={declared.group(1).replace(' ', ',')}\n{text}"
    return text


class Script:
    """One Lua script, run by SHA on a given client."""

    def __init__(self, name: str, flags: bool = False) -> None:
        self.name = name
        self.source = source(name, flags)
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
        """Add an EVALSHA of this script to a pipeline (see :meth:`ensure_loaded`).

        (Through ``execute_command``: redis-py's cluster pipeline routes an
        EVALSHA by its keys but blocks its ``evalsha`` method.)
        """
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def ensure_loaded(self, client: redis.Redis) -> None:
        """Load the script into the server unless it has it already."""
        if not client.script_exists(self.sha)[0]:
            client.script_load(self.source)


class Scripts:
    """Every script of celery-delayed: one attribute per ``lua/<name>.lua``, found by listing the folder.

    The facets name the scripts they run (``SCRIPTS``); an architecture test
    checks that those names are exactly the files here.
    """

    def __init__(self, flags: bool = False) -> None:
        self._by_name = {p.stem: Script(p.stem, flags) for p in sorted(lua_dir().glob("*.lua"))}
        self.__dict__.update(self._by_name)  # plain attributes: a script is looked up on every call

    def __getattr__(self, name: str) -> Script:
        """Only for a name with no ``lua/<name>.lua`` (the others are plain attributes)."""
        raise AttributeError(f"celery-delayed has no script lua/{name}.lua")

    def names(self) -> list[str]:
        """The scripts' names, sorted."""
        return list(self._by_name)

    def all(self) -> list[Script]:
        """Every script, sorted by name."""
        return list(self._by_name.values())


@cache
def scripts(flags: bool = False) -> Scripts:
    """Return the process-wide script table (sources are read once).

    ``flags``: give the scripts their declared Redis 7 flags (see the module docstring).
    """
    return Scripts(flags)
