"""The package's shape: no import cycles, layers that import one way, only the store layer talks to Redis,
each script run by one facet method of its name, no reach into another object's private attributes, no side
effects at import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import celery_delayed

PKG = Path(celery_delayed.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.with_suffix("").relative_to(PKG.parent).parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Package modules ``name`` imports anywhere (``TYPE_CHECKING`` blocks and functions included)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    deps: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        for n in ast.walk(node):
            if isinstance(n, ast.ImportFrom):
                if n.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                    target = ".".join(base + ([n.module] if n.module else []))
                else:
                    target = n.module or ""
                for cand in [target, *(f"{target}.{a.name}" for a in n.names)]:
                    if cand in mods:
                        deps.add(cand)
            elif isinstance(n, ast.Import):
                deps.update(a.name for a in n.names if a.name in mods)
    return {d for d in deps if d != name and not name.startswith(d + ".")}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_no_import_cycles():
    graph = _graph()
    assert len(graph) > 30
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d):], d])
            elif d not in state:
                visit(d, [*stack, d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles


#: The package's layers, lowest first: a module may import only from layers below its own (a package's
#: own modules aside). A feature package's command-line module (``dlq.cli``, ``schedules.cli``) is in the
#: command-line layer. Every top-level module is in exactly one layer ("" is the package's ``__init__``).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("vocab",),
    ("errors",),
    ("timeutil", "redis_urls", "threads", "rate_limits"),  # rate_limits: the keys and rates of delayed_rate_limits
    ("database_urls",),  # redacts as redis_urls does
    ("config",),
    ("fixups",),  # Celery/kombu patches: they read the settings, nothing of ours above them
    ("store",),  # the only layer that talks to Redis
    ("announce", "producer", "metrics", "describe"),  # describe: a record in words (web, cli)
    ("cancellation",),
    ("result", "controls"),
    ("sql",),  # rows: the store and the message a row rebuilds, never who calls it (api, reconciler, scheduler)
    ("api", "doctor"),  # doctor checks the database's binding too
    ("reconciler", "schedules", "dlq", "adoption"),  # features on the public API and the store, not on each other
    ("scheduler",),  # runs the reconciler and the schedules' keeper
    ("worker", "web", "contrib"),  # the worker embeds a scheduler; the dashboards (ours, Django's admin) read the store
    ("testing",),
    ("plugin",),
    ("cli", ""),
)


def _layer(module: str) -> str:
    """The layer name of a package module: its top-level package, or "cli" for a feature's commands."""
    if module.endswith(".cli"):
        return "cli"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_is_in_one_layer():
    names = [n for layer in LAYERS for n in layer]
    assert len(names) == len(set(names)), "a name in two layers"
    layers = {_layer(m) for m in _modules()}
    assert not layers - set(names), f"not in LAYERS (place it): {sorted(layers - set(names))}"
    assert not set(names) - layers, f"in LAYERS but no such module: {sorted(set(names) - layers)}"


def test_layers_point_one_way():
    rank = {n: i for i, layer in enumerate(LAYERS) for n in layer}
    wrong = []
    for name, deps in _graph().items():
        for d in sorted(deps):
            if _layer(d) != _layer(name) and rank[_layer(d)] >= rank[_layer(name)]:
                wrong.append(f"{name} imports {d} ({_layer(d) or '__init__'} is not below "
                             f"{_layer(name) or '__init__'})")
    assert not wrong, wrong
    # the command line: the cli package, and a feature package's own commands (e.g. schedules.cli)
    for name, deps in _graph().items():
        if not (name.startswith("celery_delayed.cli") or name.endswith(".cli")):
            assert not {d for d in deps if d.startswith("celery_delayed.cli") or d.endswith(".cli")}, name


def test_only_the_store_layer_runs_scripts_or_touches_redis():
    for name, path in _modules().items():
        if name.startswith(("celery_delayed.store", "celery_delayed.testing")):
            continue
        # these two work inside kombu's Redis broker transport (its QoS, its redis-py errors), not on the store
        # absorbing reads the broker's own lists and unacked hash, as kombu's Redis transport keeps them
        if name in ("celery_delayed.fixups.reconnect_guard", "celery_delayed.fixups.held_restore",
                    "celery_delayed.adoption.redis_broker"):
            continue
        text = path.read_text()
        for needle in ("import redis", "from redis", ".client.", "evalsha", "._run(", ".scripts."):
            assert needle not in text, (name, needle)


def test_importing_the_package_changes_nothing_in_celery():
    code = ("import celery, celery.bin.worker as w; before = (celery.Celery.send_task, len(w.worker.params)); "
            "import celery_delayed; after = (celery.Celery.send_task, len(w.worker.params)); "
            "assert before == after, (before, after); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


STORE = "celery_delayed.store"


def _facets() -> list[type]:
    from celery_delayed.store.facet import Facet

    def subclasses(cls: type) -> list[type]:
        return [c for sub in cls.__subclasses__() for c in (sub, *subclasses(sub))]

    import celery_delayed.store.gateway  # noqa: F401  (imports every facet)

    return [c for c in subclasses(Facet) if c.__module__.startswith("celery_delayed.")]  # (not a test's subclass)


def test_the_facets_scripts_are_exactly_the_files_of_lua():
    from celery_delayed.store.loader import lua_dir

    declared: list[str] = [name for facet in _facets() for name in facet.SCRIPTS]  # type: ignore[attr-defined]
    assert len(declared) == len(set(declared)), f"a script declared by two facets: {sorted(declared)}"
    assert set(declared) == {p.stem for p in lua_dir().glob("*.lua")}


def test_each_script_is_run_by_the_one_facet_method_of_its_name():
    """A ``scripts.<name>`` reference stands only in the method ``<name>`` (or its private part ``_<name>``)
    of the facet that declares ``<name>``; nothing outside the facets names a script (the runner only loads
    one to ask the server whether it takes script flags)."""
    owners = {name: facet for facet in _facets() for name in facet.SCRIPTS}  # type: ignore[attr-defined]
    seen: dict[str, set[str]] = {}
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)] + [tree]:  # type: ignore[list-item]
            body = cls.body
            for fn in [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                for n in ast.walk(fn):
                    if not (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                            and n.value.attr == "scripts" and not n.attr.startswith("_")):
                        continue
                    if n.attr in ("all", "names"):
                        continue
                    where = f"{name}.{getattr(cls, 'name', '<module>')}.{fn.name}"
                    if name == f"{STORE}.runner":
                        assert fn.name == "scripts", where  # the flags probe
                        continue
                    owner = owners.get(n.attr)
                    assert owner is not None, f"{where} runs {n.attr!r}, which no facet declares"
                    assert isinstance(cls, ast.ClassDef) and cls.name == owner.__name__ \
                        and owner.__module__ == name, f"{where} runs {n.attr}.lua, which is {owner.__name__}'s"
                    assert fn.name in (n.attr, f"_{n.attr}"), f"{where} runs {n.attr}.lua: only {n.attr}() may"
                    seen.setdefault(n.attr, set()).add(fn.name)
    assert set(seen) == set(owners), f"declared but never run: {sorted(set(owners) - set(seen))}"
    for script, facet in owners.items():
        assert callable(getattr(facet, script, None)), f"{facet.__name__} has no method {script}()"


def test_nothing_outside_the_store_layer_imports_the_runner():
    graph = _graph()
    for name, deps in graph.items():
        if not name.startswith(STORE):
            assert f"{STORE}.runner" not in deps, name


#: Private attributes of other libraries' objects that the package reads, each for a reason.
_UPSTREAM_PRIVATE = {
    ("celery_delayed.producer.message", "registry._encoders"): "kombu's encoder table: the serializer's own dumps",
    ("celery_delayed.producer.template", "registry._encoders"): "kombu's encoder table: the serializer's own dumps",
    ("celery_delayed.result", "current_app._get_current_object"): "Celery's app proxy: the app it stands for",
    ("celery_delayed.contrib.django.admin.base", "current_app._get_current_object"):
        "Celery's app proxy: the app the Django project set up",
    ("celery_delayed.worker.backoff", "random._inst"): "the random module's own generator (seeded by tests)",
    ("celery_delayed.worker.tracking", "task._get_app"): "a Celery task's app without binding it",
    ("celery_delayed.cancellation", "revoke._celery_delayed"): "our own mark on Celery's revoke, once patched",
}


def test_no_module_reads_another_objects_private_attribute():
    """``x._name`` only on ``self``/``cls`` (and the listed upstream internals; the fixups patch upstream
    internals by design, each documented in its module)."""
    found = []
    used: set[tuple[str, str]] = set()
    for name, path in _modules().items():
        if name.startswith("celery_delayed.fixups"):
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            v = n.value
            if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                continue
            if (name, ast.unparse(n)) in _UPSTREAM_PRIVATE:
                used.add((name, ast.unparse(n)))
            else:
                found.append(f"{name}:{n.lineno}: {ast.unparse(n)}")
    assert not found, found
    assert used == set(_UPSTREAM_PRIVATE), f"listed but no longer read: {set(_UPSTREAM_PRIVATE) - used}"


def test_every_public_method_of_a_facet_raises_the_packages_errors():
    """Redis errors become StoreUnavailable / StoreFull at every facet's boundary (Facet.__init_subclass__)."""
    import inspect

    for facet in _facets():
        for name, fn in vars(facet).items():
            if not name.startswith("_") and inspect.isfunction(fn):
                assert hasattr(fn, "__wrapped__"), f"{facet.__name__}.{name} lets redis-py's errors through"
