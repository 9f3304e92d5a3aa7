"""Benchmark: 1, 2 and 3 replicas of the service on one PostgreSQL, one shared budget.

Usage: python bench/replicas.py [--quick] [--only known-limit,capacity] [--replicas 1,2,3]
                                [--set section.key=value] [--dsn postgresql://...]

For each scenario and replica count: a fresh partner simulator, a fresh PostgreSQL schema
(``bench_<hex>``, dropped afterwards) on the database ``$CLEANUP_DATABASE_URL`` names
(default postgres on 127.0.0.1:5432), and k ``serve`` processes on it (``[ledger]`` and
``[queue]`` backend postgres, each replica its own port and data dir, the rest as in the
matrix bench: config/default.toml with the scenario's ceiling, concurrency and settings).
The tick goes to replica 1 (``POST /v1/runs``), completion is its long-poll.

* ``known-limit``: partner 50/s (token bucket, burst 10), N = 1,500, ceiling 50/s.
  Target: ratio <= 1.03 and zero 429s.
* ``hidden-limit``: partner 50/s, ceiling 100/s, N = 1,500: ratio and 429 share.
* ``changing-limit``: 50 -> 12.5/s at 8 s -> 50/s at 18 s, N = 1,375 (ideal 35 s),
  ceiling 50: ratio, 429s, how long the executions per second (partner log) took to be
  under the new limit after the drop and back to 90 % after the recovery.
* ``capacity``: partner unlimited, N = 10,000, ceiling 100,000/s, 32 workers per
  replica, burst 1,000, 2,000-candidate pages: operations per second.

Per run: elapsed (tick to run done), ideal, ratio, ops/s, 429s, duplicates, the busiest
second of executions in the partner's log against ceiling + burst, tick to first and last
deletion to done, settled per replica (``cleanup_operations_total``), peak RSS per
replica (``VmHWM``, sampled), and what the database did: transactions per operation
(``pg_stat_database``, every source on that database, over tick .. replicas stopped),
the idle rate measured before the tick, and the statements on the budget's row
(``pg_stat_user_tables`` of the run's schema: scans of ``rate_budget``; its row updates
are the reservations and state writes), and what the shared budget learnt: the levels
it settled on and what each failed probe measured (the row read every 0.2 s, those reads
taken out of the counts). ``--quick`` scales N and every time by 0.2.
Writes ``bench/out/replicas.{md,json}`` (``replicas-quick.*`` for ``--quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import math
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from paths import OUT, log_path
from processes import (
    Partner,
    Service,
    cancel,
    clean_env,
    cpu_s,
    drive_events,
    dump_toml,
    free_port,
    host_busy_cpu_s,
    parse_overrides,
    sandbox,
    self_cpu_s,
    service_config,
    vm_hwm_mb,
)
from report import environment
from scenario import RATE_GAUGE, Sample, Scenario, follow_delays
from scenarios import build

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
SCENARIOS = ("known-limit", "hidden-limit", "changing-limit", "capacity")
ALIASES = {"known": "known-limit", "hidden": "hidden-limit", "changing": "changing-limit"}
IDLE_S = 4.0  # the replicas idle before the tick: the database's idle rate
MIN_IDLE_S = 2.0  # --quick too: the collector's counters lag about a second
BUDGET_TABLE = "rate_budget"
START_OVERHEAD_S = 10.0  # partner + k replicas started, the idle window, stopped, dropped


# -- the database ---------------------------------------------------------------------------


def app_name(schema: str) -> str:
    return f"cleanup-supervisor:{schema}"  # what supervisor/pg.py names its sessions


async def pg_snapshot(conn: asyncpg.Connection, schema: str) -> dict[str, Any]:
    """The database's transaction counters, the schema's table counters, and how many
    other client sessions are on the database (someone else's load on the counters)."""
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    db = await conn.fetchrow(
        "SELECT xact_commit, xact_rollback FROM pg_stat_database "
        "WHERE datname = current_database()")
    tables = await conn.fetch(
        "SELECT relname, seq_scan, coalesce(idx_scan, 0) AS idx_scan, n_tup_ins, n_tup_upd, "
        "n_tup_del FROM pg_stat_user_tables WHERE schemaname = $1", schema)
    others = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND backend_type = 'client backend' AND pid <> pg_backend_pid() "
        "AND coalesce(application_name, '') NOT IN ($1, $2)", app_name(schema),
        watcher_name(schema))
    assert db is not None
    return {"t": time.monotonic(), "xact": int(db["xact_commit"]) + int(db["xact_rollback"]),
            "rollback": int(db["xact_rollback"]), "others": int(others),
            "tables": {r["relname"]: {k: int(r[k]) for k in
                                      ("seq_scan", "idx_scan", "n_tup_ins", "n_tup_upd",
                                       "n_tup_del")} for r in tables}}


def table_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, dict[str, int]]:
    out = {}
    for name, a in after["tables"].items():
        b = before["tables"].get(name, {})
        out[name] = {k: v - b.get(k, 0) for k, v in a.items()}
    return out


async def backend_pids(conn: asyncpg.Connection, schema: str) -> list[int]:
    return [int(r["pid"]) for r in await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1", app_name(schema))]


def cpu_of(pids: Sequence[int]) -> dict[int, float]:
    return {pid: c for pid in pids if (c := cpu_s(pid)) is not None}


async def watch_sessions(conn: asyncpg.Connection, schema: str, seen: list[int],
                         interval_s: float = 2.0) -> None:
    """Every ``interval_s``: how many client sessions on the database are not the run's
    (someone else's transactions would be counted in ``pg_stat_database``)."""
    while True:
        seen.append(int(await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND backend_type = 'client backend' AND pid <> pg_backend_pid() "
            "AND coalesce(application_name, '') NOT IN ($1, $2)", app_name(schema),
            watcher_name(schema))))
        await asyncio.sleep(interval_s)


async def watch_learnt(dsn: str, schema: str, t0: float, seen: list[list[float | None]],
                       polls: list[int], interval_s: float = 0.2) -> None:
    """Every ``interval_s``: the shared budget's learnt limit (``w_max``) and the limit
    its last failed probe measured (``estimate``), as [t, w_max, estimate] when either
    changes: what the replicas settled on, against the partner's true limit. Each poll is
    one transaction and one scan of the budget's table, counted in ``polls`` so that
    cost() takes them out of the run's."""
    last: tuple[float | None, float | None] | None = None
    # A session of its own (the admin one is busy meanwhile), named so that
    # watch_sessions does not count it as someone else's load.
    conn = await asyncpg.connect(dsn, server_settings={"application_name": watcher_name(schema)})
    try:
        while True:
            raw = await conn.fetchval(f'SELECT state FROM "{schema}".{BUDGET_TABLE} LIMIT 1')
            polls[0] += 1
            state = json.loads(raw) if isinstance(raw, str) else (raw or {})
            now = (state.get("w_max"), state.get("estimate"))
            if now != last:
                seen.append([round(time.monotonic() - t0, 2), *now])
                last = now
            await asyncio.sleep(interval_s)
    finally:
        await conn.close()


def watcher_name(schema: str) -> str:
    return f"bench-learnt:{schema}"


async def drop_schema(conn: asyncpg.Connection, schema: str) -> None:
    # Sessions of a replica that did not exit cleanly would hold locks the drop waits for.
    await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       "WHERE application_name = $1", app_name(schema))
    await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# -- the replicas' /metrics -----------------------------------------------------------------


def parse_replica_metrics(text: str) -> dict[str, float]:
    """The figures read off one replica: limiter rate, 429s, settled by outcome, roles."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        try:
            v = float(value)
        except ValueError:
            continue
        if name == RATE_GAUGE:
            out["rate"] = v
        elif name == "cleanup_partner_responses_total" and 'status="429"' in labels:
            out["429"] = out.get("429", 0.0) + v
        elif name == "cleanup_operations_total":
            outcome = labels.partition('outcome="')[2].partition('"')[0]
            out[f"op:{outcome}"] = v
        elif name == "cleanup_role_held" and v == 1:
            role = labels.partition('role="')[2].partition('"')[0]
            out[f"role:{role}"] = 1
    return out


async def read_metrics(http: aiohttp.ClientSession, svc: Service) -> dict[str, float]:
    async with http.get(f"{svc.base}/metrics") as resp:
        return parse_replica_metrics(await resp.text())


def settled(m: dict[str, float]) -> int:
    return int(sum(v for k, v in m.items() if k.startswith("op:")))


async def watch(http: aiohttp.ClientSession, services: Sequence[Service], t0: float,
                samples: list[list[Sample]], hwm: list[float], interval_s: float | None,
                ) -> None:
    """Every ``interval_s``: each replica's VmHWM (kept at its maximum) and, unless
    ``interval_s`` is None (the capacity run: /proc only, every second), its /metrics."""
    while True:
        started = time.monotonic()
        for i, svc in enumerate(services):
            if (mb := vm_hwm_mb(svc.pid)) is not None:
                hwm[i] = max(hwm[i], mb)
            if interval_s is None:
                continue
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                m = await read_metrics(http, svc)
                samples[i].append((started - t0, m.get("rate"), m.get("429", 0.0)))
        step = interval_s or 1.0
        await asyncio.sleep(max(0.0, step - (time.monotonic() - started)))


# -- the partner's log ------------------------------------------------------------------------


def max_per_window(times: Sequence[float], window_s: float = 1.0) -> int:
    """The most executions in any ``window_s`` (sliding, starting at each one)."""
    ts = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(ts):
        while ts[j] <= t - window_s:
            j += 1
        best = max(best, i - j + 1)
    return best


def steady_rate(times: Sequence[float]) -> float | None:
    """Executions per second between the 10th and the 90th percentile execution."""
    ts = sorted(times)
    if len(ts) < 20:
        return None
    a, b = ts[len(ts) // 10], ts[(9 * len(ts)) // 10]
    return ((9 * len(ts)) // 10 - len(ts) // 10) / (b - a) if b > a else None


def gaps_over(times: Sequence[float], gap_s: float) -> list[tuple[float, float]]:
    """(at, length) of every pause between consecutive executions longer than ``gap_s``."""
    ts = sorted(times)
    return [(round(a, 3), round(b - a, 3)) for a, b in itertools.pairwise(ts)
            if b - a > gap_s]


def per_second(times: Sequence[float], end: float) -> list[int]:
    ts = sorted(times)
    return [bisect.bisect_left(ts, s + 1) - bisect.bisect_left(ts, s)
            for s in range(math.ceil(end))]


# -- one run ------------------------------------------------------------------------------


def replica_overrides(schema: str, overrides: dict[str, dict[str, Any]],
                      ) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"ledger": {"backend": "postgres", "schema": schema},
                                      "queue": {"backend": "postgres"}}
    for section, table in overrides.items():
        out.setdefault(section, {}).update(table)
    return out


async def run_one(sc: Scenario, k: int, dsn: str, overrides: dict[str, dict[str, Any]],
                  idle_s: float) -> dict[str, Any]:
    schema = f"bench_{secrets.token_hex(4)}"
    row: dict[str, Any] = {"scenario": sc.name, "replicas": k, "n": sc.n, "schema": schema,
                           "ideal_s": sc.ideal_s(), "ceiling": sc.ceiling,
                           "partner_rate": sc.partner_rate, "notes": []}
    admin = await asyncpg.connect(dsn)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp_name:
            tmp = Path(tmp_name)
            async with contextlib.AsyncExitStack() as stack:
                http = await stack.enter_async_context(aiohttp.ClientSession())
                partner = await stack.enter_async_context(sandbox(sc, http, f"replicas{k}"))
                services = []
                ov = replica_overrides(schema, overrides)
                for i in range(k):
                    port = free_port()
                    doc = service_config(sc, tmp / f"var-{i + 1}", port, partner, ov)
                    row["limits"] = doc["limits"]
                    cfg = tmp / f"replica-{i + 1}.toml"
                    cfg.write_text(dump_toml(doc))
                    log = log_path(sc.name, f"{k}replicas", f"replica-{i + 1}")
                    log.unlink(missing_ok=True)
                    env = clean_env(CUSTOMER_API_TOKEN=partner.token, CLEANUP_DATABASE_URL=dsn)
                    services.append(Service(http, cfg, port, tmp, log, env))
                try:
                    await asyncio.gather(*(s.start(ready_within_s=90) for s in services))
                    await measure(sc, row, services, partner, http, admin, schema, idle_s, dsn)
                finally:
                    await asyncio.gather(*(s.stop() for s in services), return_exceptions=True)
                codes = [s.proc.returncode if s.proc else None for s in services]
                if any(c not in (0, None) for c in codes):
                    row["notes"].append(f"exit codes {codes}")
                await asyncio.sleep(0.5)  # the backends' last counters reach the collector
                if "before" in row:
                    after = await pg_snapshot(admin, schema)
                    cost(row, after)
    except Exception as exc:  # one run's failure is a row, not the end of the bench
        row["notes"].append(f"error: {type(exc).__name__}: {exc}")
    finally:
        row.pop("before", None)
        with contextlib.suppress(Exception):
            await drop_schema(admin, schema)
        await admin.close()
    return row


async def measure(sc: Scenario, row: dict[str, Any], services: Sequence[Service],
                  partner: Partner, http: aiohttp.ClientSession, admin: asyncpg.Connection,
                  schema: str, idle_s: float, dsn: str) -> None:
    idle0 = await pg_snapshot(admin, schema)
    await asyncio.sleep(idle_s)
    before = await pg_snapshot(admin, schema)
    row["before"] = before
    window = before["t"] - idle0["t"]
    row["idle_xact_per_s"] = (before["xact"] - idle0["xact"]) / window
    idle_tables = table_delta(before, idle0).get(BUDGET_TABLE, {})
    row["idle_budget_stmts_per_s"] = (idle_tables.get("seq_scan", 0)
                                      + idle_tables.get("idx_scan", 0)) / window
    roles = [await read_metrics(http, s) for s in services]
    row["roles_at_tick"] = [sorted(r[5:] for r in m if r.startswith("role:")) for m in roles]

    stats0 = await partner.stats()
    pids0 = await backend_pids(admin, schema)
    pg_cpu0 = cpu_of(pids0)
    cpu0 = [cpu_s(s.pid) or 0.0 for s in services]
    part_cpu0, self0, host0 = cpu_s(partner.pid) or 0.0, self_cpu_s(), host_busy_cpu_s()
    samples: list[list[Sample]] = [[] for _ in services]
    hwm = [vm_hwm_mb(s.pid) or 0.0 for s in services]
    applied: list[tuple[float, dict[str, float]]] = []
    t0 = time.monotonic()
    events = asyncio.create_task(drive_events(sc, partner, t0, applied))
    watcher = asyncio.create_task(watch(http, services, t0, samples, hwm,
                                        None if sc.unlimited else 0.25 if sc.scrape else 0.5))
    others: list[int] = []
    sessions = asyncio.create_task(watch_sessions(admin, schema, others))
    learnt: list[list[float | None]] = []
    polls = [0]
    learning = asyncio.create_task(watch_learnt(dsn, schema, t0, learnt, polls))
    try:
        run_id = await services[0].tick()
        run = await services[0].wait_run(run_id, t0 + sc.budget_s("service"))
        t1 = time.monotonic()
    finally:
        await cancel(events, watcher, sessions, learning)
    row["other_sessions_during_run"] = max(others, default=0)
    stats1 = await partner.stats()
    pg_cpu1 = cpu_of(await backend_pids(admin, schema))
    cpu1 = [cpu_s(s.pid) or 0.0 for s in services]
    part_cpu1, self1, host1 = cpu_s(partner.pid) or 0.0, self_cpu_s(), host_busy_cpu_s()
    final = [await read_metrics(http, s) for s in services]
    for i, s in enumerate(services):
        if (mb := vm_hwm_mb(s.pid)) is not None:
            hwm[i] = max(hwm[i], mb)
    abs_times = await partner.execution_times(since=int(stats0.get("executions", 0)))
    row["t_stop"] = time.monotonic()
    times = [t - t0 for t in abs_times]

    counts = run.get("counts", {})
    elapsed = t1 - t0
    done = run["state"] == "done"
    delta = {key: int(stats1.get(key, 0)) - int(stats0.get(key, 0))
             for key in ("requests", "rate_limited", "duplicates", "executions")}
    burst = float(row["limits"].get("burst", 1.0))
    row.update(
        run_state=run["state"], elapsed_s=elapsed, wall_s=elapsed if done else None,
        t0=t0, t1=t1,
        ratio=(elapsed / row["ideal_s"] if done and row["ideal_s"] else None),
        ops_per_s=(sc.n / elapsed if done else None),
        discovered=run.get("discovered"), counts=counts, partner=delta,
        share_429=delta["rate_limited"] / delta["requests"] if delta["requests"] else None,
        max_exec_1s=max_per_window(abs_times), ceiling_plus_burst=sc.ceiling + burst,
        partner_max_rate_observed_1s=stats1.get("max_rate_observed_1s"),
        first_delete_s=min(times) if times else None,
        last_delete_s=max(times) if times else None,
        tail_s=(elapsed - max(times)) if times and done else None,
        steady_exec_per_s=steady_rate(times),
        gaps_over_100ms=gaps_over(times, 0.1)[:40],
        exec_per_second=per_second(times, max(times, default=0.0) + 1),
        settled_per_replica=[settled(m) for m in final],
        by_outcome_per_replica=[{k2[3:]: int(v) for k2, v in m.items() if k2.startswith("op:")}
                                for m in final],
        r429_per_replica=[int(m.get("429", 0)) for m in final],
        roles_at_end=[sorted(r[5:] for r in m if r.startswith("role:")) for m in final],
        peak_rss_mb=[round(x, 1) for x in hwm],
        cpu_s_per_replica=[round(b - a, 2) for a, b in zip(cpu0, cpu1, strict=True)],
        pg_backends_cpu_s=round(sum(c - pg_cpu0.get(p, 0.0) for p, c in pg_cpu1.items()), 2),
        pg_backends=len(pg_cpu1),
        partner_cpu_s=round(part_cpu1 - part_cpu0, 2), events=applied)
    own = (sum(cpu1) - sum(cpu0) + row["pg_backends_cpu_s"] + row["partner_cpu_s"]
           + self1 - self0)
    row["host_busy_cores"] = (host1 - host0) / elapsed
    row["other_cores"] = max(0.0, (host1 - host0) - own) / elapsed
    if row["other_cores"] > 0.3:
        row["notes"].append(f"host busy: other processes used {row['other_cores']:.1f} cores")
    if not done:
        row["notes"].append(f"not finished within {sc.budget_s('service'):.0f} s: "
                            f"{sum(settled(m) for m in final)}/{sc.n} settled")
    if run.get("discovered") not in (None, sc.n):
        row["notes"].append(f"discovered {run.get('discovered')} of {sc.n}")
    if counts.get("failed") or counts.get("ambiguous"):
        row["notes"].append(f"failed={counts.get('failed', 0)} "
                            f"ambiguous={counts.get('ambiguous', 0)}")
    if sc.rate_changes:
        follow = follow_delays(sc, [], times)
        for f in follow:
            gauges = [g for s in samples if s
                      for g in [next(x for x in follow_delays(sc, s, times)
                                     if x["at_s"] == f["at_s"])["gauge_s"]]]
            f["gauge_s_per_replica"] = gauges
        row["follow"] = follow
    row["gauge_samples"] = [[(round(t, 2), r) for t, r, _ in s] for s in samples]
    row["learnt"], row["learnt_polls"] = learnt, polls[0]
    if not sc.unlimited:
        row["execution_times"] = [round(t, 4) for t in times]


def cost(row: dict[str, Any], after: dict[str, Any]) -> None:
    """Transactions and budget statements per operation, over tick .. replicas stopped."""
    before, n = row["before"], row["n"]
    polls = row.get("learnt_polls", 0)  # the bench's own reads of the budget's row
    xact = after["xact"] - before["xact"] - polls
    window = after["t"] - before["t"]
    tables = table_delta(after, before)
    budget = tables.get(BUDGET_TABLE, {})
    budget_stmts = budget.get("seq_scan", 0) + budget.get("idx_scan", 0) - polls
    idle = row["idle_xact_per_s"] * window
    row.update(
        pg_window_s=window, xact=xact, xact_per_op=xact / n,
        xact_per_op_net_idle=(xact - idle) / n,
        budget_stmts=budget_stmts, budget_stmts_per_op=budget_stmts / n,
        budget_row_updates=budget.get("n_tup_upd", 0),
        budget_updates_per_op=budget.get("n_tup_upd", 0) / n,
        ledger_xact_per_op=(xact - budget_stmts) / n,
        rollbacks=after["rollback"] - before["rollback"],
        other_sessions=max(after["others"], before["others"],
                           row.get("other_sessions_during_run", 0)),
        tables={name: d for name, d in tables.items() if any(d.values())})
    if row["other_sessions"]:
        row["notes"].append(f"{row['other_sessions']} other session(s) on the database: "
                            "xact/op includes theirs")


# -- the report ---------------------------------------------------------------------------


def _f(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def verdict(row: dict[str, Any]) -> str:
    if any(n.startswith("error") for n in row["notes"]):
        return "error"
    if row["scenario"] == "known-limit":
        miss = []
        if row.get("ratio") is None or row["ratio"] > 1.03 + 1e-9:
            miss.append(f"ratio {_f(row.get('ratio'), '.3f')} > 1.03")
        if row["partner"]["rate_limited"]:
            miss.append(f"{row['partner']['rate_limited']} 429s")
        return "✓" if not miss else "✗ " + ", ".join(miss)
    return ""


def learnt_path(row: dict[str, Any]) -> str:
    """The levels the shared budget settled on (``w_max``), with what each failed probe
    measured in brackets: ``48.0 (49.0)``."""
    out: list[str] = []
    for _, w_max, measured in row.get("learnt", []):
        if w_max is None:
            continue
        text = f"{w_max:.1f}" + (f" ({measured:.1f})" if measured is not None else "")
        if not out or out[-1] != text:
            out.append(text)
    return " → ".join(out) or "—"


def monitor_on(row: dict[str, Any]) -> str:
    """Which replica held the monitor role (it closes runs) at the tick; r1 takes the tick."""
    held = [f"r{i + 1}" for i, roles in enumerate(row.get("roles_at_tick", []))
            if "monitor" in roles]
    return ",".join(held) or "none"


def _slash(values: Sequence[Any], spec: str = "") -> str:
    return " / ".join(format(v, spec) for v in values) if values else "—"


def tables(rows: Sequence[dict[str, Any]]) -> str:
    main = ["| scenario | replicas | elapsed s | ideal s | ratio | ops/s | 429s (share) | dups "
            "| worst 1 s exec. / ceiling+burst | tick→1st delete s | last delete→done s "
            "| steady exec/s | learnt /s (measured) | settled per replica | monitor role on "
            "| peak RSS MB per replica | target |",
            "|" + "---|" * 17]
    cost_t = ["| scenario | replicas | xact/op (all) | idle xact/s | xact/op net of idle "
              "| budget stmts/op (row scans) | budget row updates/op | ledger xact/op "
              "(all - budget) | PG backends CPU s | replicas CPU s | host busy cores |",
              "|" + "---|" * 11]
    follow_t = ["| replicas | drop: exec. under 12.5/s after (s) | gauge per replica (s) "
                "| recovery: exec. ≥ 45/s after (s) | gauge per replica (s) |",
                "|" + "---|" * 5]
    for r in rows:
        p = r.get("partner") or {}
        if "elapsed_s" not in r:
            main.append(f"| {r['scenario']} | {r['replicas']} | " + " | ".join(["—"] * 14)
                        + f" | {'; '.join(r['notes'])} |")
            continue
        share = f"{p['rate_limited']} ({_f(r['share_429'], '.2%')})"
        ideal = _f(r["ideal_s"], ".1f")
        wall = _f(r["wall_s"], ".1f") if r["wall_s"] is not None else f"DNF ({r['elapsed_s']:.0f})"
        notes = [verdict(r), *r["notes"]]
        main.append(
            f"| {r['scenario']} | {r['replicas']} | {wall} | {ideal} | {_f(r['ratio'], '.3f')} "
            f"| {_f(r['ops_per_s'], ',.0f')} | {share} | {p['duplicates']} "
            f"| {r['max_exec_1s']} / {r['ceiling_plus_burst']:g} "
            f"| {_f(r['first_delete_s'], '.2f')} | {_f(r['tail_s'], '.2f')} "
            f"| {_f(r['steady_exec_per_s'], '.1f')} | {learnt_path(r)} "
            f"| {_slash(r['settled_per_replica'])} "
            f"| {monitor_on(r)} | {_slash(r['peak_rss_mb'], '.0f')} | {'; '.join(n for n in notes if n)} |")
        if "xact_per_op" in r:
            cost_t.append(
                f"| {r['scenario']} | {r['replicas']} | {r['xact_per_op']:.2f} "
                f"| {r['idle_xact_per_s']:.1f} | {r['xact_per_op_net_idle']:.2f} "
                f"| {r['budget_stmts_per_op']:.3f} | {r['budget_updates_per_op']:.3f} "
                f"| {r['ledger_xact_per_op']:.2f} | {r['pg_backends_cpu_s']:.1f} "
                f"| {_slash(r['cpu_s_per_replica'], '.1f')} | {r['host_busy_cores']:.2f} |")
        if r.get("follow"):
            cells = []
            for f in r["follow"]:
                cells += [_f(f["executions_s"], ".1f"),
                          _slash([_f(g, ".1f") for g in f["gauge_s_per_replica"]])]
            follow_t.append(f"| {r['replicas']} | " + " | ".join(cells) + " |")
    parts = ["### pacing and throughput", "\n".join(main),
             "### database cost (tick .. replicas stopped)", "\n".join(cost_t)]
    if len(follow_t) > 2:
        parts += ["### changing-limit: following the partner", "\n".join(follow_t)]
    return "\n\n".join(parts)


def preamble(env: dict[str, Any], quick: bool, dsn: str) -> str:
    lines = [f"commit {env['commit']}" + (" (supervisor/ had uncommitted changes)"
                                          if env["supervisor_dirty"] else "")
             + f", {env['cpus']} x {env['cpu']}, Python {env['python']}, {env['date']}",
             f"PostgreSQL {dsn.rpartition('@')[2]}, a fresh schema per run; ledger, queue "
             "and rate budget on it; the tick to replica 1"]
    if quick:
        lines.append("**QUICK RUN: N and times scaled by 0.2 (a smoke run; not figures to "
                     "report)**")
    return "\n".join(lines)


# -- the command line ---------------------------------------------------------------------


def scenarios_for(names: Sequence[str], quick: bool) -> list[Scenario]:
    by_name = build(is_quick=quick)
    out = []
    for name in names:
        sc = by_name[name]
        if name == "known-limit":
            sc = replace(sc, target=replace(sc.target, max_ratio=1.03, max_share_429=0.0))
        out.append(replace(sc, ticks=1, tick_rows=()))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="1-3 replicas on one PostgreSQL, one budget")
    p.add_argument("--quick", action="store_true", help="N and times x 0.2 (a smoke run)")
    p.add_argument("--only", help="comma-separated: " + ", ".join(SCENARIOS))
    p.add_argument("--replicas", default="1,2,3", help="replica counts, e.g. 1,3")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a service config key")
    p.add_argument("--dsn", default=os.environ.get("CLEANUP_DATABASE_URL", DEFAULT_DSN))
    args = p.parse_args(argv)
    names = [ALIASES.get(n.strip(), n.strip()) for n in (args.only or ",".join(SCENARIOS))
             .split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    counts = [int(x) for x in args.replicas.split(",") if x.strip()]
    scale = 0.2 if args.quick else 1.0
    scs = scenarios_for(names, args.quick)
    idle_s = max(MIN_IDLE_S, IDLE_S * scale)
    est = sum((sc.ideal_s() or 8.0 * scale) * 1.05 + START_OVERHEAD_S for sc in scs) * len(counts)
    print(f"{len(scs) * len(counts)} runs, about {est / 60:.0f} min", file=sys.stderr, flush=True)
    start = environment()
    overrides = parse_overrides(args.overrides)
    rows = []
    for sc in scs:
        for k in counts:
            print(f"{sc.name} x {k} replica(s): N={sc.n:,}, partner {sc.r_label()}/s, "
                  f"ceiling {sc.ceiling:g}, ideal {_f(sc.ideal_s(), '.1f')} s",
                  file=sys.stderr, flush=True)
            row = asyncio.run(run_one(sc, k, args.dsn, overrides, idle_s))
            print(f"  elapsed {_f(row.get('wall_s'), '.1f')} s ratio {_f(row.get('ratio'), '.3f')}"
                  f" ops/s {_f(row.get('ops_per_s'), ',.0f')} 429s "
                  f"{(row.get('partner') or {}).get('rate_limited')} settled "
                  f"{row.get('settled_per_replica')} xact/op {_f(row.get('xact_per_op'), '.2f')} "
                  f"learnt {learnt_path(row)} {'; '.join(row['notes'])}", file=sys.stderr, flush=True)
            rows.append(row)
    env = environment()
    text = preamble(start, args.quick, args.dsn) + "\n\n" + tables(rows)
    if env["commit"] != start["commit"]:
        text += f"\n\n(commit {start['commit']} at the start, {env['commit']} at the end)"
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    stem = "replicas-quick" if args.quick else "replicas"
    (OUT / f"{stem}.md").write_text(text + "\n")
    (OUT / f"{stem}.json").write_text(json.dumps(
        {"meta": {"options": {"quick": args.quick, "only": names, "replicas": counts,
                              "set": args.overrides, "idle_s": idle_s},
                  "environment": start},
         "results": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
