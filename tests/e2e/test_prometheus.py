"""A real Prometheus scraping a sandbox run (issue 11, points 2 and 3).

Prometheus runs on loopback, scrapes the service every second as the job alerts.yml names
and evaluates those rules every second. The run is against a partner allowing 50/s under a
service ceiling of 100/s, so the limiter meets 429s and learns the limit, with a 429
storm in its middle: while it lasts nothing settles, the moment at which a gauge can be
held to the API's count exactly.

Then, through PromQL, the article's four numbers against the partner's own record and the
API; no alert fires during the healthy run, none is even pending, and every rule's
expression (its `for:` aside) selects nothing, mid-run and at the end; every query of
the Grafana dashboard returns data over the run. Once on SQLite (the default shape) and
once on the PostgreSQL ledger and queue (one replica: the dashboard's live-replica count
needs that backend). The measured numbers are printed (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any

import pytest

from cleanup_sandbox.sink import WebhookSink
from supervisor.monitor import REFRESH_S
from supervisor.states import TERMINAL
from tests.e2e.harness import E2E, Sandbox, Sections, Service, merge
from tests.e2e.prometheus_harness import (
    JOB,
    REPLICAS_ROW,
    SCRAPE_S,
    Prometheus,
    Sample,
    alert_rules,
    binary,
    dashboard_targets,
    eventually,
    start_prometheus,
)
from tests.e2e.replica_harness import replica_overrides

pytestmark = pytest.mark.e2e

POPULATION = 250
PARTNER_RATE = 50.0
CEILING = 100.0
STORM_S = 5.0
# Grafana's $__rate_interval: max($__interval + the scrape interval, 4 scrape intervals).
RATE_INTERVAL_S = 4 * SCRAPE_S
# A scrape this long after a moment reads gauges the monitor refreshed after it (it
# refreshes every REFRESH_S; the second period covers its own pass and a busy host).
SETTLE_S = 2 * REFRESH_S
# Alerts that may be pending before the run, never during it: the first rule evaluation
# can come before the first scrape, a scrape before the service listens, and cleanup_ready
# is 0 until the monitor's first pass.
BEFORE_THE_FIRST_SCRAPE = {"CleanupTargetAbsent", "CleanupTargetDown", "CleanupNotReady"}
OF_JOB = f'job="{JOB}"'
TERMINAL_STATES = {s.value for s in TERMINAL}


@dataclass(frozen=True)
class Storm:
    """One scrape while nothing settled, and what the API said around it."""

    began: float  # just before the partner's storm began
    at: float
    unfinished_api: int
    unfinished: float
    oldest_age: float
    depth: float


@dataclass(frozen=True)
class Observed:
    prom: Prometheus
    svc: Service
    sandbox: Sandbox
    stats: dict[str, Any]
    run: dict[str, Any]
    opened_at: float  # just before the trigger
    done_at: float  # the run reported done
    end: float  # a scrape the monitor refreshed for after the run was done
    storm: Storm
    pending_before: set[str]
    alerts_mid: dict[str, list[dict[str, Any]]]


def unfinished_of(run: dict[str, Any]) -> int:
    """cleanup_run_unfinished_operations's definition, from the API's counts."""
    return sum(n for state, n in run["counts"].items() if state not in TERMINAL_STATES)


def shape(hook: WebhookSink) -> Sections:
    # A digest cutoff, a quota far from spent and an events sink: so the panels that
    # show them have series.
    return {"schedule": {"digest_cutoff_seconds": 3600.0},
            "limits": {"rate_per_second": CEILING, "concurrency": 8,
                       "quota": [{"name": "day", "limit": 1_000_000, "period_seconds": 86400.0}]},
            "events": {"poll_interval_seconds": 0.5, "sink": [hook.sink()]}}


async def the_storm(prom: Prometheus, svc: Service, run_id: str, began: float) -> Storm:
    """A scrape inside a stretch over which the API's count stood still (it only falls
    during a drain: equal at both ends is equal throughout), the stretch starting early
    enough that the monitor refreshed its gauges inside it before that scrape."""
    selector = f"cleanup_run_unfinished_operations{{{OF_JOB}}}"
    readings: list[tuple[float, int]] = []

    async def read() -> int:
        readings.append((time.time(), unfinished_of(await svc.run(run_id))))
        return readings[-1][1]

    async def probe() -> tuple[int, Sample] | None:
        await read()
        sample = await prom.sample(selector)
        after = await read()
        if sample is None:
            return None
        before = [n for t, n in readings if t <= sample.at - SETTLE_S]
        return (after, sample) if before and before[-1] == after else None

    unfinished_api, sample = await eventually(probe, 2 * STORM_S,
                                              "a scrape while nothing settles", every_s=0.2)
    age = await prom.value(f"cleanup_queue_oldest_message_age_seconds{{{OF_JOB}}}", sample.at)
    depth = await prom.value(f"cleanup_queue_depth{{{OF_JOB}}}", sample.at)
    assert age is not None
    assert depth is not None
    return Storm(began, sample.at, unfinished_api, sample.value, age, depth)


async def observe(e2e: E2E, hook: WebhookSink, backend: Sections,
                  env: dict[str, str]) -> Observed:
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--rate", PARTNER_RATE,
                                "--burst", 5)
    svc = e2e.service(sandbox, merge(shape(hook), backend))
    svc.env.update(env, **{hook.secret_env: hook.secret})
    # Prometheus first: its first scrape comes about 5 s after it starts (target discovery
    # hands over updates every 5 s), time the service spends starting.
    prom = await start_prometheus(e2e, [svc])
    await svc.start()
    await eventually(lambda: prom.value(f"cleanup_ready{{{OF_JOB}}} == 1"), 15.0,
                     "the service scraped and ready")
    pending_before: set[str] = set()

    async def no_alert() -> bool | None:
        alerts = await prom.query("ALERTS")
        pending_before.update(a["metric"]["alertname"] for a in alerts)
        return True if not alerts else None

    await eventually(no_alert, 10.0, "no alert left from before the first scrape")

    opened_at = time.time()
    run_id = await svc.open_run()
    await sandbox.wait(executions=POPULATION // 3)
    before = await sandbox.stats()
    began = time.time()
    await sandbox.control(pause_seconds=STORM_S)
    await sandbox.wait(requests=before["requests"] + 1)  # the storm's first 429 is sent
    storm = await the_storm(prom, svc, run_id, began)
    alerts_mid = {r["alert"]: await prom.query(r["expr"], storm.at) for r in alert_rules()}

    run = await svc.wait_done(run_id)
    done_at = time.time()
    _, stats = await e2e.assert_complete(svc, run, sandbox)

    async def final_scrape() -> float | None:
        sample = await prom.sample(f"cleanup_run_unfinished_operations{{{OF_JOB}}}")
        return sample.at if sample is not None and sample.at >= done_at + SETTLE_S else None

    end = await eventually(final_scrape, 10.0, "a scrape after the run was done")
    return Observed(prom, svc, sandbox, stats, run, opened_at, done_at, end, storm,
                    pending_before, alerts_mid)


async def check_the_four_numbers(o: Observed) -> dict[str, float]:
    prom, stats = o.prom, o.stats
    # increase() from the start of Prometheus's record to its last scrape is exact here:
    # the counters were exported at 0 before the run (the first sample is 0, so nothing is
    # extrapolated before it) and the evaluation time is the last scrape's (nothing after).
    window = f"{math.ceil(o.end - o.opened_at) + 30}s"
    deleted = await prom.value(
        f'increase(cleanup_operations_total{{{OF_JOB}, outcome="deleted"}}[{window}])', o.end)
    throttled = await prom.value(
        f'increase(cleanup_partner_responses_total{{{OF_JOB}, status="429"}}[{window}])', o.end)
    assert deleted == stats["deleted"], (deleted, stats)
    assert throttled == stats["rate_limited"], (throttled, stats)
    assert stats["rate_limited"] > stats["requests_during_pause"] > 0, \
        "the limiter met the partner's limit and the storm both"

    # Unfinished operations of the current run: the API's count at the storm, then 0.
    s = o.storm
    assert s.unfinished == s.unfinished_api > 0, s
    assert await prom.value(f"cleanup_run_unfinished_operations{{{OF_JOB}}}", o.end) == 0
    # The oldest queued message: waiting during the storm (a backlog, published after the
    # trigger, so younger than the run), none once the run is done.
    assert s.depth > 0, s
    assert 0 < s.oldest_age <= s.at - o.opened_at, (s, o.opened_at)
    assert await prom.value(f"cleanup_queue_oldest_message_age_seconds{{{OF_JOB}}}",
                            o.end) == 0

    minutes = (o.done_at - o.opened_at) / 60
    peak = await prom.value(
        f'max_over_time((sum(rate(cleanup_operations_total{{{OF_JOB}, outcome="deleted"}}'
        f'[{RATE_INTERVAL_S:g}s])) * 60)[{window}:{SCRAPE_S:g}s])', o.end)
    return {"run_s": round(o.done_at - o.opened_at, 1),
            "deleted": stats["deleted"], "deleted_prom": deleted or 0.0,
            "deleted_per_min": round((deleted or 0.0) / minutes, 1),
            "deleted_per_min_peak": round(peak or 0.0, 1),
            "429s": stats["rate_limited"], "429s_prom": throttled or 0.0,
            "429s_per_min": round((throttled or 0.0) / minutes, 1),
            "unfinished_at_storm": s.unfinished, "unfinished_api_at_storm": s.unfinished_api,
            "oldest_age_at_storm": round(s.oldest_age, 2),
            "since_trigger_at_storm": round(s.at - o.opened_at, 2)}


async def check_no_alert(o: Observed) -> None:
    prom, rules, s = o.prom, alert_rules(), o.storm
    assert o.pending_before <= BEFORE_THE_FIRST_SCRAPE, o.pending_before
    # Nothing fired or was pending at any evaluation during the run (the window starts
    # after the trigger: the alerts pending before it had resolved).
    during = await prom.query(f"ALERTS[{math.floor(o.end - o.opened_at)}s]", o.end)
    assert [a["metric"] for a in during] == []
    assert [a["metric"] for a in await prom.query("ALERTS", o.end)] == []
    # The real check, `for:` aside: each rule's condition selects nothing, in the storm
    # and at the end.
    at_end_exprs = {r["alert"]: await prom.query(r["expr"], o.end) for r in rules}
    for name, found in (*o.alerts_mid.items(), *at_end_exprs.items()):
        assert found == [], (name, found)
    # The storm's pauses were counted (what CleanupLimiterPausedLong adds up): about the
    # storm's length, far from 15 minutes. Besides the storm, each 429 the partner
    # answered (finding the limit hidden under a ceiling twice too high takes three, a
    # busy host more) pauses at most its whole-second Retry-After, the storm's last one
    # rounds up to a second more, and Prometheus's increase() extrapolates over the
    # window (2 s allowed): bounded by what the partner did, not by a count of 429s.
    window = math.ceil(o.end - o.opened_at)
    [paused] = await prom.query(
        f"sum(increase(cleanup_limiter_paused_seconds_total[{window}s]))", o.end)
    bound = STORM_S + 1.0 + o.stats["rate_limited"] * 1.0 + 2.0
    assert 1.0 <= float(paused["value"][1]) <= bound, (paused, o.stats["rate_limited"], s)
    # Prometheus loaded every rule and evaluated each without an error on real series.
    loaded = [r for g in (await prom.api("/api/v1/rules"))["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in loaded) == sorted(r["alert"] for r in rules)
    assert [(r["name"], r["lastError"]) for r in loaded if r["health"] != "ok"] == []


async def check_every_panel(o: Observed, replicas: bool) -> None:
    queries = dashboard_targets(RATE_INTERVAL_S, o.end - o.opened_at)
    failed, empty = [], []
    for q in queries:
        doc = await o.prom.answer("/api/v1/query_range", query=q.expr,
                                  start=f"{o.opened_at:.3f}", end=f"{o.end:.3f}",
                                  step=f"{SCRAPE_S:g}s")
        if doc["status"] != "success":
            failed.append((q.title, q.expr, doc.get("error")))
            continue
        values = [float(v) for series in doc["data"]["result"] for _, v in series["values"]]
        if not any(math.isfinite(v) for v in values) and (replicas or q.row != REPLICAS_ROW):
            empty.append((q.title, q.expr))
    assert failed == [], failed
    assert empty == [], f"{len(empty)} of {len(queries)} panel queries returned nothing: {empty}"


async def test_prometheus_sees_a_sqlite_run_as_the_partner_did(e2e: E2E) -> None:
    async with WebhookSink(secret_env="E2E_HOOK_SECRET") as hook:
        o = await observe(e2e, hook, {}, {})
        numbers = await check_the_four_numbers(o)
        print(f"sqlite: {numbers}")
        await check_no_alert(o)
        await check_every_panel(o, replicas=False)


async def test_prometheus_sees_a_postgres_run_as_the_partner_did(pg: Any, e2e: E2E) -> None:
    async with WebhookSink(secret_env="E2E_HOOK_SECRET") as hook:
        o = await observe(e2e, hook, replica_overrides(pg.schema),
                          {"CLEANUP_DATABASE_URL": pg.dsn})
        numbers = await check_the_four_numbers(o)
        print(f"postgres: {numbers}")
        await check_no_alert(o)
        await check_every_panel(o, replicas=True)


async def test_promtool_finds_nothing_to_lint_in_metrics_after_a_run(e2e: E2E) -> None:
    promtool = binary("promtool")
    async with WebhookSink(secret_env="E2E_HOOK_SECRET") as hook:
        sandbox = await e2e.sandbox("--recipients", 100, "--rate", 400)
        # Labelled families with series: outcomes, statuses, roles, the quota, the sink.
        svc = e2e.service(sandbox, merge(shape(hook), {"limits": {"rate_per_second": 300.0}}))
        svc.env[hook.secret_env] = hook.secret
        await svc.start()
        await svc.wait_done(await svc.open_run())
        text = (await svc.metrics()).text
    assert "cleanup_events_delivered_total{" in text
    assert 'cleanup_partner_responses_total{status="204"}' in text
    proc = await asyncio.create_subprocess_exec(
        promtool, "check", "metrics", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    e2e.processes.add(proc)
    async with asyncio.timeout(30):
        out, _ = await proc.communicate(text.encode())
    assert (proc.returncode, out.decode()) == (0, "")


async def test_prometheus_scrapes_a_service_whose_metrics_need_a_token(e2e: E2E) -> None:
    """service.metrics_token_env set: /metrics is 401 without it, and Prometheus's
    ``authorization`` block (as packaging/compose-prometheus.yml shows) scrapes."""
    token = secrets.token_urlsafe(24)
    svc = e2e.service(None)
    svc.env["CLEANUP_METRICS_TOKEN"] = token
    prom = await start_prometheus(e2e, [svc], bearer=token)
    await svc.start()
    async with e2e.http.get(f"{svc.url}/metrics") as resp:
        assert resp.status == 401
    await eventually(lambda: prom.value(f"cleanup_ready{{{OF_JOB}}} == 1"), 20.0,
                     "the service scraped with the metrics token")
