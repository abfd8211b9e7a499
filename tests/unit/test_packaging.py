"""The built wheel, installed in a fresh venv, ships and finds its Lua scripts and py.typed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from celery_delayed.store.loader import scripts

ROOT = Path(__file__).resolve().parents[2]

# Runs inside the venv, from a folder outside the repository: it must import
# the installed package, find the Lua scripts inside it, and run them.
SNIPPET = r"""
import json, sys, uuid
from pathlib import Path
import celery_delayed
from celery import Celery
from celery_delayed import get_store
from celery_delayed.producer.prepare import prepare
from celery_delayed.store.loader import lua_dir, scripts

pkg = Path(celery_delayed.__file__).resolve().parent
app = Celery("pkgtest", broker=sys.argv[1], set_as_current=False)
uid = uuid.uuid4().hex[:10]
app.conf.update(delayed_key_prefix="pkg" + uid, task_default_queue="q" + uid)
store = get_store(app)
job = prepare(app, store, "pkg.noop", (1,), {}, 0, task_id="job-" + uid).job
scheduled = store.jobs.schedule([job], now_ms=1_000)[0]
batch = store.release.release_due(job.shard, now_ms=2_000)
client = store.redis.client
print(json.dumps({
    "package": str(pkg),
    "lua_dir": str(lua_dir()),
    "py_typed": (pkg / "py.typed").is_file(),
    "scripts": sorted(p.name for p in lua_dir().glob("*.lua")),
    "includes": sorted(p.name for p in (lua_dir() / "includes").glob("*.lua")),
    "shas": {s.name: s.sha for s in scripts().all()},
    "created": scheduled.created,
    "released": batch.ids,
    "queued": client.llen("q" + uid),
    "state": store.lookup.get(job.id, job.shard)["st"],
    "web_assets": sorted(str(p.relative_to(pkg / "web")) for p in (pkg / "web").rglob("*.*")
                         if p.suffix in (".css", ".html")),
}))
"""


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _build_wheel(out: Path) -> Path:
    if importlib.util.find_spec("hatchling") is not None:
        # No build isolation: no network needed (hatchling is in the test extra).
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)]
    else:
        cmd = [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)]
    _run(cmd, out, 150)
    wheels = list(out.glob("celery_delayed-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _see_running_packages(py: Path) -> None:
    """Let the venv import the running interpreter's dependencies (Celery, redis-py), after its own.

    ``system_site_packages=True`` would mean the *base* interpreter's packages, which lack Celery when
    the suite runs from a virtualenv. A ``.pth`` line naming each of this interpreter's site-packages
    folders appends them to the venv's ``sys.path`` (without running their own ``.pth`` files, so the
    checkout's editable install is not seen: the wheel installed in the venv is what gets imported).
    """
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    assert ours, f"no site-packages folder on this interpreter's sys.path: {sys.path}"
    (Path(purelib) / "_running_interpreter.pth").write_text("\n".join(ours) + "\n")


@pytest.mark.timeout(240)
def test_installed_wheel_finds_its_lua_scripts(tmp_path: Path, redis_url: str) -> None:
    wheel = _build_wheel(tmp_path)

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    _see_running_packages(py)
    # The venv gets no pip of its own (no network, faster): the system pip,
    # run by the venv's interpreter (or told --python), installs into it.
    has_pip = subprocess.run([str(py), "-m", "pip", "--version"], capture_output=True).returncode == 0
    pip = [str(py), "-m", "pip"] if has_pip else [sys.executable, "-m", "pip", "--python", str(py)]
    _run([*pip, "install", "--no-deps", "--no-index", "--ignore-installed", str(wheel)], tmp_path, 120)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    proc = _run([str(py), "-I", "-c", SNIPPET, redis_url], outside, 60)
    info = json.loads(proc.stdout.strip().splitlines()[-1])

    pkg = Path(info["package"])
    assert env_dir.resolve() in pkg.parents, f"imported {pkg}, not the venv's installed copy"
    assert "site-packages" in pkg.parts
    assert ROOT not in pkg.parents
    assert Path(info["lua_dir"]) == pkg / "lua"
    assert info["py_typed"] is True
    assert {"schedule.lua", "release_due.lua", "claim_due.lua", "cancel.lua"} <= set(info["scripts"])
    # Every script and every include of the repository is in the wheel, and each script the
    # installed package loads (includes inlined) is byte for byte the repository's (same SHA).
    assert info["scripts"] == sorted(p.name for p in (ROOT / "lua").glob("*.lua"))
    assert info["includes"] == sorted(p.name for p in (ROOT / "lua" / "includes").glob("*.lua"))
    assert len(info["includes"]) >= 5
    assert info["shas"] == {s.name: s.sha for s in scripts().all()}
    assert sorted(f"{name}.lua" for name in info["shas"]) == info["scripts"]
    assert info["created"] is True
    assert len(info["released"]) == 1 and info["queued"] == 1
    assert info["state"] == "QUEUED"
    # the dashboard's template and stylesheet ship in the wheel (no CDN)
    assert info["web_assets"] == ["static/app.css", "templates/base.html"]


@pytest.mark.timeout(240)
def test_build_makes_a_wheel_and_sdist_that_twine_accepts(tmp_path: Path) -> None:
    """``python -m build`` and ``twine check`` pass; the wheel holds the package's data and no tests."""
    import zipfile

    _run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(tmp_path), str(ROOT)],
         tmp_path, 200)
    wheels = list(tmp_path.glob("celery_delayed-*.whl"))
    sdists = list(tmp_path.glob("celery_delayed-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in tmp_path.iterdir())
    proc = _run([sys.executable, "-m", "twine", "check", "--strict", str(wheels[0]), str(sdists[0])], tmp_path, 60)
    assert proc.stdout.count("PASSED") == 2, proc.stdout

    import celery_delayed

    assert wheels[0].name.startswith(f"celery_delayed-{celery_delayed.__version__}-")
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "celery_delayed/py.typed" in names
    assert "celery_delayed/lua/release_due.lua" in names
    assert "celery_delayed/web/static/app.css" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "example_project/"))], names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith("/LICENSE") for n in names), names
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheels[0]).read(meta).decode()
    assert "Project-URL: Documentation," in text and "Framework :: Celery" in text
