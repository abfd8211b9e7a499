"""What the hand-written pages name exists in the code: settings, metrics, Lua scripts, commands.

The reference pages are generated from the code at build time (docs/_ext/delayed_docs.py); these
checks cover the prose around them (README.md and docs/**/*.md), so that a renamed or removed
setting, metric, script or command cannot stay in the documentation.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from celery_delayed.cli import delayed
from celery_delayed.config import SETTINGS
from celery_delayed.metrics import FAMILIES, PREFIX
from celery_delayed.sql.schema import metadata

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]

#: ``delayed_*`` names that are not settings: the testing kit's fixtures, message headers, the database's
#: tables (read from the schema), the docs' Sphinx extension.
NOT_SETTINGS = {"delayed_app", "delayed_kit", "delayed_clock", "delayed_store", "delayed_eta", "delayed_shard",
                "delayed_docs", "delayed_spread",  # (a task attribute)
                *metadata.tables}
#: The architecture page's recipe adds a script that does not exist: its example.
EXAMPLE_SCRIPTS = {"park.lua"}


def _text() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in PAGES}


def _where(pattern: str, known: set[str]) -> list[str]:
    return [f"{page}: {m.group(0)}" for page, text in _text().items()
            for m in re.finditer(pattern, text) if m.group(0) not in known]


def test_every_setting_named_exists() -> None:
    known = {s.name for s in SETTINGS} | NOT_SETTINGS
    assert _where(r"\bdelayed_[a-z][a-z0-9_]*[a-z0-9]\b", known) == []


def test_every_metric_named_is_served() -> None:
    served = {PREFIX + name for name, *_ in FAMILIES} | {PREFIX + "store_up"}
    served |= {n + s for n in served for s in ("_bucket", "_sum", "_count")}
    assert _where(r"\bcelery_delayed_[a-z][a-z0-9_]*[a-z0-9]\b", served) == []


def test_every_lua_script_named_exists() -> None:
    scripts = {p.name for p in (ROOT / "lua").rglob("*.lua")} | EXAMPLE_SCRIPTS
    assert _where(r"\b[a-z_]+\.lua\b", scripts) == []


def _commands(group: click.Group, prefix: str = "") -> set[str]:
    found = set()
    for name, command in group.commands.items():
        found.add(prefix + name)
        if isinstance(command, click.Group):
            found |= _commands(command, prefix + name + " ")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_delayed_command_shown_exists(page: Path) -> None:
    commands = _commands(delayed)
    unknown = []
    for m in re.finditer(r"celery -A \S+ delayed ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", page.read_text()):
        first, second = m.group(1), m.group(2)
        is_group = first in commands and isinstance(delayed.commands[first], click.Group)
        if first not in commands or (is_group and second and f"{first} {second}" not in commands):
            unknown.append(m.group(0))
    assert unknown == []
