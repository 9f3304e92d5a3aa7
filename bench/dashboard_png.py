"""docs/dashboard.png: the Grafana dashboard's panels, drawn from a real run.

Grafana is not packaged for Debian, so no screenshot can be taken here. Instead: a real
Prometheus (/usr/bin/prometheus, Debian's 2.42) scrapes ``supervisor serve`` every second
while it drains a sandbox partner (2,500 recipients, a partner allowing 50/s under a
ceiling of 100/s, a 429 storm, the partner's limit lowered then raised above it, a webhook outage
and a stretch of 5xx answers); then every target of every panel of
packaging/grafana/cleanup-supervisor.json is sent to that Prometheus as Grafana would send
it (``/api/v1/query_range``, template variables replaced as tests/e2e/test_prometheus.py
replaces them) and drawn in the JSON's grid layout by bench/dashboard_draw.py. One line
per panel is printed: its title, the number of series and their last values.

Usage: .venv/bin/python bench/dashboard_png.py [--out docs/dashboard.png] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import secrets
import shutil
import subprocess
import tempfile
import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from cleanup_sandbox.sink import WebhookSink
from dashboard_draw import PanelData, Series, draw_dashboard, summary_line
from paths import OUT, PY, REPO, log_path
from processes import Partner, Service, clean_env, dump_toml, free_port, stop_process

DASHBOARD = REPO / "packaging" / "grafana" / "cleanup-supervisor.json"
ALERT_RULES = REPO / "packaging" / "alerts.yml"
JOB = "cleanup-supervisor"  # the scrape job alerts.yml and the dashboard select
SCRAPE_S = 1.0
# Grafana's $__rate_interval: max($__interval + the scrape interval, 4 scrape intervals),
# the value tests/e2e/test_prometheus.py sends.
RATE_INTERVAL_S = 4 * SCRAPE_S

RECIPIENTS = 2500
PARTNER_RATE = 50.0
PARTNER_BURST = 5.0
CEILING = 100.0
CONCURRENCY = 8
LATENCY_MS = 25.0
# Close enough to the drain that both lines of "Projected finish against the digest
# cutoff" share one readable axis; far enough that the run makes it.
DIGEST_CUTOFF_S = 150.0
# A quota the run visibly spends (about a third of it) without ever running out.
QUOTA = {"name": "hour", "limit": 10000, "period_seconds": 3600.0}


@dataclass(frozen=True)
class Event:
    at_s: float  # after the trigger
    what: str
    partner: dict[str, float] = field(default_factory=dict)
    sink_down: bool | None = None  # the webhook starts (True) or stops (False) refusing


# What happens to the partner and the sink during the drain, so the graphs show the
# limiter and the relay reacting rather than a flat line.
TIMELINE = (
    Event(12, "429 storm for 4 s", partner={"pause_seconds": 4.0}),
    Event(24, "partner limit 50 -> 30/s", partner={"rate_per_second": 30.0}),
    Event(28, "webhook answers 503", sink_down=True),
    Event(34, "partner limit 30 -> 70/s", partner={"rate_per_second": 70.0}),
    Event(36, "5% of DELETEs answer 503", partner={"fault_5xx": 0.05}),
    Event(38, "webhook back", sink_down=False),
    Event(42, "5xx over", partner={"fault_5xx": 0.0}),
)
RUN_DEADLINE_S = 240.0
ANSWERS = OUT / "dashboard-answers.json"

T = TypeVar("T")


async def eventually(probe: Callable[[], Awaitable[T | None]], within_s: float, what: str,
                     every_s: float = 0.2) -> T:
    """Poll until ``probe`` answers: scrapes and gauges have no event to await."""
    deadline = time.monotonic() + within_s
    last: BaseException | None = None
    while True:
        try:
            found = await probe()
        except (aiohttp.ClientError, OSError) as exc:  # not listening yet
            found, last = None, exc
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{what}: not within {within_s:g} s (last error: {last})")
        await asyncio.sleep(every_s)


# -- Prometheus (tests/e2e/prometheus_harness.py's approach, without pytest) ------------


class Prometheus:
    def __init__(self, url: str, http: aiohttp.ClientSession, log: Path) -> None:
        self.url, self.http, self.log = url, http, log

    async def answer(self, path: str, **params: str) -> dict[str, Any]:
        async with self.http.get(f"{self.url}{path}", params=params) as resp:
            return dict(await resp.json(content_type=None))

    async def api(self, path: str, **params: str) -> Any:
        doc = await self.answer(path, **params)
        if doc.get("status") != "success":
            raise RuntimeError(f"prometheus refused {path} {params}: {doc.get('error')}")
        return doc["data"]

    async def value(self, expr: str) -> float | None:
        result = (await self.api("/api/v1/query", query=expr))["result"]
        return float(result[0]["value"][1]) if result else None

    async def last_scrape(self, selector: str) -> float | None:
        """The timestamp of the latest scraped sample of ``selector``."""
        result = (await self.api("/api/v1/query", query=f"{selector}[{3 * SCRAPE_S:g}s]"))
        rows = result["result"]
        return float(rows[0]["values"][-1][0]) if rows else None


def prometheus_config(root: Path, targets: list[str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    config = {  # JSON is YAML: no YAML writer needed
        "global": {"scrape_interval": f"{SCRAPE_S:g}s", "scrape_timeout": f"{SCRAPE_S:g}s",
                   "evaluation_interval": f"{SCRAPE_S:g}s"},
        "rule_files": [str(ALERT_RULES)],
        "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": targets}]}],
    }
    (root / "prometheus.yml").write_text(json.dumps(config, indent=1))


@contextlib.asynccontextmanager
async def prometheus(root: Path, targets: list[str],
                     http: aiohttp.ClientSession) -> AsyncIterator[Prometheus]:
    """Prometheus on loopback scraping ``targets`` every second as the alert rules' job,
    evaluating packaging/alerts.yml every second; ready on entry."""
    program = shutil.which("prometheus")
    if program is None:
        raise SystemExit("prometheus not found: apt-get install prometheus (Debian's package)")
    prometheus_config(root, targets)
    port = free_port()
    log = log_path("dashboard", "png", "prometheus")
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            program, f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn", stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        prom = Prometheus(f"http://127.0.0.1:{port}", http, log)

        async def ready() -> bool | None:
            if proc.returncode is not None:
                raise RuntimeError(f"prometheus exited {proc.returncode}; see {log}")
            async with http.get(f"{prom.url}/-/ready") as resp:
                return True if resp.status == 200 else None

        await eventually(ready, 30.0, "prometheus ready")
        yield prom
    finally:
        await stop_process(proc, grace_s=10)


# -- the partner and the events sink ----------------------------------------------------


@contextlib.asynccontextmanager
async def partner(http: aiohttp.ClientSession, token: str) -> AsyncIterator[Partner]:
    log = log_path("dashboard", "png", "partner")
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            PY, "-m", "cleanup_sandbox", "--port", "0", "--token-env", "SANDBOX_TOKEN",
            "--recipients", str(RECIPIENTS), "--rate", f"{PARTNER_RATE:g}",
            "--burst", f"{PARTNER_BURST:g}", "--latency-ms", f"{LATENCY_MS:g}",
            stdout=asyncio.subprocess.PIPE, stderr=err, env=clean_env(SANDBOX_TOKEN=token),
            cwd=REPO)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line:
            raise RuntimeError(f"the partner simulator exited {await proc.wait()}; see {log}")
        yield Partner(json.loads(line)["url"], token, http, proc.pid)
    finally:
        await stop_process(proc, grace_s=10)


def service_doc(data_dir: Path, port: int, partner_url: str,
                hook: WebhookSink) -> dict[str, dict[str, Any]]:
    """config/default.toml with the run's shape: every panel's series exists with it."""
    doc: dict[str, dict[str, Any]] = tomllib.loads((REPO / "config/default.toml").read_text())
    doc["service"].update(data_dir=str(data_dir), listen=f"127.0.0.1:{port}",
                          log_level="warning")
    doc["schedule"] = {"name": "bench", "digest_cutoff_seconds": DIGEST_CUTOFF_S}
    doc["source"].update(url=f"{partner_url}/stale-recipients", token_env="CUSTOMER_API_TOKEN")
    doc["partner"].update(base_url=partner_url, request_timeout_seconds=5.0)
    doc["limits"].update(rate_per_second=CEILING, concurrency=CONCURRENCY, quota=[QUOTA])
    doc["events"] = {"poll_interval_seconds": 0.5, "sink": [hook.sink()]}
    return doc


# -- the run ----------------------------------------------------------------------------


@dataclass
class Run:
    opened_at: float = 0.0  # Unix seconds, just before the trigger
    done_at: float = 0.0
    start: float = 0.0  # the queried range
    end: float = 0.0
    applied: list[tuple[float, str]] = field(default_factory=list)  # (Unix s, what)
    counts: dict[str, int] = field(default_factory=dict)
    partner_stats: dict[str, Any] = field(default_factory=dict)
    hook_events: int = 0
    hook_refused: int = 0
    panels: list[PanelData] = field(default_factory=list)


async def drive(events: tuple[Event, ...], t0: float, p: Partner, hook: WebhookSink,
                applied: list[tuple[float, str]]) -> None:
    for event in events:
        await asyncio.sleep(max(0.0, t0 + event.at_s - time.time()))
        if event.partner:
            await p.control(event.partner)
        if event.sink_down is not None:
            hook.down = event.sink_down
        applied.append((time.time(), event.what))


async def record(tmp: Path) -> Run:
    out = Run()
    token = secrets.token_urlsafe(18)
    timeout = aiohttp.ClientTimeout(total=60, connect=5)
    sink = WebhookSink("crm", "DASHBOARD_HOOK_SECRET")
    async with aiohttp.ClientSession(timeout=timeout) as http, sink as hook, \
            partner(http, token) as p:
        port = free_port()
        config = tmp / "service.toml"
        config.write_text(dump_toml(service_doc(tmp / "data", port, p.url, hook)))
        env = clean_env(CUSTOMER_API_TOKEN=token, PYTHONUNBUFFERED="1",
                        **{hook.secret_env: hook.secret})
        svc = Service(http, config, port, REPO, log_path("dashboard", "png", "service"), env)
        # Prometheus first: its first scrape comes ~5 s after it starts (target discovery
        # hands over every 5 s), time the service spends starting.
        async with prometheus(tmp / "prometheus", [f"127.0.0.1:{port}"], http) as prom:
            await svc.start()
            try:
                await eventually(lambda: prom.value(f'cleanup_ready{{job="{JOB}"}} == 1'),
                                 30.0, "the service scraped and ready")
                out.opened_at = time.time()
                run_id = await svc.tick()
                driver = asyncio.create_task(drive(TIMELINE, out.opened_at, p, hook,
                                                   out.applied))
                run = await svc.wait_run(run_id, time.monotonic() + RUN_DEADLINE_S)
                out.done_at = time.time()
                with contextlib.suppress(asyncio.CancelledError):
                    driver.cancel()
                    await driver
                if run["state"] != "done":
                    raise RuntimeError(f"run not done within {RUN_DEADLINE_S:g} s: {run}")
                out.counts = dict(run["counts"])
                out.partner_stats = await p.stats()
                out.hook_events, out.hook_refused = hook.events, hook.refused

                # Past the monitor's next refresh (every second) and a scrape of it, and a
                # $__rate_interval more, so the rates are seen falling back to 0.
                settle = out.done_at + 2.0 + RATE_INTERVAL_S

                async def settled() -> float | None:
                    at = await prom.last_scrape(f'cleanup_ready{{job="{JOB}"}}')
                    return at if at is not None and at >= settle else None

                out.end = await eventually(settled, 30.0, "a scrape after the run")
            finally:
                await svc.stop()
            out.start = out.opened_at - 6.0
            out.panels = await evaluate(prom, out.start, out.end)
    return out


# -- the dashboard's queries -------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def variables(doc: dict[str, Any], range_s: float) -> dict[str, str]:
    """Template variables as Grafana sends them for this run: a query variable with All
    takes its allValue (``$instance`` = ``.*``), as tests/e2e/test_prometheus.py does."""
    values = {"__rate_interval": f"{math.ceil(RATE_INTERVAL_S)}s",
              "__interval": f"{SCRAPE_S:g}s", "__range": f"{math.ceil(range_s)}s",
              "job": JOB}
    for var in doc.get("templating", {}).get("list", []):
        if var.get("type") == "datasource":
            continue
        if var.get("includeAll") and var.get("allValue") is not None:
            values[var["name"]] = var["allValue"]
        else:
            current = var.get("current", {}).get("value")
            if isinstance(current, str) and current:
                values[var["name"]] = current
    return values


def substitute(expr: str, values: dict[str, str], title: str) -> str:
    out = re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m[1], m[0]), expr)
    if "$" in out:
        raise RuntimeError(f"panel {title!r}: a template variable left in {out}")
    return out


def legend_of(fmt: str | None, labels: dict[str, str]) -> str:
    """Grafana's legendFormat; with none, the series as Prometheus names it."""
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), fmt).strip()
    name = labels.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in labels.items() if k != "__name__")
    return f"{name}{{{rest}}}" if rest or not name else name


def layout(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(row title, panel) in the JSON's order; a collapsed row's panels come after it,
    at the grid positions Grafana gives them when it is opened."""
    out: list[tuple[str, dict[str, Any]]] = []
    for panel in doc["panels"]:
        out.append((panel["title"] if panel["type"] == "row" else "", panel))
        out += [("", inner) for inner in panel.get("panels", [])]
    return out


async def evaluate(prom: Prometheus, start: float, end: float) -> list[PanelData]:
    doc = dashboard()
    values = variables(doc, end - start)
    panels: list[PanelData] = []
    for _, panel in layout(doc):
        data = PanelData(panel)
        panels.append(data)
        for target in panel.get("targets", []):
            if target.get("hide"):
                continue
            expr = substitute(target["expr"], values, panel["title"])
            result = await prom.api("/api/v1/query_range", query=expr, start=f"{start:.3f}",
                                    end=f"{end:.3f}", step=f"{SCRAPE_S:g}s")
            fmt = target.get("legendFormat")
            found = [Series(legend_of(fmt, r["metric"]),
                            [(float(t), float(v)) for t, v in r["values"]])
                     for r in result["result"]]
            data.series += found
            if not found:
                data.missing.append(legend_of(fmt, {}) or target.get("refId", "?"))
    return panels


def revision() -> str:
    """The commit, marked as git describe marks a working tree with changes."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def describe_run(r: Run) -> str:
    """Three lines: the run's shape, what it did, what happened to it when."""
    counts = ", ".join(f"{n:,} {state}" for state, n in sorted(r.counts.items()) if n)
    stats = r.partner_stats
    when = "; ".join(f"+{at - r.opened_at:.0f} s {what}" for at, what in r.applied)
    return (f"Run: {RECIPIENTS:,} recipients; partner limit {PARTNER_RATE:g}/s (burst "
            f"{PARTNER_BURST:g}, {LATENCY_MS:g} ms per DELETE) under a ceiling of {CEILING:g}/s, "
            f"concurrency {CONCURRENCY}; digest cutoff {DIGEST_CUTOFF_S:g} s after the tick; "
            f"quota {QUOTA['limit']:,} per {QUOTA['period_seconds']:g} s; one webhook sink "
            f"(crm); SQLite ledger, one process.\n"
            f"Opened at 0 s, done at {r.done_at - r.opened_at:.1f} s: {counts}; "
            f"{stats.get('rate_limited', 0):,} 429s answered by the partner; {r.hook_events:,} "
            f"events taken by the webhook, {r.hook_refused} deliveries refused.\n"
            f"Partner and sink events: {when}.")


def save(r: Run, path: Path, rev: str) -> None:
    """Prometheus's answers and the run's record, so --redraw needs no new run."""
    doc = {"revision": rev, "subtitle": describe_run(r), "start": r.start, "end": r.end,
           "origin": r.opened_at,
           "panels": [{"panel": p.panel, "missing": p.missing,
                       "series": [[s.label, s.points] for s in p.series]} for p in r.panels]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the run's data dir and TSDB here instead of a temp dir")
    parser.add_argument("--redraw", action="store_true",
                        help=f"no run: draw the answers the last run saved in {ANSWERS}")
    args = parser.parse_args()
    began = time.monotonic()
    if not args.redraw:
        with tempfile.TemporaryDirectory(prefix="dashboard-png-") as tmp_name:
            r = asyncio.run(record(args.keep or Path(tmp_name)))
        save(r, ANSWERS, revision())
        print(f"run: {describe_run(r)}")
    doc = json.loads(ANSWERS.read_text())
    panels = [PanelData(p["panel"], [Series(label, [(t, v) for t, v in pts])
                                     for label, pts in p["series"]], p["missing"])
              for p in doc["panels"]]
    footer = (f"Panels of packaging/grafana/cleanup-supervisor.json, each query evaluated by "
              f"a real Prometheus 2.42 scraping a sandbox run (commit {doc['revision']}); "
              f"drawn with matplotlib by bench/dashboard_png.py — Grafana itself is not "
              f"packaged for Debian.")
    draw_dashboard(panels, args.out, title=dashboard().get("title", "dashboard"),
                   subtitle=doc["subtitle"], footer=footer, start=doc["start"],
                   end=doc["end"], origin=doc["origin"])
    for panel in panels:
        line = summary_line(panel)
        if line:
            print(line)
    shown = args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out
    print(f"wrote {shown} in {time.monotonic() - began:.0f} s wall")


if __name__ == "__main__":
    main()
