"""The Grafana dashboard and its provisioning, read as Grafana and compose would read them.

No Grafana runs here: these hold the files to each other (the scrape job the alerts name,
the directory compose mounts the dashboard into, the Prometheus it points at) and to the
description in docs/dashboard.md. tests/e2e/test_prometheus.py runs every query against a
real Prometheus.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"
GRAFANA = PACKAGING / "grafana"
DASHBOARD = GRAFANA / "cleanup-supervisor.json"


def _dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def _panels() -> list[dict[str, Any]]:
    out = []
    for panel in _dashboard()["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # inside a collapsed row
    return out


def _job() -> str:
    [job] = [c["job_name"] for c in
             yaml.safe_load((PACKAGING / "compose-prometheus.yml").read_text())["scrape_configs"]]
    return str(job)


def test_every_query_selects_the_job_the_alerts_and_prometheus_name() -> None:
    job = _job()
    rules = (PACKAGING / "alerts.yml").read_text()
    assert f'up{{job="{job}"}}' in rules
    for panel in _panels():
        for target in panel.get("targets", []):
            assert f'job="{job}"' in target["expr"], (panel["title"], target["expr"])


def test_panels_are_whole_and_told_apart() -> None:
    panels = _panels()
    ids = Counter(p["id"] for p in panels)
    assert [i for i, n in ids.items() if n > 1] == []
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel.get("description"), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs, panel["title"]
        assert len(refs) == len(set(refs)), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["instance"]["includeAll"]
    assert variables["instance"]["allValue"] == ".*"


def test_provisioning_loads_the_dashboard_compose_mounts_from_the_prometheus_it_runs() -> None:
    compose = yaml.safe_load((PACKAGING / "compose.yaml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = {}
    for volume in grafana["volumes"]:
        source, _, target = volume.partition(":")
        mounts[(PACKAGING / source).resolve()] = PurePosixPath(target.split(":")[0])
    for source in mounts:
        if source.suffix:  # bind mounts of files in the repository, not named volumes
            assert source.exists(), source
    provider_dir = mounts[(GRAFANA / "provisioning" / "dashboards.yml").resolve()].parent
    assert provider_dir == PurePosixPath("/etc/grafana/provisioning/dashboards")
    sources_dir = mounts[(GRAFANA / "provisioning" / "datasources.yml").resolve()].parent
    assert sources_dir == PurePosixPath("/etc/grafana/provisioning/datasources")
    [provider] = yaml.safe_load((GRAFANA / "provisioning" / "dashboards.yml").read_text())[
        "providers"]
    assert mounts[DASHBOARD.resolve()].parent == PurePosixPath(provider["options"]["path"])
    [source] = yaml.safe_load((GRAFANA / "provisioning" / "datasources.yml").read_text())[
        "datasources"]
    prometheus = compose["services"]["prometheus"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    assert "prometheus" in grafana["depends_on"]
    assert any(p.endswith(":9090") for p in prometheus["ports"])
    # $__rate_interval spans four scrapes only if Grafana knows the scrape interval.
    scrape = yaml.safe_load((PACKAGING / "compose-prometheus.yml").read_text())["global"][
        "scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape


def test_docs_describe_every_panel() -> None:
    docs = (ROOT / "docs" / "dashboard.md").read_text()
    missing = [p["title"] for p in _panels() if f"## {p['title']}\n" not in docs]
    assert missing == []
    for panel in _panels():
        for target in panel.get("targets", []):
            assert target["expr"] in docs, (panel["title"], target["expr"])


def test_the_operations_guide_names_the_job_the_rules_select() -> None:
    # An operator names the scrape job from the docs: a rename in the rules must reach them.
    job = _job()
    guide = (PACKAGING.parent / "docs" / "operations.md").read_text()
    assert f"**The Prometheus scrape job must be named `{job}`**" in guide
    assert f'`job="{job}"`' in guide
