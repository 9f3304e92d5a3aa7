"""The machinery every benchmark shares: scenarios, processes, the three tools, the table.

Every run gets a fresh partner simulator (``python -m supervisor.sandbox``) in its own
process on loopback, so its counters (requests, 429s, duplicates, requests during a pause)
belong to that run alone. The tools:

* ``service``: ``python -m supervisor serve --config <tmp toml>`` as a subprocess. The
  TOML is ``config/default.toml`` with the data dir, listen port, source, partner and the
  scenario's ceiling and concurrency replaced (plus any ``--set`` overrides). A run is
  opened over HTTP and long-polled until done. Peak RSS is ``VmHWM`` from
  ``/proc/<pid>/status`` read just before SIGTERM.
* ``cron``: ``bench/cron_alone.py`` as a subprocess (reports its own peak RSS).
* ``celery``: a Celery worker (``bench/celery_peer.py``, thread pool) as a subprocess on
  the Redis broker, fed by ``celery_peer.py produce``; done when the completion counters
  in Redis reach N. Peak RSS is the worker's ``VmHWM``.

Wall time runs from the tick (the POST that opens the run; the start of the peer's
producer or loop) to the last operation settled, so paging the candidates is included
for every tool. The partner's events (pauses, limit changes) are timed from the same
instant.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
OUT = BENCH / "out"
LOGS = OUT / "logs"
PY = sys.executable
TOOLS = ("service", "cron", "celery")
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
REDIS_MARKER = "cleanup-bench:owned"
CELERY_POOL = os.environ.get("BENCH_CELERY_POOL", "threads")  # threads | prefork

RATE_METRIC = "cleanup_limiter_rate_per_second"
THROTTLE_METRIC = 'cleanup_partner_responses_total{status="429"}'


# -- scenarios ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Event:
    """Something the partner does ``at_s`` seconds after the tick (via /_sandbox/control)."""

    at_s: float
    rate_per_second: float | None = None
    pause_s: float | None = None

    def control(self) -> dict[str, float]:
        body: dict[str, float] = {}
        if self.rate_per_second is not None:
            body["rate_per_second"] = self.rate_per_second
        if self.pause_s is not None:
            body["pause_seconds"] = self.pause_s
        return body


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    title: str
    target: str
    n: int
    partner_rate: float  # the partner's true limit per second; <= 0: unlimited
    ceiling: float  # the service's configured limits.rate_per_second
    partner_burst: float = 10.0
    window: str = "bucket"  # bucket | minute
    retry_after_format: str = "seconds"
    ratelimit_headers: bool = False
    concurrency: int = 8
    events: tuple[Event, ...] = ()
    scrape: bool = False  # record the service's limiter rate every 250 ms
    celery_rate_limit: str | None = None  # default: the ceiling per second
    celery_concurrency: int | None = None
    # Budget for one tool's run before it is stopped and reported as not finished, as a
    # multiple of the ideal plus seconds. The peers' pace is steady (linear projection
    # holds), so they get a tighter one; ``cron_budget`` overrides it for the loop.
    service_budget: tuple[float, float] = (2.5, 15.0)
    peer_budget: tuple[float, float] = (0.5, 8.0)
    cron_budget: tuple[float, float] | None = None
    max_budget_s: float = 150.0
    # Service settings this scenario is run with (section, key, value), before --set.
    service_set: tuple[tuple[str, str, Any], ...] = ()

    @property
    def unlimited(self) -> bool:
        return self.partner_rate <= 0

    @property
    def pauses(self) -> list[tuple[float, float]]:
        return [(e.at_s, e.at_s + e.pause_s) for e in self.events if e.pause_s]

    def limit_at(self, t: float) -> float:
        """The partner's true rate at ``t`` seconds after the tick (0 during a pause)."""
        if any(a <= t < b for a, b in self.pauses):
            return 0.0
        rate = self.partner_rate
        for e in sorted(self.events, key=lambda e: e.at_s):
            if e.rate_per_second is not None and e.at_s <= t:
                rate = e.rate_per_second
        return rate

    def ideal_s(self) -> float | None:
        """N at the partner's true limit over time: N / R, plus pauses, through changes."""
        if self.unlimited:
            return None
        marks = sorted({0.0, *(e.at_s for e in self.events), *(b for _, b in self.pauses)})
        done = 0.0
        for start, end in zip(marks, [*marks[1:], math.inf], strict=True):
            rate = self.limit_at(start)
            if rate > 0 and done + rate * (end - start) >= self.n:
                return start + (self.n - done) / rate
            done += rate * (end - start) if rate > 0 else 0.0
        raise AssertionError("unreachable: the last segment is unbounded")

    def budget_s(self, tool: str) -> float:
        ideal = self.ideal_s() or 10.0
        factor, extra = (self.service_budget if tool == "service" else
                         self.cron_budget if tool == "cron" and self.cron_budget else
                         self.peer_budget)
        return min(self.max_budget_s, ideal * factor + extra)

    def sandbox_args(self) -> list[str]:
        args = ["--recipients", str(self.n), "--rate", f"{self.partner_rate:g}",
                "--burst", f"{self.partner_burst:g}", "--window", self.window,
                "--retry-after-format", self.retry_after_format]
        if self.ratelimit_headers:
            args.append("--ratelimit-headers")
        return args

    def r_label(self) -> str:
        if self.unlimited:
            return "∞"
        if self.window == "minute":
            return f"{self.partner_rate * 60:g}/min"
        changes = [e.rate_per_second for e in self.events if e.rate_per_second is not None]
        if changes:
            return "→".join(f"{r:g}" for r in [self.partner_rate, *changes])
        return f"{self.partner_rate:g}"


# -- results --------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    scenario: str
    tool: str
    n: int
    r_label: str
    ideal_s: float | None
    wall_s: float | None = None  # None when it did not finish within its budget
    elapsed_s: float = 0.0  # time measured (the budget when it did not finish)
    completed: int = 0
    failed: int = 0
    requests: int = 0
    rate_limited: int = 0
    duplicates: int = 0
    requests_during_pause: int = 0
    peak_rss_mb: float | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.wall_s is not None

    @property
    def projected_s(self) -> float | None:
        """Linear projection to N when the run was cut off at its budget."""
        if self.finished:
            return self.wall_s
        if self.completed <= 0:
            return None
        return self.elapsed_s * self.n / self.completed

    @property
    def ratio(self) -> float | None:
        t = self.projected_s
        if t is None or not self.ideal_s:
            return None
        return t / self.ideal_s

    @property
    def share_429(self) -> float | None:
        return self.rate_limited / self.requests if self.requests else None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(finished=self.finished, ratio=self.ratio, share_429=self.share_429,
                 projected_s=self.projected_s)
        return d


# -- processes ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vm_hwm_mb(pid: int) -> float | None:
    """Peak resident set size of a live process, from /proc/<pid>/status."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a live process has used so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_busy_cpu_s() -> float:
    """Busy CPU seconds of the whole host so far, summed over its CPUs."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLEANUP__")}
    env.update(extra)
    return env


async def stop_process(proc: asyncio.subprocess.Process, sig: int = signal.SIGTERM,
                       grace_s: float = 20.0) -> int | None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return proc.returncode


@dataclass(frozen=True, slots=True)
class Partner:
    url: str
    token: str
    http: aiohttp.ClientSession
    pid: int

    async def stats(self) -> dict[str, Any]:
        async with self.http.get(f"{self.url}/_sandbox/stats") as resp:
            return dict(await resp.json())

    async def control(self, body: dict[str, float]) -> None:
        async with self.http.post(f"{self.url}/_sandbox/control", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"sandbox control refused {body}: {await resp.text()}")

    async def execution_times(self) -> list[float]:
        """Monotonic times of every executed delete (the sandbox's clock is the host's)."""
        async with self.http.get(f"{self.url}/_sandbox/log?format=jsonl") as resp:
            body = await resp.read()
        return [json.loads(line)["t"] for line in body.splitlines() if line]


@contextlib.asynccontextmanager
async def sandbox(sc: Scenario, http: aiohttp.ClientSession) -> AsyncIterator[Partner]:
    token = secrets.token_urlsafe(18)
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "supervisor.sandbox", "--port", "0", "--token-env", "SANDBOX_TOKEN",
        *sc.sandbox_args(), stdout=asyncio.subprocess.PIPE,
        env=clean_env(SANDBOX_TOKEN=token), cwd=REPO)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line:
            raise RuntimeError("the partner simulator exited before it listened")
        yield Partner(json.loads(line)["url"], token, http, proc.pid)
    finally:
        await stop_process(proc, grace_s=10)


async def drive_events(sc: Scenario, partner: Partner, t0: float,
                       applied: list[tuple[float, dict[str, float]]]) -> None:
    """Apply the scenario's partner events on time, relative to the tick at ``t0``."""
    for event in sorted(sc.events, key=lambda e: e.at_s):
        await asyncio.sleep(max(0.0, t0 + event.at_s - time.monotonic()))
        await partner.control(event.control())
        applied.append((time.monotonic() - t0, event.control()))


async def scrape_metrics(http: aiohttp.ClientSession, url: str, t0: float,
                         samples: list[tuple[float, float | None, float | None]],
                         interval_s: float = 0.25) -> None:
    """Every ``interval_s``: (seconds since tick, limiter rate, 429s answered so far)."""
    while True:
        started = time.monotonic()
        rate = throttled = None
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with http.get(f"{url}/metrics") as resp:
                text = await resp.text()
            for line in text.splitlines():
                if line.startswith(RATE_METRIC + " "):
                    rate = float(line.rsplit(" ", 1)[1])
                elif line.startswith(THROTTLE_METRIC + " "):
                    throttled = float(line.rsplit(" ", 1)[1])
            samples.append((started - t0, rate, throttled or 0.0))
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


async def _cancel(*tasks: asyncio.Task[Any] | None) -> None:
    for task in tasks:
        if task is not None:
            task.cancel()
    for task in tasks:
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _add_cpu(result: Result, pid: int) -> None:
    """Count a bench process's CPU as ours (to tell load from other processes apart)."""
    result.extra["own_cpu_s"] = result.extra.get("own_cpu_s", 0.0) + (cpu_s(pid) or 0.0)


def _fill_from_stats(result: Result, stats: dict[str, Any]) -> None:
    result.requests = int(stats["requests"])
    result.rate_limited = int(stats["rate_limited"])
    result.duplicates = int(stats["duplicates"])
    result.requests_during_pause = int(stats["requests_during_pause"])
    result.extra["max_rate_observed_1s"] = stats.get("max_rate_observed_1s")
    result.extra["executions"] = stats.get("executions")


def _new_result(sc: Scenario, tool: str) -> Result:
    return Result(sc.name, tool, sc.n, sc.r_label(), sc.ideal_s())


# -- the service ----------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


def dump_toml(doc: dict[str, dict[str, Any]]) -> str:
    lines: list[str] = []
    for section, table in doc.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)


def parse_overrides(items: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``section.key=value`` (value in TOML syntax, else a string) into a nested dict."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        dotted, sep, raw = item.partition("=")
        section, dot, key = dotted.partition(".")
        if not sep or not dot:
            raise SystemExit(f"--set wants section.key=value, got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out.setdefault(section, {})[key] = value
    return out


def service_config(sc: Scenario, data_dir: Path, port: int, partner_url: str,
                   overrides: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    doc: dict[str, dict[str, Any]] = tomllib.loads((REPO / "config/default.toml").read_text())
    doc.pop("schedule", None)
    doc["service"].update(data_dir=str(data_dir), listen=f"127.0.0.1:{port}",
                          log_level="warning")
    doc["source"].update(kind="http", url=f"{partner_url}/stale-recipients",
                         token_env="CUSTOMER_API_TOKEN")
    doc["partner"].update(base_url=partner_url)
    doc["limits"].update(rate_per_second=sc.ceiling, concurrency=sc.concurrency)
    for section, key, value in sc.service_set:
        doc.setdefault(section, {})[key] = value
    for section, table in overrides.items():
        doc.setdefault(section, {}).update(table)
    return doc


async def run_service(sc: Scenario, overrides: dict[str, dict[str, Any]]) -> Result:
    result = _new_result(sc, "service")
    trigger_token = secrets.token_urlsafe(18)
    budget = sc.budget_s("service")
    with tempfile.TemporaryDirectory(prefix="bench-service-") as tmp:
        async with aiohttp.ClientSession() as http, sandbox(sc, http) as partner:
            port = free_port()
            doc = service_config(sc, Path(tmp) / "var", port, partner.url, overrides)
            result.extra["limits"] = doc["limits"]
            cfg = Path(tmp) / "bench.toml"
            cfg.write_text(dump_toml(doc))
            log = (LOGS / f"{sc.name}-service.log").open("wb")
            proc = await asyncio.create_subprocess_exec(
                PY, "-m", "supervisor", "serve", "--config", str(cfg), cwd=tmp,
                stdout=log, stderr=log,
                env=clean_env(CUSTOMER_API_TOKEN=partner.token,
                              CLEANUP_TRIGGER_TOKEN=trigger_token))
            base = f"http://127.0.0.1:{port}"
            auth = {"Authorization": f"Bearer {trigger_token}"}
            events_task = scrape_task = None
            try:
                await _wait_ready(http, base, proc)
                cpu0 = cpu_s(proc.pid) or 0.0
                samples: list[tuple[float, float | None, float | None]] = []
                applied: list[tuple[float, dict[str, float]]] = []
                t0 = time.monotonic()
                events_task = asyncio.create_task(drive_events(sc, partner, t0, applied))
                if sc.scrape:
                    scrape_task = asyncio.create_task(scrape_metrics(http, base, t0, samples))
                async with http.post(f"{base}/v1/runs", headers=auth,
                                     json={"schedule": "bench"}) as resp:
                    opened = await resp.json()
                    if resp.status >= 300:
                        raise RuntimeError(f"trigger refused: {resp.status} {opened}")
                run_id = opened["run"]["id"]
                run = await _wait_run(http, base, auth, run_id, t0 + budget)
                t1 = time.monotonic()
                await _cancel(events_task, scrape_task)
                events_task = scrape_task = None
                counts = run["counts"]
                result.completed = counts["deleted"] + counts["already_absent"] + counts["failed"]
                result.failed = counts["failed"]
                result.elapsed_s = t1 - t0
                if run["state"] == "done":
                    result.wall_s = t1 - t0
                if counts["failed"] or counts["ambiguous"]:
                    result.notes.append(f"failed={counts['failed']} "
                                        f"ambiguous={counts['ambiguous']}")
                _fill_from_stats(result, await partner.stats())
                times = await partner.execution_times()
                result.extra.update(
                    events=applied, samples=samples, partner_span_s=_span(times),
                    executions_s=[t - t0 for t in times] if sc.scrape else [])
                result.peak_rss_mb = vm_hwm_mb(proc.pid)
                result.extra["cpu_s"] = (cpu_s(proc.pid) or 0.0) - cpu0
                _add_cpu(result, proc.pid)
                _add_cpu(result, partner.pid)
                result.extra["ledger_bytes"] = _dir_bytes(Path(tmp) / "var")
            finally:
                await _cancel(events_task, scrape_task)
                code = await stop_process(proc, grace_s=30)
                log.close()
            if code != 0:
                result.notes.append(f"service exited {code}")
    return result


async def _wait_ready(http: aiohttp.ClientSession, base: str,
                      proc: asyncio.subprocess.Process) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise RuntimeError(f"service exited {proc.returncode} at start-up; see bench/out/logs")
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(f"{base}/readyz") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.05)
    raise RuntimeError("service not ready within 30 s")


async def _wait_run(http: aiohttp.ClientSession, base: str, auth: dict[str, str], run_id: str,
                    deadline: float) -> dict[str, Any]:
    run: dict[str, Any] = {}
    while True:
        remaining = deadline - time.monotonic()
        timeout = max(1, min(5, math.ceil(remaining)))
        async with http.get(f"{base}/v1/runs/{run_id}?wait=done&timeout={timeout}",
                            headers=auth) as resp:
            run = await resp.json()
        if run["state"] == "done" or time.monotonic() >= deadline:
            return run


def _span(times: Sequence[float]) -> float | None:
    return max(times) - min(times) if times else None


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("cleanup.sqlite3*"))


# -- peer 1: cron alone ---------------------------------------------------------------


async def run_cron(sc: Scenario) -> Result:
    result = _new_result(sc, "cron")
    budget = sc.budget_s("cron")
    async with aiohttp.ClientSession() as http, sandbox(sc, http) as partner:
        log = (LOGS / f"{sc.name}-cron.log").open("wb")
        proc = await asyncio.create_subprocess_exec(
            PY, str(BENCH / "cron_alone.py"), "--base-url", partner.url,
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
            await _cancel(events_task)
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
        _fill_from_stats(result, await partner.stats())
        result.extra["partner_span_s"] = _span(await partner.execution_times())
        _add_cpu(result, partner.pid)
        result.extra["own_cpu_s"] += report.get("cpu_s", 0.0)
    return result


# -- peer 2: Celery + Redis -----------------------------------------------------------


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
    result = _new_result(sc, "celery")
    budget = sc.budget_s("celery")
    tag = uuid.uuid4().hex[:10]
    rate_limit = sc.celery_rate_limit
    if rate_limit is None and not sc.unlimited:
        rate_limit = f"{sc.ceiling:g}/s"
    concurrency = sc.celery_concurrency or sc.concurrency
    result.extra.update(rate_limit=rate_limit, concurrency=concurrency)
    await asyncio.to_thread(_reset_redis_db)
    r = _redis()
    with tempfile.TemporaryDirectory(prefix="bench-celery-") as tmp:
        async with aiohttp.ClientSession() as http, sandbox(sc, http) as partner:
            ready = Path(tmp) / "ready"
            env = clean_env(
                CUSTOMER_API_TOKEN=partner.token, BENCH_BROKER_URL=REDIS_URL,
                BENCH_QUEUE=f"bench-{tag}", BENCH_PARTNER_URL=partner.url,
                BENCH_TOKEN_ENV="CUSTOMER_API_TOKEN", BENCH_RATE_LIMIT=rate_limit or "",
                BENCH_TAG=tag, BENCH_READY_FILE=str(ready),
                PYTHONPATH=os.pathsep.join(filter(None, [str(BENCH),
                                                         os.environ.get("PYTHONPATH")])))
            log = (LOGS / f"{sc.name}-celery.log").open("wb")
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
                await _cancel(events_task)
                events_task = None
                _fill_from_stats(result, await partner.stats())
                result.extra["partner_span_s"] = _span(await partner.execution_times())
                result.peak_rss_mb = vm_hwm_mb(worker.pid)
                result.extra["cpu_s"] = (cpu_s(worker.pid) or 0.0) - cpu0
                _add_cpu(result, worker.pid)
                _add_cpu(result, partner.pid)
            finally:
                await _cancel(events_task)
                if producer is not None:
                    result.extra["own_cpu_s"] = (result.extra.get("own_cpu_s", 0.0)
                                                 + (cpu_s(producer.pid) or 0.0))
                    await stop_process(producer, grace_s=5)
                # Warm shutdown would wait for tasks held for a countdown: cold is enough,
                # the database is flushed before the next run.
                await stop_process(worker, signal.SIGQUIT, grace_s=10)
                log.close()
    await asyncio.to_thread(_reset_redis_db)
    return result


# -- running and reporting ------------------------------------------------------------


async def run_tool(sc: Scenario, tool: str, overrides: dict[str, dict[str, Any]]) -> Result:
    LOGS.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    busy0 = host_busy_cpu_s()
    self0 = _self_cpu_s()
    try:
        if tool == "service":
            result = await run_service(sc, overrides)
        elif tool == "cron":
            result = await run_cron(sc)
        elif tool == "celery":
            result = await run_celery(sc)
        else:
            raise ValueError(f"unknown tool {tool!r}")
    except Exception as exc:
        result = _new_result(sc, tool)
        result.notes.append(f"error: {type(exc).__name__}: {exc}")
    harness_s = result.extra["harness_s"] = time.monotonic() - started
    busy1 = host_busy_cpu_s()
    own = result.extra.get("own_cpu_s", 0.0) + _self_cpu_s() - self0
    foreign = max(0.0, (busy1 - busy0) - own) / harness_s
    result.extra.update(host_busy_cores=(busy1 - busy0) / harness_s, foreign_cores=foreign)
    if foreign > FOREIGN_LOAD_NOTE:
        result.notes.append(f"host busy: other processes used {foreign:.1f} of "
                            f"{os.cpu_count()} cores")
    if sc.scrape and tool == "service" and result.extra.get("samples"):
        result.notes += follow_notes(sc, result.extra["samples"])
    if not result.finished and not any(n.startswith("error") for n in result.notes):
        result.notes.insert(0, f"not finished: {result.completed:,}/{result.n:,} in "
                               f"{result.elapsed_s:.0f} s; ratio projected")
    if sc.unlimited and result.projected_s:
        result.notes.insert(0, f"{result.n / result.projected_s:,.0f} ops/s end to end")
    print(f"  {sc.name:<18} {tool:<8} {describe(result)}", file=sys.stderr, flush=True)
    return result


FOREIGN_LOAD_NOTE = 0.3  # cores used by processes outside the bench that earn a note


def _self_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def follow_notes(sc: Scenario, samples: Sequence[tuple[float, float | None, float | None]],
                 ) -> list[str]:
    """How long the limiter took to follow each change of the partner's limit."""
    notes = []
    previous = sc.partner_rate
    for event in sorted(sc.events, key=lambda e: e.at_s):
        new = event.rate_per_second
        if new is None:
            continue
        after = [(t, rate) for t, rate, _ in samples if rate is not None and t >= event.at_s]
        if new < previous:
            hit = next((t for t, rate in after if rate <= new * 1.1), None)
            what = f"down to ≤{new * 1.1:g}/s"
        else:
            hit = next((t for t, rate in after if rate >= new * 0.9), None)
            what = f"back up to ≥{new * 0.9:g}/s"
        when = (f"in {hit - event.at_s:.1f} s" if hit is not None
                else f"not within the run ({after[-1][1]:g}/s at the end)" if after
                else "not observed")
        notes.append(f"limit {previous:g}→{new:g} at {event.at_s:g} s: limiter {what} {when}")
        previous = new
    return notes


def describe(r: Result) -> str:
    ratio = f"{r.ratio:.3f}" if r.ratio is not None else "—"
    share = f"{r.share_429:.2%}" if r.share_429 is not None else "—"
    wall = f"{r.wall_s:.1f}s" if r.wall_s is not None else f"DNF({r.elapsed_s:.0f}s)"
    return (f"wall={wall} ratio={ratio} 429={share} dups={r.duplicates} "
            f"pause_reqs={r.requests_during_pause} rss={r.peak_rss_mb or 0:.0f}MB "
            f"{'; '.join(r.notes)}")


HEADER = ("| scenario | tool | N | R /s | wall s | ideal s | ratio | 429 share | dups "
          "| req. in pause | peak RSS MB | notes |")


def table_row(r: Result) -> str:
    if r.wall_s is not None:
        wall = f"{r.wall_s:.1f}"
    elif r.projected_s is not None:
        wall = f"DNF ({r.elapsed_s:.0f})"
    else:
        wall = "—"
    ratio = "—" if r.ratio is None else f"{r.ratio:.3f}" + ("" if r.finished else " (proj.)")
    ideal = "—" if r.ideal_s is None else f"{r.ideal_s:.1f}"
    share = "—" if r.share_429 is None else f"{r.share_429:.2%}"
    rss = "—" if r.peak_rss_mb is None else f"{r.peak_rss_mb:.0f}"
    partner = r.requests > 0  # growth rows never talk to a partner
    cells = [r.scenario, r.tool, f"{r.n:,}", r.r_label, wall, ideal, ratio, share,
             str(r.duplicates) if partner else "—",
             str(r.requests_during_pause) if partner else "—", rss, "; ".join(r.notes)]
    return "| " + " | ".join(cells) + " |"


def table(results: Sequence[Result]) -> str:
    sep = "|" + "|".join("---" for _ in HEADER.split("|")[1:-1]) + "|"
    return "\n".join([HEADER, sep, *map(table_row, results)])


def environment() -> dict[str, Any]:
    def git(*args: str) -> str:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout.strip()
        return "?"

    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    dirty = git("status", "--porcelain", "--", "supervisor")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "supervisor_dirty": bool(dirty and dirty != "?"),
            "cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def preamble(env: dict[str, Any], limits: dict[str, Any] | None,
             start: dict[str, Any] | None = None) -> str:
    """Where and on what the table was measured; ``start``: the environment at the start."""
    start = start or env
    commit = start["commit"] + ("" if start["commit"] == env["commit"] else
                                f" at the start, {env['commit']} at the end")
    dirty = start["supervisor_dirty"] or env["supervisor_dirty"]
    lines = [f"commit {commit}" + (" (supervisor/ had uncommitted changes)" if dirty else "")
             + f", {env['cpus']} x {env['cpu']}, Python {env['python']}, {env['date']}"]
    if limits:
        keys = ("concurrency", "burst", "decrease_factor", "increase_per_second",
                "floor_per_second")
        lines.append("service limits (config/default.toml + scenario): "
                     + ", ".join(f"{k}={limits[k]}" for k in keys if k in limits))
    return "\n".join(lines)


def load_results(path: Path) -> list[Result]:
    """Results saved by :func:`save`, to render their table again."""
    names = {f for f in Result.__dataclass_fields__}
    return [Result(**{k: v for k, v in d.items() if k in names})
            for d in json.loads(path.read_text())]


def save(results: Sequence[Result], stem: str, text: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{stem}.md").write_text(text + "\n")
    (OUT / f"{stem}.json").write_text(json.dumps([r.as_dict() for r in results], indent=1,
                                                 default=str))


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
