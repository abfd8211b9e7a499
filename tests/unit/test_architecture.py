"""The package's shape: no import cycles, only the store layer talks to Redis, no side effects at import."""

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
    """Package modules ``name`` imports at module level (TYPE_CHECKING blocks left out)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    deps: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
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


def test_layers_point_one_way():
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("celery_delayed.store"):
            assert not {d for d in deps if d.split(".")[1] in ("producer", "worker", "scheduler", "cli", "api")}, name
        if not name.startswith("celery_delayed.cli"):
            assert not {d for d in deps if d.startswith("celery_delayed.cli")}, name


def test_only_the_store_layer_runs_scripts_or_touches_redis():
    for name, path in _modules().items():
        if name.startswith(("celery_delayed.store", "celery_delayed.testing")):
            continue
        # these two work inside kombu's Redis broker transport (its QoS, its redis-py errors), not on the store
        if name in ("celery_delayed.worker.kombu_fixes", "celery_delayed.worker.held_restore"):
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
