"""A real Prometheus for the end-to-end suite, and what the tests read from packaging/.

:func:`start_prometheus` runs ``/usr/bin/prometheus`` (Debian's ``prometheus`` package) on
loopback with a temporary configuration: the services as targets of the job the alert
rules name, ``packaging/alerts.yml`` as its rules, a TSDB in the test's directory.
:class:`Prometheus` is a client of its HTTP API. :func:`dashboard_targets` lists every
query of the Grafana dashboard with its template variables replaced, as Grafana would send
it.
"""

from __future__ import annotations

import asyncio
import math
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest
import yaml

from tests import helpers
from tests.e2e.harness import E2E, Service
from tests.helpers import free_port

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"
ALERT_RULES = PACKAGING / "alerts.yml"
DASHBOARD = PACKAGING / "grafana" / "cleanup-supervisor.json"
# The scrape job the alert rules select (`up{job=...}`): alerts.yml's header names it.
JOB = "cleanup-supervisor"
SCRAPE_S = 1.0
READY_TIMEOUT_S = 30.0
# The dashboard row whose panels exist only with the PostgreSQL ledger (replicas).
REPLICAS_ROW = "Replicas (ledger.backend = postgres)"

T = TypeVar("T")


def binary(name: str) -> str:
    """The path of a Prometheus program, or a skip saying how to get it."""
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not found: apt-get install prometheus (Debian's package; "
                    ".ci/run installs it)")
    return found


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule of packaging/alerts.yml: name, expr, for."""
    doc = yaml.safe_load(ALERT_RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


# Prometheus's samples and the gauges it scrapes have no event to await: poll each 100 ms
# until the deadline, a server not listening yet counting as "not yet".
eventually = partial(helpers.eventually, every_s=0.1, ignoring=(aiohttp.ClientError, OSError))


@dataclass(frozen=True)
class Sample:
    value: float
    at: float  # the scrape's timestamp, Unix seconds


class Prometheus:
    def __init__(self, url: str, proc: asyncio.subprocess.Process, log: Path,
                 http: aiohttp.ClientSession) -> None:
        self.url = url
        self.proc = proc
        self.log = log
        self._http = http

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    async def answer(self, path: str, **params: str) -> dict[str, Any]:
        """GET an API path: Prometheus's whole answer, an error included."""
        async with self._http.get(f"{self.url}{path}", params=params) as resp:
            return dict(orjson.loads(await resp.read()))

    async def api(self, path: str, **params: str) -> Any:
        """GET an API path; a failed query fails the test with Prometheus's error."""
        doc = await self.answer(path, **params)
        assert doc["status"] == "success", (path, params, doc)
        return doc["data"]

    async def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        return list((await self.api("/api/v1/query", **params))["result"])

    async def query_range(self, expr: str, start: float, end: float,
                          step_s: float = SCRAPE_S) -> list[dict[str, Any]]:
        data = await self.api("/api/v1/query_range", query=expr, start=f"{start:.3f}",
                              end=f"{end:.3f}", step=f"{step_s}s")
        return list(data["result"])

    async def value(self, expr: str, at: float | None = None) -> float | None:
        """The value of a one-series instant vector; None when it has no series."""
        result = await self.query(expr, at)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    async def sample(self, selector: str) -> Sample | None:
        """The latest scraped sample of one series, with its scrape's timestamp."""
        result = await self.query(f"{selector}[{3 * SCRAPE_S:g}s]")
        if not result:
            return None
        assert len(result) == 1, (selector, result)
        t, v = result[0]["values"][-1]
        return Sample(float(v), float(t))


async def start_prometheus(e2e: E2E, services: Sequence[Service],
                           bearer: str | None = None) -> Prometheus:
    """Prometheus on a free loopback port scraping ``services`` every second under the
    job the alert rules name, evaluating those rules every second; ready on return.
    ``bearer``: the token its scrapes send (service.metrics_token_env)."""
    program = binary("prometheus")
    root = e2e.tmp_path / "prometheus"
    root.mkdir()
    config = {
        "global": {"scrape_interval": f"{SCRAPE_S:g}s", "scrape_timeout": f"{SCRAPE_S:g}s",
                   "evaluation_interval": f"{SCRAPE_S:g}s"},
        "rule_files": [str(ALERT_RULES)],
        "scrape_configs": [{"job_name": JOB, "static_configs": [
            {"targets": [f"127.0.0.1:{svc.port}" for svc in services]}]}],
    }
    if bearer is not None:  # what packaging/compose-prometheus.yml shows, commented
        config["scrape_configs"][0]["authorization"] = {"type": "Bearer",
                                                        "credentials": bearer}
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = root / "prometheus.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            program, f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn", stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out)
    e2e.processes.add(proc)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log, e2e.http)

    async def ready() -> bool | None:
        assert proc.returncode is None, f"prometheus exited ({proc.returncode}):\n{prom.tail()}"
        async with e2e.http.get(f"{prom.url}/-/ready") as resp:
            return True if resp.status == 200 else None

    await eventually(ready, READY_TIMEOUT_S, "prometheus ready")
    return prom


# -- the dashboard ---------------------------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    title: str
    row: str
    expr: str  # as Grafana sends it: template variables replaced


def _panels(panels: Sequence[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(row title, panel) in the dashboard's order: an open row holds the panels below
    it up to the next row; a collapsed one keeps its panels inside."""
    row = ""
    for panel in sorted(panels, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        if panel["type"] == "row":
            row = panel["title"]
            for inner in panel.get("panels", []):
                yield row, inner
        else:
            yield row, panel


def dashboard_targets(rate_interval_s: float, range_s: float) -> list[PanelQuery]:
    """Every target of every panel. ``$instance`` takes its All value (the regex ``.*``);
    ``$__rate_interval`` what Grafana computes for this Prometheus (at least four scrape
    intervals), ``$__range`` the run's span. A variable left over fails the test."""
    doc = orjson.loads(DASHBOARD.read_bytes())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    values = {
        "instance": variables["instance"]["allValue"],
        "__rate_interval": f"{math.ceil(rate_interval_s)}s",
        "__interval": f"{SCRAPE_S:g}s",
        "__range": f"{math.ceil(range_s)}s",
    }
    out = []
    for row, panel in _panels(doc["panels"]):
        assert panel.get("targets"), f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            expr = re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m[1], m[0]), target["expr"])
            assert "$" not in expr, f"panel {panel['title']!r}: unknown variable in {expr}"
            out.append(PanelQuery(panel["title"], row, expr))
    return out
