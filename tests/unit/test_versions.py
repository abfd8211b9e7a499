"""The supported versions are stated in three places that must agree: the ranges in
``pyproject.toml``, the pins the matrix installs (``noxfile.py``) and the table on the
docs site (``docs/reference/versions.md``). The matrix tests the ends of each range;
these tests make sure those ends are the declared ones.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PAGE = (ROOT / "docs" / "reference" / "versions.md").read_text()


def _noxfile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("noxfile", ROOT / "noxfile.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NOX = _noxfile()


def _declared_text() -> dict[str, str]:
    """Each declared requirement as pyproject.toml writes it, by name."""
    texts = [*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["django"]]
    return {Requirement(t).name: t for t in texts}


def _declared() -> dict[str, Requirement]:
    return {name: Requirement(text) for name, text in _declared_text().items()}


def _pinned(bound: str) -> dict[str, str]:
    """The version each pin of ``bound`` names (``"5.7.*"`` -> ``"5.7"``)."""
    pins = {}
    for text in NOX.PINS[bound]:
        req = Requirement(text)
        (spec,) = req.specifier
        assert spec.operator == "==", text
        pins[req.name] = spec.version.removesuffix(".*")
    return pins


def _next_release(version: str) -> str:
    """The release after the series ``version`` names: ``"5.7"`` -> ``"5.8"``, ``"8"`` -> ``"9"``."""
    parts = [int(p) for p in version.split(".")]
    parts[-1] += 1
    return ".".join(map(str, parts))


@pytest.mark.parametrize("name", ["celery", "kombu", "redis", "django"])
def test_the_matrix_pins_the_ends_of_each_declared_range(name):
    declared = _declared()[name].specifier
    lowest, highest = _pinned("lowest")[name], _pinned("highest")[name]
    floor = next(s.version for s in declared if s.operator == ">=")
    assert Version(lowest) == Version(floor), f"{name}: the matrix's lowest {lowest} is not the declared floor {floor}"
    assert Version(highest) in declared, f"{name}: the matrix's highest {highest} is outside {declared}"
    assert Version(_next_release(highest)) not in declared, (
        f"{name}: {declared} admits {_next_release(highest)}, which the matrix does not install")


def test_every_declared_dependency_is_in_the_matrix():
    assert set(_declared()) == set(_pinned("lowest")) == set(_pinned("highest"))


def test_the_matrix_runs_the_oldest_and_newest_declared_python():
    classified = sorted((c.rsplit(" ", 1)[1] for c in PROJECT["classifiers"]
                         if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)), key=Version)
    assert SpecifierSet(PROJECT["requires-python"]) == SpecifierSet(f">={classified[0]}")
    assert NOX.PYTHONS[0] == classified[0] and NOX.PYTHONS[-1] == classified[-1]
    # every Python the classifiers name runs something: the matrix, or the whole suite (3.11)
    assert set(classified) <= {*NOX.PYTHONS, "3.11"}


@pytest.mark.parametrize("name", ["celery", "kombu", "redis", "django"])
def test_the_docs_table_states_the_declared_range_and_its_ends(name):
    row = next(line for line in PAGE.splitlines() if f"`{_declared_text()[name]}`" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert Version(cells[1]) == Version(_pinned("lowest")[name]), row
    assert cells[2] == _pinned("highest")[name], row


def test_the_docs_table_states_the_pythons():
    row = next(line for line in PAGE.splitlines() if line.startswith("| Python "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:] == [NOX.PYTHONS[0], NOX.PYTHONS[-1], f"`{PROJECT['requires-python']}`"]
