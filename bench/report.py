"""Write the results: a table on stdout, ``results/latest.md``, ``latest.json`` and a lateness plot."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from .common import ROOT, Ctx, pct

RESULTS = Path(__file__).resolve().parent / "results"


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for mod in ("celery", "kombu", "redis", "rq", "dramatiq", "arq", "psycopg"):
        try:
            out[mod] = str(__import__(mod).__version__)
        except Exception:
            out[mod] = "-"
    try:
        out["redis-server"] = subprocess.run(["redis-server", "--version"], capture_output=True, text=True,
                                             check=False).stdout.split()[2].removeprefix("v=")
    except (OSError, IndexError):
        out["redis-server"] = "?"
    return out


def machine() -> str:
    """CPU model, core count and memory of this machine."""
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError):
        mem_kb = 0
    return f"{model}, {os.cpu_count()} cores, {mem_kb / 1024 / 1024:.1f} GB RAM"


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    if v != v:  # NaN
        return "n/a"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:,.2f}"
    return f"{v:.3g}"


def table(ctx: Ctx) -> str:
    """The results as one Markdown table."""
    lines = ["| scenario | system | metric | value | unit | ratio | vs | note |",
             "|---|---|---|---:|---|---:|---|---|"]
    for r in ctx.rows:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
        lines.append(f"| {r.scenario} | {r.system} | {r.metric} | {_fmt(r.value)} | {r.unit} | {ratio} | "
                     f"{r.reference} | {r.note} |")
    return "\n".join(lines)


def write(ctx: Ctx, scenarios: list[str], elapsed_s: float, name: str = "latest") -> None:
    """Print the table and write <name>.md, <name>.json (default latest) and the lateness plot.

    The plot is ``lateness.png`` for the default name and ``<name>-lateness.png``
    otherwise, so a named run (an A/B, a repeat) leaves the full run's plot alone.
    """
    RESULTS.mkdir(exist_ok=True)
    png = "lateness.png" if name == "latest" else f"{name}-lateness.png"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    versions = _versions()
    head = [
        f"# celery-delayed benchmark results ({'quick' if ctx.quick else 'full'} run)",
        "",
        f"- date: {stamp}; run time {elapsed_s:.0f} s; scenarios: {', '.join(scenarios)}",
        f"- machine: {machine()} (shared with other work: compare ratios, not absolute figures); "
        f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in versions.items())}",
        f"- command: `python -m bench {' '.join(scenarios) if scenarios else 'all'}{' --quick' if ctx.quick else ''}`",
        "",
    ]
    body = table(ctx)
    notes = [f"- {n}" for n in ctx.notes]
    text = "\n".join([*head, body, "", "## Notes", "", *notes, "",
                      f"![lateness]({png})" if ctx.lateness else "", ""])
    print("\n" + body + "\n" + "\n".join(notes), flush=True)
    (RESULTS / f"{name}.md").write_text(text)
    data: dict[str, Any] = {
        "date": stamp, "quick": ctx.quick, "elapsed_s": elapsed_s, "machine": machine(), "versions": versions,
        "rows": [dataclasses.asdict(r) for r in ctx.rows], "notes": ctx.notes,
        "lateness": {k: {"n": len(v), "p50": pct(v, 50), "p99": pct(v, 99), "max": max(v) if v else None}
                     for k, v in ctx.lateness.items()},
    }
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    if ctx.lateness:
        plot(ctx.lateness, RESULTS / png)
    print(f"\nwrote {(RESULTS / f'{name}.md').relative_to(ROOT)}, {name}.json"
          f"{', ' + png if ctx.lateness else ''}", flush=True)


def plot(lateness: dict[str, list[float]], path: Path) -> None:
    """Empirical CDFs of task start - due time, one line per system and scenario (log x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    for label, values in sorted(lateness.items()):
        if not values:
            continue
        xs = sorted(max(v, 1e-4) * 1000 for v in values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{label} (p50 {pct(values, 50) * 1000:.0f} ms, "
                                            f"p99 {pct(values, 99) * 1000:.0f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("lateness: task start - due time (ms, log scale; <0.1 ms drawn at 0.1)")
    ax.set_ylabel("fraction of tasks")
    ax.set_title("Lateness distributions (empirical CDF)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
