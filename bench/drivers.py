"""The three tools driven through one scenario on one partner cell, each into a Result.

* ``service``: the service as a subprocess (processes.Service), a run opened over HTTP
  and long-polled until done. With ``ticks`` > 1 the same partner process (same URL, so
  the service's per-partner memory applies) and the same data dir serve every tick, the
  service stopped (SIGTERM) and started again with the same config between them; each
  tick gets IDs of its own through a JSONL file source, and each tick with a row of its
  own (``Scenario.tick_rows``: hidden-limit is tick 1 of hidden-limit-memory) becomes a
  Result of that scenario. Peak RSS is ``VmHWM`` of the tick's process, read just before
  SIGTERM.
* ``cron``: ``bench/cron_alone.py`` as a subprocess (reports its own peak RSS).
* ``celery``: a Celery worker (``bench/celery_peer.py``, thread pool) as a subprocess on
  the Redis broker, fed by ``celery_peer.py produce``; done when the completion counters
  in Redis reach N. Peak RSS is the worker's ``VmHWM``.

Wall time runs from the tick (the POST that opens the run; the start of the peer's
producer or loop) to the last operation settled; the partner's events (pauses, limit
changes) are timed from the same instant.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from cleanup_sandbox.demo import BROKERS, broker_queue
from paths import BENCH, CELERY_POOL, PY, REDIS_MARKER, REDIS_URL, log_path
from processes import (
    Emulator,
    Partner,
    Service,
    cancel,
    clean_env,
    cpu_s,
    drive_events,
    dump_toml,
    free_port,
    infrai_emulator,
    sandbox,
    scrape_metrics,
    service_config,
    stop_process,
    vm_hwm_mb,
    write_ids,
)
from scenario import Result, Sample, Scenario, follow_delays, follow_notes, new_result

STAT_FIELDS = ("requests", "rate_limited", "duplicates", "requests_during_pause",
               "requests_during_announced_wait", "quota_limited", "executions")


def _stat_delta(after: dict[str, Any], before: dict[str, Any] | None) -> dict[str, int]:
    return {k: int(after.get(k, 0)) - int((before or {}).get(k, 0)) for k in STAT_FIELDS}


def _fill_from_stats(result: Result, delta: dict[str, int], stats: dict[str, Any]) -> None:
    result.requests = delta["requests"]
    result.rate_limited = delta["rate_limited"]
    result.duplicates = delta["duplicates"]
    result.requests_during_pause = delta["requests_during_pause"]
    result.requests_during_announced_wait = delta["requests_during_announced_wait"]
    result.quota_limited = delta["quota_limited"]
    result.extra["executions"] = delta["executions"]
    result.extra["max_rate_observed_1s"] = stats.get("max_rate_observed_1s")
    if "requests_during_announced_wait" not in stats:
        result.notes.append("partner reports no requests_during_announced_wait (old sandbox?)")


def _add_cpu(result: Result, seconds: float | None) -> None:
    """Count a bench process's CPU as ours (to tell load from other processes apart)."""
    result.extra["own_cpu_s"] = result.extra.get("own_cpu_s", 0.0) + (seconds or 0.0)


def _span(times: Sequence[float]) -> float | None:
    return max(times) - min(times) if times else None


def _follow(result: Result, sc: Scenario, samples: Sequence[Sample],
            times_s: Sequence[float]) -> None:
    if sc.rate_changes:
        follow = follow_delays(sc, samples, times_s)
        result.extra["follow"] = follow
        result.notes += follow_notes(follow)


async def _broker_calls(http: aiohttp.ClientSession, base: str) -> float:
    """The service's round trips to its queue's broker so far (cleanup_queue_calls_total)."""
    async with http.get(f"{base}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("cleanup_queue_calls_total{"))


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("cleanup.sqlite3*"))


# -- the service --------------------------------------------------------------------------


async def _service_tick(sc: Scenario, service: Service, partner: Partner,
                        http: aiohttp.ClientSession, budget: float, scrape: bool,
                        ) -> dict[str, Any]:
    """One tick through a running service: opened, long-polled, and what it cost."""
    before = await partner.stats()
    samples: list[Sample] = []
    applied: list[tuple[float, dict[str, float]]] = []
    t0 = time.monotonic()
    events_task = asyncio.create_task(drive_events(sc, partner, t0, applied))
    scrape_task = (asyncio.create_task(scrape_metrics(http, service.base, t0, samples))
                   if scrape else None)
    try:
        run_id = await service.tick()
        run = await service.wait_run(run_id, t0 + budget)
        t1 = time.monotonic()
    finally:
        await cancel(events_task, scrape_task)
    stats = await partner.stats()
    times = await partner.execution_times(since=int(before.get("executions", 0)))
    return {"run": run, "t0": t0, "t1": t1, "stats": stats,
            "delta": _stat_delta(stats, before), "samples": samples, "events": applied,
            "times_s": [round(t - t0, 4) for t in times]}


def _fill_from_tick(result: Result, sc: Scenario, tick: dict[str, Any]) -> None:
    run, counts = tick["run"], tick["run"].get("counts", {})
    result.completed = (counts.get("deleted", 0) + counts.get("already_absent", 0)
                        + counts.get("failed", 0))
    result.failed = counts.get("failed", 0)
    result.elapsed_s = tick["t1"] - tick["t0"]
    if run["state"] == "done":
        result.wall_s = result.elapsed_s
    if counts.get("failed") or counts.get("ambiguous"):
        result.notes.append(f"failed={counts.get('failed', 0)} "
                            f"ambiguous={counts.get('ambiguous', 0)}")
    scan = run.get("scan") or {}
    if scan.get("last_error"):
        result.notes.append(f"scan error: {scan['last_error']}")
    if run.get("discovered") not in (None, sc.n):
        result.notes.append(f"discovered {run.get('discovered')} of {sc.n}")
    _fill_from_stats(result, tick["delta"], tick["stats"])
    result.extra.update(events=tick["events"], samples=tick["samples"],
                        partner_span_s=_span(tick["times_s"]), executions_s=tick["times_s"],
                        run_state=run["state"])
    _follow(result, sc, tick["samples"], tick["times_s"])


async def run_service(sc: Scenario, overrides: dict[str, dict[str, Any]]) -> list[Result]:
    """One run of ``sc`` through the service: a Result per reported tick, in tick order
    (one for a single tick; with ``tick_rows``, one per tick)."""
    specs = sc.tick_specs()
    rows = {k: new_result(spec, "service") for k, spec in enumerate(specs) if spec is not None}
    final = rows[sc.ticks - 1]
    for row in rows.values():
        row.extra["in_flight"] = sc.concurrency
        if sc.ticks > 1:
            row.extra.update(run=sc.name, ticks=sc.ticks)
    budget = sc.budget_s("service")
    log = log_path(sc.name, sc.cell.name, "service")
    log.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-service-") as tmp_name:
        tmp = Path(tmp_name)
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(aiohttp.ClientSession())
            partner = await stack.enter_async_context(sandbox(sc, http, "service"))
            emulator: Emulator | None = None
            env = {"CUSTOMER_API_TOKEN": partner.token}
            if sc.queue in BROKERS:
                # A queue of the run's own on this machine's broker, removed after it.
                env.update(await stack.enter_async_context(broker_queue(sc.queue)))
            if sc.queue == "infrai":
                emulator = await stack.enter_async_context(infrai_emulator(sc, http))
                env["INFRAI_API_KEY"] = emulator.key
                overrides = {**overrides, "queue": {**overrides.get("queue", {}),
                                                    "backend": "infrai"},
                             "infrai": {**overrides.get("infrai", {}),
                                        "base_url": emulator.url}}
            port = free_port()
            source = tmp / "candidates.jsonl" if sc.ticks > 1 else None
            doc = service_config(sc, tmp / "var", port, partner, overrides, source)
            for row in rows.values():
                row.extra["limits"] = doc["limits"]
            cfg = tmp / "bench.toml"
            cfg.write_text(dump_toml(doc))
            service = Service(http, cfg, port, tmp, log, clean_env(**env))
            ticks: list[dict[str, Any]] = []
            code: int | None = 0
            stopped = ""  # why the ticks after the last measured one were not run
            try:
                for k in range(sc.ticks):
                    if k:
                        _add_cpu(rows.get(k - 1, final), cpu_s(service.pid))
                        code = await service.stop()
                        if code != 0:
                            final.notes.append(f"service exited {code} on SIGTERM "
                                               f"before tick {k + 1}")
                    if source is not None:
                        write_ids(source, sc.n * sc.ticks, k * sc.n, sc.n)
                    last = k == sc.ticks - 1
                    try:
                        await service.start()
                        cpu0 = cpu_s(service.pid) or 0.0
                        tick = await _service_tick(
                            sc, service, partner, http, budget,
                            scrape=sc.scrape and (last or specs[k] is not None))
                    except Exception as exc:
                        if not ticks:
                            raise  # nothing measured: run_tool makes every row an error
                        stopped = (f"error: tick {k + 1} of {sc.ticks}: "
                                   f"{type(exc).__name__}: {exc}")
                        break
                    tick["cpu_s"] = (cpu_s(service.pid) or 0.0) - cpu0
                    tick["peak_rss_mb"] = vm_hwm_mb(service.pid)
                    ticks.append(tick)
                    if tick["run"]["state"] != "done" and not last:
                        # Its run would resume after the restart and share the next
                        # tick's partner: the later ticks are not measured.
                        stopped = (f"error: not run: tick {k + 1} of {sc.ticks} did not "
                                   "finish within its budget")
                        break
                _add_cpu(rows.get(len(ticks) - 1, final), cpu_s(service.pid))
                _add_cpu(final, cpu_s(partner.pid))
                if sc.queue in BROKERS and ticks:
                    calls = await _broker_calls(http, service.base)
                    final.extra["broker_calls"] = calls
                    final.extra["broker_calls_per_op"] = round(calls / max(1, sc.n * sc.ticks), 3)
                    final.notes.append(f"{sc.queue}: {calls:.0f} round trips, "
                                       f"{calls / max(1, sc.n * sc.ticks):.2f} per operation")
            finally:
                code = await service.stop()
            if emulator is not None:
                # Every Infrai call is billed: what one operation costs, all calls counted
                # (publish, consume, ack, reposts, queue creation, empty polls).
                calls = (await emulator.stats())["total_calls"]
                final.extra["infrai_calls"] = calls
                final.extra["infrai_calls_per_op"] = round(calls / max(1, sc.n * sc.ticks), 3)
                final.notes.append(f"Infrai: {calls} calls, {calls / max(1, sc.n * sc.ticks):.2f}"
                                   f" per operation, +{sc.infrai_latency_ms:g} ms each")
            for k, tick in enumerate(ticks):
                measured, spec = rows.get(k), specs[k]
                if measured is None or spec is None:
                    continue
                _fill_from_tick(measured, spec, tick)
                measured.peak_rss_mb = tick["peak_rss_mb"]
                measured.extra["cpu_s"] = tick["cpu_s"]
                if sc.ticks > 1:
                    measured.extra["tick"] = k + 1
            for k, row in rows.items():
                if k >= len(ticks):
                    row.extra["tick"] = k + 1
                    row.notes.append(stopped or "error: tick not run")
            final.extra["ledger_bytes"] = _dir_bytes(tmp / "var")
            unreported = {k + 1: _tick_summary(sc, t) for k, t in enumerate(ticks)
                          if k not in rows}
            if unreported:
                final.extra["earlier_ticks"] = [{"tick": i, **t} for i, t in unreported.items()]
                for i, t in unreported.items():
                    final.notes.append(f"tick {i}: wall {t['wall_s'] or 0:.1f} s, ratio "
                                       f"{_fmt(t['ratio'], '.3f')}, 429 {_fmt(t['share_429'], '.2%')}")
            if code != 0:
                final.notes.append(f"service exited {code}; see {log}")
    return list(rows.values())


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _tick_summary(sc: Scenario, tick: dict[str, Any]) -> dict[str, Any]:
    done = tick["run"]["state"] == "done"
    wall = tick["t1"] - tick["t0"] if done else None
    ideal = sc.ideal_s()
    delta = tick["delta"]
    return {"wall_s": wall, "ratio": wall / ideal if wall and ideal else None,
            "requests": delta["requests"], "rate_limited": delta["rate_limited"],
            "share_429": delta["rate_limited"] / delta["requests"] if delta["requests"] else None,
            "requests_during_announced_wait": delta["requests_during_announced_wait"],
            "peak_rss_mb": tick["peak_rss_mb"]}


# -- peer 1: cron alone -------------------------------------------------------------------


async def run_cron(sc: Scenario) -> Result:
    result = new_result(sc, "cron")
    result.extra["in_flight"] = 1
    budget = sc.budget_s("cron")
    async with aiohttp.ClientSession() as http, sandbox(sc, http, "cron") as partner:
        log = log_path(sc.name, sc.cell.name, "cron").open("wb")
        proc = await asyncio.create_subprocess_exec(
            PY, str(BENCH / "cron_alone.py"), "--base-url", partner.api_url,
            "--token-env", "CUSTOMER_API_TOKEN", "--deadline-s", f"{budget:.1f}",
            stdout=asyncio.subprocess.PIPE, stderr=log,
            env=clean_env(CUSTOMER_API_TOKEN=partner.token))
        events_task = None
        try:
            assert proc.stdout is not None
            started = json.loads(await proc.stdout.readline())
            applied: list[tuple[float, dict[str, float]]] = []
            events_task = asyncio.create_task(drive_events(sc, partner, started["t0"], applied))
            line = await asyncio.wait_for(proc.stdout.readline(), budget + 60)
            report = json.loads(line)
        finally:
            await cancel(events_task)
            await stop_process(proc)
            log.close()
        result.completed = report["done"] + report["failed"]
        result.failed = report["failed"]
        result.elapsed_s = report["t1"] - report["t0"]
        if report["finished"]:
            result.wall_s = result.elapsed_s
        if report["failed"]:
            result.notes.append(f"failed={report['failed']} (gave up after 6 attempts)")
        result.peak_rss_mb = report["maxrss_kb"] / 1024
        stats = await partner.stats()
        _fill_from_stats(result, _stat_delta(stats, None), stats)
        times_s = [t - report["t0"] for t in await partner.execution_times()]
        result.extra.update(partner_span_s=_span(times_s), events=applied)
        _follow(result, sc, [], times_s)
        _add_cpu(result, cpu_s(partner.pid))
        _add_cpu(result, report.get("cpu_s", 0.0))
    return result


# -- peer 2: Celery + Redis ---------------------------------------------------------------


def _redis() -> Any:
    import redis  # the bench extra; imported late so the service-only path needs none

    return redis.Redis.from_url(REDIS_URL)


def claim_redis_db() -> None:
    """The bench flushes its Redis database between runs: make sure it is ours."""
    r = _redis()
    if r.dbsize() and not r.exists(REDIS_MARKER):
        raise SystemExit(f"{REDIS_URL} holds keys the bench did not write; set "
                         "BENCH_REDIS_URL to an empty database")
    r.set(REDIS_MARKER, "1")


def _reset_redis_db() -> None:
    r = _redis()
    r.flushdb()
    r.set(REDIS_MARKER, "1")


async def run_celery(sc: Scenario) -> Result:
    result = new_result(sc, "celery")
    budget = sc.budget_s("celery")
    tag = uuid.uuid4().hex[:10]
    rate_limit = sc.celery_rate_limit
    if rate_limit is None and not sc.unlimited:
        rate_limit = f"{sc.ceiling:g}/s"
    concurrency = sc.celery_concurrency or sc.concurrency
    result.extra.update(rate_limit=rate_limit, concurrency=concurrency, in_flight=concurrency)
    await asyncio.to_thread(_reset_redis_db)
    r = _redis()
    with tempfile.TemporaryDirectory(prefix="bench-celery-") as tmp:
        async with aiohttp.ClientSession() as http, sandbox(sc, http, "celery") as partner:
            ready = Path(tmp) / "ready"
            env = clean_env(
                CUSTOMER_API_TOKEN=partner.token, BENCH_BROKER_URL=REDIS_URL,
                BENCH_QUEUE=f"bench-{tag}", BENCH_PARTNER_URL=partner.api_url,
                BENCH_TOKEN_ENV="CUSTOMER_API_TOKEN", BENCH_RATE_LIMIT=rate_limit or "",
                BENCH_TAG=tag, BENCH_READY_FILE=str(ready),
                PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH),
                                                         os.environ.get("PYTHONPATH")])))
            log = log_path(sc.name, sc.cell.name, "celery").open("wb")
            worker = await asyncio.create_subprocess_exec(
                PY, "-m", "celery", "-A", "celery_peer", "worker", "--pool", CELERY_POOL,
                "--concurrency", str(concurrency), "--loglevel", "WARNING",
                "-Q", f"bench-{tag}", "--without-gossip", "--without-mingle",
                "--without-heartbeat", cwd=BENCH, env=env, stdout=log, stderr=log)
            producer = events_task = None
            try:
                deadline = time.monotonic() + 60
                while not ready.exists():
                    if worker.returncode is not None or time.monotonic() > deadline:
                        raise RuntimeError("celery worker did not start; see bench/out/logs")
                    await asyncio.sleep(0.05)
                cpu0 = cpu_s(worker.pid) or 0.0
                producer = await asyncio.create_subprocess_exec(
                    PY, str(BENCH / "celery_peer.py"), "produce", cwd=BENCH, env=env,
                    stdout=asyncio.subprocess.PIPE, stderr=log)
                assert producer.stdout is not None
                t0 = json.loads(await producer.stdout.readline())["t0"]
                applied: list[tuple[float, dict[str, float]]] = []
                events_task = asyncio.create_task(drive_events(sc, partner, t0, applied))
                done = failed = 0
                while time.monotonic() < t0 + budget:
                    done, failed = (int(v or 0) for v in await asyncio.to_thread(
                        r.mget, f"bench:{tag}:done", f"bench:{tag}:failed"))
                    if done + failed >= sc.n:
                        result.wall_s = time.monotonic() - t0
                        break
                    await asyncio.sleep(0.05)
                result.elapsed_s = time.monotonic() - t0
                result.completed, result.failed = done + failed, failed
                if failed:
                    result.notes.append(f"failed={failed}")
                await cancel(events_task)
                events_task = None
                stats = await partner.stats()
                _fill_from_stats(result, _stat_delta(stats, None), stats)
                times_s = [t - t0 for t in await partner.execution_times()]
                result.extra.update(partner_span_s=_span(times_s), events=applied)
                _follow(result, sc, [], times_s)
                result.peak_rss_mb = vm_hwm_mb(worker.pid)
                result.extra["cpu_s"] = (cpu_s(worker.pid) or 0.0) - cpu0
                _add_cpu(result, cpu_s(worker.pid))
                _add_cpu(result, cpu_s(partner.pid))
            finally:
                await cancel(events_task)
                if producer is not None:
                    _add_cpu(result, cpu_s(producer.pid))
                    await stop_process(producer, grace_s=5)
                # Warm shutdown would wait for tasks held for a countdown: cold is enough,
                # the database is flushed before the next run.
                await stop_process(worker, signal.SIGQUIT, grace_s=10)
                log.close()
    await asyncio.to_thread(_reset_redis_db)
    return result


def have_tool(tool: str) -> str | None:
    """Why ``tool`` cannot run here, or None."""
    if tool in ("cron", "celery"):
        try:
            import requests  # noqa: F401
        except ImportError:
            return "needs the bench extra: pip install -e '.[bench]'"
    if tool == "celery":
        try:
            import celery  # noqa: F401

            _redis().ping()
        except ImportError:
            return "needs the bench extra: pip install -e '.[bench]'"
        except Exception as exc:
            return f"Redis at {REDIS_URL} unreachable: {exc}"
    return None
