"""The exporter serves the families the contract names; the Grafana dashboard uses only metrics it serves.

The docs' metrics page is generated from :data:`celery_delayed.metrics.FAMILIES` (docs/_ext/delayed_docs.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from celery_delayed.metrics import FAMILIES, PREFIX

ROOT = Path(__file__).resolve().parents[2]


def test_contract_families_are_served():
    names = {PREFIX + n for n, *_ in FAMILIES}
    assert {"celery_delayed_pending_jobs", "celery_delayed_released_total",
            "celery_delayed_release_lateness_seconds", "celery_delayed_start_lateness_seconds"} <= names


def test_grafana_dashboard_uses_served_metrics():
    served = {PREFIX + n for n, *_ in FAMILIES}
    served |= {n + s for n in served for s in ("_bucket", "_sum", "_count")}
    dash = json.loads((ROOT / "example_project" / "grafana" / "celery-delayed.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"celery_delayed_[a-z_]+", t["expr"])}
    assert used and used <= served, used - served
