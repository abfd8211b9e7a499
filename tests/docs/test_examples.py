"""Every Python example of the documentation runs: README.md and docs/**/*.md, through Sybil.

One test per page. Its examples run in order, in one namespace, in a folder of their own (the
page's "project", on ``sys.path`` and the working directory) against a private redis-server:

- a block whose first line is a file name comment (``# tasks.py``, ``# test_trials.py``) is that
  file: it is written into the project, and a later block imports it as a reader would
  (``from tasks import remind``); the page's ``test_*.py`` files are run by pytest at its end, and
  must pass;
- any other ``python`` block runs as it is; one that starts with ``>>>`` is a doctest;
- ``redis://127.0.0.1:6379/0``, the local Redis a reader starts, is this test's private server;
- ``% skip: next`` (``<!-- skip: next -->`` in the README) marks the few illustrative fragments
  that cannot run here (another broker, a cluster's addresses); ``% invisible-code-block: python``
  runs setup code a page does not show.

Shell commands (``console`` blocks) are not run here; ``tests/docs/test_quickstart.py`` runs the
Quickstart's, with a real worker and scheduler.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_delayed.testing import RedisServer

try:
    from sybil import Document, Example, Sybil
    from sybil.evaluators.python import pad
    from sybil.parsers.myst import CodeBlockParser, PythonCodeBlockParser, SkipParser
except ImportError:  # pragma: no cover - the docs extra is missing
    if os.environ.get("CI"):
        raise
    pytest.skip("the docs examples need sybil: pip install -e '.[docs]'", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
LOCAL_REDIS = "redis://127.0.0.1:6379/0"
FILE_COMMENT = re.compile(r"#\s*([\w./-]+\.py)\s*$")


def pages() -> list[Path]:
    """The README and every page of the site."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", *docs]


class Project:
    """A page's folder of files, its Redis, and the evaluator of its Python blocks."""

    def __init__(self, root: Path, redis_url: str) -> None:
        self.root = root
        self.redis_url = redis_url
        self.tests: list[Path] = []  # test files the page wrote: run by pytest once the page is done

    def source(self, example: Example) -> str:
        return str(example.parsed).replace(LOCAL_REDIS, self.redis_url)

    def __call__(self, example: Example) -> None:
        __tracebackhide__ = True
        source = self.source(example)
        first = source.lstrip().splitlines()[0] if source.strip() else ""
        m = FILE_COMMENT.match(first)
        if m:
            self.write(m.group(1), source)
            return
        code = compile(pad(source, example.line + example.parsed.line_offset), example.path, "exec",
                       dont_inherit=True)
        exec(code, example.namespace)
        example.namespace.pop("__builtins__", None)

    def write(self, name: str, source: str) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        self.forget_modules()  # a file written again is imported anew
        if path.name.startswith("test_") and path not in self.tests:
            self.tests.append(path)

    def run_tests(self) -> None:
        """Run the page's test files with pytest (one process for them all); they must pass."""
        if not self.tests:
            return
        env = dict(os.environ, DELAYED_TEST_REDIS_URL=self.redis_url,
                   PYTHONPATH=os.pathsep.join([str(self.root), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, self.tests)],
                              cwd=self.root, env=env, capture_output=True, text=True, timeout=120)
        names = ", ".join(p.name for p in self.tests)
        assert done.returncode == 0, f"pytest {names} failed:\n{done.stdout}\n{done.stderr}"

    def forget_modules(self) -> None:
        root = str(self.root)
        for name, module in list(sys.modules.items()):
            if (getattr(module, "__file__", None) or "").startswith(root):
                del sys.modules[name]


def _parsers(project: Project) -> list[Any]:
    python = PythonCodeBlockParser()
    python.codeblock_parser = CodeBlockParser("python", project)
    return [python, SkipParser()]


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(page: Path, redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Python example of the page runs, in order, as a reader would run it."""
    import redis as redis_py

    redis_py.Redis.from_url(redis.url).flushall()  # this test's own server: each page starts empty
    project = Project(tmp_path, redis.url)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from celery import _state

    current, finalizers = _state.get_current_app(), set(_state._on_app_finalizers)
    document: Document = Sybil(parsers=_parsers(project)).parse(page)
    document.namespace["__name__"] = "__main__"
    try:
        for example in document.examples():
            try:
                example.evaluate()
            except Exception as exc:
                raise AssertionError(f"{page.relative_to(ROOT)}, line {example.line}: {exc!r}") from exc
        project.run_tests()
    finally:
        project.forget_modules()
        # what a page's apps left in Celery's process-wide state does not reach the next page or test:
        # the current app, and its shared tasks (Celery adds them to every app made later)
        _state._set_current_app(current)
        _state._on_app_finalizers.intersection_update(finalizers)
