"""Corrections to Celery and kombu, applied in a worker's main process, one module each.

Kept together as Celery keeps its own (``celery/fixups/``). Each module opens with the
upstream package and versions it applies to, what it corrects, and when to
delete it; :data:`FIXUPS` lists them with those versions.
:func:`install_fixups` applies, at ``worker_init``, every fixup whose upstream
version is in its range and that ``delayed_disabled_fixups`` does not name.

- :mod:`.reconnect_guard`: kombu 5.7's Redis channel, used after its
  connection closed, raises a connection error rather than the
  ``AttributeError`` that stopped a worker after a Redis restart.
- :mod:`.prompt_timers`: kombu's hub fires every due timer without a
  one-second pause after each ten (held ETA messages start on time).
- :mod:`.eta_cycle`: a held ETA request is freed when its task is done, not
  by a full garbage collection (Celery 5.7's request <-> timer entry cycle).
- :mod:`.held_restore`: messages a lost Redis broker connection could not
  restore go back to their queues once the broker answers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from celery import Celery

from ..config import SETTINGS_BY_KEY
from . import eta_cycle, held_restore, prompt_timers, reconnect_guard

logger = logging.getLogger("celery_delayed.fixups")

#: Why install_fixups skipped each fixup it skipped, by name (its last call in this process).
_skipped: dict[str, str] = {}

Version = tuple[int, int, int]


@dataclass(frozen=True)
class Fixup:
    """One correction: the upstream versions it applies to, what it corrects, and how to apply it."""

    name: str  # what delayed_disabled_fixups names it by
    upstream: str  # the package corrected ("celery" or "kombu"), whose __version__ decides
    since: Version  # first version it applies to
    before: Version  # first version it is not applied to: fixed upstream, or not checked yet
    corrects: str  # the upstream behaviour corrected, in a line
    install: Callable[[Celery], bool]  # apply it in this process (idempotent); True when applied

    @property
    def versions(self) -> str:
        """The versions it applies to, as a requirement (``kombu >=5.7.0,<5.8.0``)."""
        return f"{self.upstream} >={_dotted(self.since)},<{_dotted(self.before)}"

    def applies_to(self, version: str) -> bool:
        """Whether ``version`` (of :attr:`upstream`) is in the range this fixup applies to."""
        return self.since <= parse_version(version) < self.before


#: Every fixup, by name, in the order they are applied.
FIXUPS: dict[str, Fixup] = {f.name: f for f in (
    Fixup("reconnect_guard", "kombu", (5, 7, 0), (5, 8, 0),
          "a Redis channel used after its connection closed raises AttributeError, which stops the worker",
          lambda app: reconnect_guard.install()),
    Fixup("prompt_timers", "kombu", (5, 3, 0), (5, 8, 0),
          "the hub fires ten due timers per turn, then waits up to a second",
          lambda app: prompt_timers.install()),
    Fixup("eta_cycle", "celery", (5, 7, 0), (5, 8, 0),
          "an ETA request and its timer entry hold each other until a full garbage collection",
          lambda app: eta_cycle.install()),
    Fixup("held_restore", "kombu", (5, 3, 0), (5, 8, 0),
          "unacknowledged messages a lost Redis connection could not restore wait for the visibility timeout",
          held_restore.install),
)}


def parse_version(text: str) -> Version:
    """``"5.7.0"`` -> ``(5, 7, 0)``; a pre-release counts as its release (``"5.8.0rc1"`` -> ``(5, 8, 0)``)."""
    parts = [int(re.sub(r"\D.*", "", p) or 0) for p in text.split(".")[:3]]  # the leading digits
    parts += [0] * (3 - len(parts))
    return parts[0], parts[1], parts[2]


def _dotted(version: Version) -> str:
    return ".".join(map(str, version))


def upstream_version(package: str) -> str:
    """The installed version of ``package`` (its ``__version__``)."""
    return str(import_module(package).__version__)


def install_fixups(app: Celery) -> list[str]:
    """Apply every fixup in range and not disabled to this process; return the names of those applied.

    Call it in the worker's main process before the worker's consumer and loop
    are made (``worker_init``). Idempotent. Each fixup skipped is logged at
    debug level with the reason.

    Raises:
        ConfigurationError: ``delayed_disabled_fixups`` is not a list of known fixup names.
    """
    disabled = SETTINGS_BY_KEY["disabled_fixups"].read(app.conf)
    _skipped.clear()
    applied = []
    for fixup in FIXUPS.values():
        if fixup.name in disabled:
            _skip(fixup.name, "named in delayed_disabled_fixups")
            continue
        version = upstream_version(fixup.upstream)
        if not fixup.applies_to(version):
            _skip(fixup.name, f"{fixup.upstream} {version} is outside {fixup.versions}")
        elif fixup.install(app):
            applied.append(fixup.name)
        else:
            _skip(fixup.name, "nothing to correct in this process (e.g. the broker is not Redis)")
    return applied


def _skip(name: str, reason: str) -> None:
    _skipped[name] = reason
    logger.debug("fixup %s skipped: %s", name, reason)


def on_worker_setup(**_: Any) -> None:
    """``celeryd_after_setup`` receiver: say in the worker's log what :func:`install_fixups` skipped, and why.

    The worker sets its logging up after ``worker_init``, so the lines logged then did not reach it.
    """
    for name, reason in _skipped.items():
        logger.debug("fixup %s skipped: %s", name, reason)
    reconnect_guard.on_worker_setup()


def fixups_table() -> str:
    """The table of fixups (Markdown) the docs show (the worker side), generated from :data:`FIXUPS`."""
    lines = ["| fixup | applies to | corrects |", "|---|---|---|"]
    lines += [f"| `{f.name}` | {f.versions} | {f.corrects} |" for f in FIXUPS.values()]
    return "\n".join(lines)
