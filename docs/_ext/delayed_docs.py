"""The reference pages that are generated from the code, so that they cannot drift from it.

Directives (each renders what the package defines at build time):

- ``delayed-settings``: every ``delayed_*`` setting of :data:`celery_delayed.config.SETTINGS`,
  grouped, with its type, default, bounds and meaning (Markdown; use it in a ``.md`` page).
- ``delayed-metrics``: the Prometheus families of :data:`celery_delayed.metrics.FAMILIES` (Markdown).
- ``delayed-fixups``: the corrections to Celery and kombu of :data:`celery_delayed.fixups.FIXUPS` (Markdown).
- ``delayed-api``: autodoc of ``celery_delayed.__all__``, in the groups its comments name (reStructuredText:
  use it inside an ``{eval-rst}`` block, as every autodoc directive).
- ``delayed-errors``: the exception tree of :mod:`celery_delayed.errors`, each class with its docstring (RST).
- ``delayed-lua``: every script of ``lua/`` with the facet method that runs it and its header
  (KEYS, ARGV, replies), and the shared includes (RST).

Two object types come with them: ``setting`` (``{setting}`delayed_shards```) and ``luascript``
(``{luascript}`cancel.lua```), so any page links to one setting or one script.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]

#: The settings page's groups, in order: (title, the settings' keys without "delayed_").
#: A setting in no group is listed under "Other settings", so a new one is never left out.
SETTING_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("The store's Redis", ("redis_url", "redis_options", "redis_cluster", "wait_replicas",
                           "wait_replicas_timeout_ms", "key_prefix")),
    ("Shards and release", ("shards", "bucket_ms", "release_mode", "batch_size", "lookahead_ms", "lease_ms",
                            "claim_lease_ms", "publish_max_refusals")),
    ("Jobs and their records", ("record_ttl_s", "max_payload_bytes", "misfire", "max_lateness_s")),
    ("The worker side", ("exec_lease_ms", "done_ttl_s", "idempotency_ttl_s", "disabled_fixups")),
    ("Retries", ("max_attempts", "backoff", "backoff_base_s", "backoff_factor", "backoff_cap_s",
                 "backoff_seed")),
    ("Dead letters", ("dlq_max_age_s", "dlq_max_len", "dlq_queue", "dlq_task", "dlq_all_failures")),
    ("A database as the source of truth", ("database_url", "reconcile_interval_s", "requeue_after_s")),
    ("Intercepting Celery's ETA calls", ("intercept_eta", "intercept_min_delay_s")),
    ("Recurring schedules", ("schedule", "import_beat_schedule", "schedule_sync_s", "schedule_catch_up_max")),
    ("Operating", ("metrics_port", "metrics_address", "rabbitmq_api_url")),
)

#: "(see X)" in a setting's text becomes a link to the page that tells X.
SEE_ALSO = {
    "Redis Sentinel": "/howto/sentinel",
    "Redis Cluster": "/howto/redis-cluster",
    "How release works": "/explanation/release",
    "Durability": "/howto/durability",
    "Recurring schedules": "/howto/recurring",
    "Adopting without changing call sites": "/howto/intercept-eta",
    "Fixes to Celery and kombu": "/explanation/worker-side",
}


def _markdown(directive: SphinxDirective, text: str, titles: bool = False) -> list[nodes.Node]:
    """Parse Markdown text in the directive's (MyST) document; ``titles``: its headings make sections."""
    container = nodes.section() if titles else nodes.container()
    directive.state.nested_parse(StringList(text.splitlines(), source=directive.get_source_info()[0]),
                                 directive.content_offset, container, match_titles=titles)
    return list(container.children)


def _rst(directive: SphinxDirective, lines: list[str]) -> list[nodes.Node]:
    """Parse reStructuredText lines (the directive stands in an ``{eval-rst}`` block)."""
    container = nodes.container()
    source = directive.get_source_info()[0]
    directive.state.nested_parse(StringList(lines, source=source), directive.content_offset, container)
    return list(container.children)


# -- settings ------------------------------------------------------------------------------------


def _setting_type(s: Any) -> str:
    if s.kind is bool and s.choices:
        kind = "`True`, `False` or " + " or ".join(f'`"{c}"`' for c in s.choices)
    elif s.kind is bool:
        kind = "`True` or `False`"
    elif s.kind is tuple:
        kind = "a list of names"
    elif s.kind is str and s.choices:
        kind = "one of " + ", ".join(f'`"{c}"`' for c in s.choices)
    else:
        kind = {int: "int", float: "number", str: "str", dict: "dict"}.get(s.kind, s.kind.__name__)
        if s.unit:
            kind += f", {s.unit}"
    if s.nullable:
        kind += " or `None`"
    return kind


def _setting_default(s: Any) -> str:
    from celery_delayed.config import _human

    if s.key == "redis_url":
        return "`None`: the broker's URL (`broker_url`)"
    if isinstance(s.default, str):
        return f'`"{s.default}"`'
    if isinstance(s.default, tuple):
        return "`()` (none)"
    if isinstance(s.default, int) and not isinstance(s.default, bool) and s.default >= 10_000:
        return f"`{s.default}`" + _human(s) + ("" if _human(s) else f" ({s.default:,})")
    return f"`{s.default}`" + _human(s)


def _setting_bounds(s: Any) -> str:
    from celery_delayed.config import _num

    if s.lo is not None and s.hi is not None:
        return f"from {_num(s.lo)} to {_num(s.hi)}"
    if s.lo is not None:
        return f"at least {_num(s.lo)}"
    return ""


def _see_also(text: str) -> str:
    def link(m: re.Match[str]) -> str:
        target = SEE_ALSO.get(m.group(1))
        return f"(see [{m.group(1)}]({target}))" if target else m.group(0)

    return re.sub(r"\(see ([A-Z][A-Za-z ,]+?)\)", link, text)


def _sentence(text: str) -> str:
    """A setting's meaning as a sentence: a capital first, a full stop last, no table escapes."""
    text = text.replace("\\|", "|").strip()
    text = text[0].upper() + text[1:] if text[:1].islower() else text
    return text if text.endswith((".", ")")) and not text.endswith("...)") else text + "."


def settings_markdown() -> str:
    """The settings, grouped, as MyST Markdown (one ``{setting}`` object each)."""
    from celery_delayed.config import SETTINGS_BY_KEY

    listed: set[str] = set()
    groups = [(title, [k for k in keys if k in SETTINGS_BY_KEY]) for title, keys in SETTING_GROUPS]
    rest = [k for k in SETTINGS_BY_KEY if not any(k in keys for _, keys in SETTING_GROUPS)]
    if rest:
        groups.append(("Other settings", rest))
    out: list[str] = []
    for title, keys in groups:
        out += [f"## {title}", ""]
        for key in keys:
            s = SETTINGS_BY_KEY[key]
            listed.add(key)
            meta = f"*Type:* {_setting_type(s)}. *Default:* {_setting_default(s)}."
            bounds = _setting_bounds(s)
            if bounds:
                meta = meta[:-1] + f", {bounds}."
            out += ["````{setting} " + s.name, meta, "", _sentence(_see_also(s.doc)), "````", ""]
    return "\n".join(out)


class SettingsDirective(SphinxDirective):
    """``delayed-settings``: every ``delayed_*`` setting, from ``celery_delayed.config.SETTINGS``."""

    def run(self) -> list[nodes.Node]:
        return _markdown(self, settings_markdown(), titles=True)


# -- metrics, fixups -----------------------------------------------------------------------------


def metrics_markdown() -> str:
    from celery_delayed.metrics import PREFIX, metrics_table

    up = f"| `{PREFIX}store_up` | gauge | - | 1 when the scrape could read the store, 0 when it could not |"
    return metrics_table() + "\n" + up


class MetricsDirective(SphinxDirective):
    """``delayed-metrics``: the exporter's families, from ``celery_delayed.metrics.FAMILIES``."""

    def run(self) -> list[nodes.Node]:
        return _markdown(self, metrics_markdown())


def fixups_markdown() -> str:
    from celery_delayed.fixups import fixups_table

    return fixups_table()


class FixupsDirective(SphinxDirective):
    """``delayed-fixups``: the corrections to Celery and kombu, from ``celery_delayed.fixups.FIXUPS``."""

    def run(self) -> list[nodes.Node]:
        return _markdown(self, fixups_markdown())


# -- the API, by the groups of __all__ -------------------------------------------------------------


def api_groups() -> list[tuple[str, list[str]]]:
    """``celery_delayed.__all__`` in the groups its comments name: [(comment, [names])]."""
    import celery_delayed

    source = Path(inspect.getfile(celery_delayed)).read_text()
    tree = ast.parse(source)
    start = end = 0
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            start, end = node.lineno, node.end_lineno or node.lineno
    groups: list[tuple[str, list[str]]] = []
    for line in source.splitlines()[start:end]:
        line = line.strip()
        if line.startswith("#"):
            groups.append((line.lstrip("# ").split(" (")[0], []))
        elif line.startswith('"'):
            if not groups:
                groups.append(("The API", []))
            groups[-1][1].append(line.strip('",'))
    names = [n for _, ns in groups for n in ns]
    if sorted(names) != sorted(celery_delayed.__all__):
        raise RuntimeError("delayed-api: could not read the groups of celery_delayed.__all__")
    return groups


def own_members(cls: type) -> list[str]:
    """The public names a class defines itself (not what it inherits from Celery's classes)."""
    return [k for k in vars(cls) if not k.startswith("_") and k != "abstract"]


class ApiDirective(SphinxDirective):
    """``delayed-api``: autodoc of every public name, by group (in an ``{eval-rst}`` block)."""

    def run(self) -> list[nodes.Node]:
        import celery_delayed
        from celery_delayed import errors

        lines: list[str] = []
        for title, names in api_groups():
            lines += [f".. rubric:: {title}", ""]
            for name in names:
                obj = getattr(celery_delayed, name)
                if inspect.ismodule(obj):
                    lines += [f".. automodule:: {obj.__name__}", "   :members:", "   :no-index:", ""]
                elif inspect.isclass(obj) and issubclass(obj, BaseException) and getattr(errors, name, None) is obj:
                    lines += [f"- :exc:`celery_delayed.{name} <celery_delayed.errors.{name}>`", ""]
                elif inspect.isclass(obj):
                    lines += [f".. autoclass:: celery_delayed.{name}", f"   :members: {', '.join(own_members(obj))}",
                              ""]
                else:
                    lines += [f".. autofunction:: celery_delayed.{name}", ""]
        return _rst(self, lines)


# -- errors ----------------------------------------------------------------------------------------


def error_classes() -> list[type[BaseException]]:
    """The exception classes of :mod:`celery_delayed.errors`, in the order the module defines them."""
    from celery_delayed import errors

    found = [c for _, c in inspect.getmembers(errors, inspect.isclass)
             if issubclass(c, BaseException) and c.__module__ == errors.__name__]
    return sorted(found, key=lambda c: inspect.getsourcelines(c)[1])


class ErrorsDirective(SphinxDirective):
    """``delayed-errors``: the exception tree of ``celery_delayed.errors`` (in an ``{eval-rst}`` block)."""

    def run(self) -> list[nodes.Node]:
        classes = error_classes()
        mine = set(classes)

        def tree(cls: type[BaseException], depth: int) -> list[str]:
            std = [b.__name__ for b in cls.__bases__ if b not in mine]
            also = f" (also a ``{'``, ``'.join(std)}``)" if std and depth else ""
            out = ["  " * depth + f"- :exc:`~celery_delayed.errors.{cls.__name__}`{also}"]
            for sub in classes:
                if cls in sub.__bases__ and sub.__bases__[0] is cls:
                    out += ["", *tree(sub, depth + 1)]
            return out

        roots = [c for c in classes if not any(b in mine for b in c.__bases__)]
        lines: list[str] = []
        for root in roots:
            lines += [*tree(root, 0), ""]
        for cls in classes:
            lines += [f".. autoexception:: celery_delayed.errors.{cls.__name__}", "   :show-inheritance:",
                      "   :members:", ""]
        return _rst(self, lines)


# -- Lua scripts -----------------------------------------------------------------------------------


def script_runners() -> dict[str, str]:
    """Each script's facet method, as ``store.<attribute>.<method>``."""
    from celery_delayed.store.facet import Facet

    attrs = {"Jobs": "jobs", "Lookup": "lookup", "Releases": "release", "Fleet": "fleet",
             "Executions": "executions", "DeadLetters": "dead_letters", "ScheduleRecords": "schedules",
             "ChangeLog": "changes", "Moves": "moves"}
    import celery_delayed.store  # noqa: F401  (imports every facet)

    runners: dict[str, str] = {}
    todo = list(Facet.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        for script in cls.SCRIPTS:
            runners[script] = f"store.{attrs.get(cls.__name__, cls.__name__)}.{script} ({cls.__name__})"
    return runners


def lua_header(path: Path) -> str:
    """A script's header: its leading ``--[[ ... ]]`` block, or its leading ``--`` comment lines."""
    text = path.read_text()
    m = re.match(r"\s*--\[\[(.*?)\]\]", text, re.S)
    if m:
        return m.group(1).strip("\n")
    lines = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        lines.append(line[2:].removeprefix(" "))
    return "\n".join(lines).strip("\n")


class LuaDirective(SphinxDirective):
    """``delayed-lua``: every script of ``lua/`` and its header (in an ``{eval-rst}`` block)."""

    def run(self) -> list[nodes.Node]:
        lua = ROOT / "lua"
        runners = script_runners()
        lines: list[str] = []
        for path in sorted(lua.glob("*.lua")):
            head = lua_header(path)
            first, _, rest = head.partition("\n")
            first = first.strip().removeprefix(f"{path.stem}:").strip()
            first = first[:1].upper() + first[1:]
            lines += [f".. luascript:: {path.name}", "",
                      f"   {first.strip()}", "",
                      f"   Run by ``{runners.get(path.stem, '(no facet)')}``.", "",
                      "   .. code-block:: text", ""]
            lines += ["      " + ln if ln.strip() else "" for ln in rest.strip("\n").splitlines()]
            lines += [""]
        lines += [".. rubric:: Includes", "",
                  "Shared Lua that the loader inlines where a script says ``-- @include \"name\"``.", ""]
        for path in sorted((lua / "includes").glob("*.lua")):
            lines += [f".. luascript:: includes/{path.name}", "", "   .. code-block:: text", ""]
            lines += ["      " + ln if ln.strip() else "" for ln in lua_header(path).splitlines()]
            lines += [""]
        return _rst(self, lines)


def warn_unknown(app: Sphinx, env: Any, node: Any, contnode: Any) -> None:
    """A ``{setting}`` or ``{luascript}`` link to nothing is a warning (so an error under ``-W``)."""
    if node.get("refdomain") == "std" and node.get("reftype") in ("setting", "luascript"):
        logger.warning("no %s named %r", node["reftype"], node["reftarget"], location=node)


def options_as_code(app: Sphinx, ctx: Any, lines: list[str]) -> None:
    """A command's help names options (``--task``): show them as code, so they stay two hyphens."""
    lines[:] = [line if line.lstrip().startswith(("..", ":")) else
                re.sub(r"(?<![`\w-])(--[a-z][a-z-]*)", r"``\1``", line) for line in lines]


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", warn_unknown)
    app.connect("sphinx-click-process-description", options_as_code)
    app.connect("sphinx-click-process-options", options_as_code)
    app.add_object_type("setting", "setting", indextemplate="pair: %s; setting")
    app.add_object_type("luascript", "luascript", indextemplate="pair: %s; Lua script")
    app.add_directive("delayed-settings", SettingsDirective)
    app.add_directive("delayed-metrics", MetricsDirective)
    app.add_directive("delayed-fixups", FixupsDirective)
    app.add_directive("delayed-api", ApiDirective)
    app.add_directive("delayed-errors", ErrorsDirective)
    app.add_directive("delayed-lua", LuaDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
