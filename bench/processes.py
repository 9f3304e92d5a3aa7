"""The bench's processes: the partner simulator, the service, and what is read off them.

* the partner: ``python -m cleanup_sandbox`` with the scenario's rate and the cell's
  shape, on a free loopback port; its stats, execution log and control endpoint;
* the service: ``python -m supervisor serve --config <tmp toml>``, the TOML being
  ``config/default.toml`` with the data dir, listen port, source, partner, the
  scenario's ceiling and concurrency replaced (plus any ``--set`` overrides). It can be
  stopped (SIGTERM) and started again with the same config, data dir and port;
* /proc readings: peak RSS (``VmHWM``), CPU seconds of a process and of the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import signal
import socket
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import aiohttp

from paths import PY, REPO, log_path
from scenario import RATE_GAUGE, Sample, Scenario

RATE_METRIC = RATE_GAUGE
RESPONSES_METRIC = "cleanup_partner_responses_total"


# -- /proc ------------------------------------------------------------------------------


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


def self_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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


async def cancel(*tasks: asyncio.Task[Any] | None) -> None:
    for task in tasks:
        if task is not None:
            task.cancel()
    for task in tasks:
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task


# -- the partner ------------------------------------------------------------------------


class Partner:
    """The simulator: ``url`` for its ``/_sandbox`` endpoints, ``api_url`` for clients (a
    gateway's, when the cell has one; its refusals are added to the partner's stats)."""

    def __init__(self, url: str, token: str, http: aiohttp.ClientSession, pid: int,
                 gateway: Any = None) -> None:
        self.url, self.token, self.http, self.pid = url, token, http, pid
        self.gateway = gateway
        self.api_url: str = gateway.url if gateway is not None else url

    async def stats(self) -> dict[str, Any]:
        async with self.http.get(f"{self.url}/_sandbox/stats") as resp:
            stats = dict(await resp.json())
        if self.gateway is not None:
            refused = self.gateway.refused()
            stats["requests"] = int(stats.get("requests", 0)) + refused
            stats["rate_limited"] = int(stats.get("rate_limited", 0)) + refused
            stats["gateway_refused"] = refused
        return stats

    async def control(self, body: dict[str, float]) -> None:
        async with self.http.post(f"{self.url}/_sandbox/control", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"sandbox control refused {body}: {await resp.text()}")

    async def execution_times(self, since: int = 0) -> list[float]:
        """Monotonic times of the executed deletes after ``since`` (the host's clock)."""
        async with self.http.get(f"{self.url}/_sandbox/log?format=jsonl&since={since}") as resp:
            body = await resp.read()
        return [json.loads(line)["t"] for line in body.splitlines() if line]


@contextlib.asynccontextmanager
async def sandbox(sc: Scenario, http: aiohttp.ClientSession,
                  tool: str = "") -> AsyncIterator[Partner]:
    """A fresh partner for one run; its stderr goes to ``<scenario>@<cell>-<tool>-partner.log``."""
    token = secrets.token_urlsafe(18)
    log = log_path(sc.name, sc.cell.name, f"{tool}-partner" if tool else "partner")
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            PY, "-m", "cleanup_sandbox", "--port", "0", "--token-env", "SANDBOX_TOKEN",
            *sc.sandbox_args(), stdout=asyncio.subprocess.PIPE, stderr=err,
            env=clean_env(SANDBOX_TOKEN=token), cwd=REPO)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line:
            await proc.wait()
            tail = log.read_text(errors="replace").strip().splitlines()[-1:]
            raise RuntimeError(f"the partner simulator exited {proc.returncode} before it "
                               f"listened: {tail[0] if tail else '(no output)'}; see {log}")
        url = json.loads(line)["url"]
        if not sc.cell.gateway:
            yield Partner(url, token, http, proc.pid)
        else:
            from gateway import nginx  # gateway imports this module
            gw_log = log_path(sc.name, sc.cell.name, f"{tool}-gateway" if tool else "gateway")
            upstream = int(url.rpartition(":")[2])
            async with nginx(sc.cell.gateway, sc.partner_rate, upstream, gw_log) as gw:
                yield Partner(url, token, http, proc.pid, gw)
    finally:
        await stop_process(proc, grace_s=10)


class Emulator:
    """The Infrai emulator process: its URL, API key, and its call counts."""

    def __init__(self, url: str, key: str, control: str, http: aiohttp.ClientSession) -> None:
        self.url, self.key, self.http = url, key, http
        self.headers = {"X-Emulator-Control": control}

    async def stats(self) -> dict[str, Any]:
        async with self.http.get(f"{self.url}/_emulator/stats", headers=self.headers) as resp:
            return dict(await resp.json())


@contextlib.asynccontextmanager
async def infrai_emulator(sc: Scenario, http: aiohttp.ClientSession) -> AsyncIterator[Emulator]:
    """A fresh Infrai emulator for one run, every call ``sc.infrai_latency_ms`` slower."""
    key, control = "ifr_" + secrets.token_urlsafe(18), secrets.token_urlsafe(18)
    log = log_path(sc.name, sc.cell.name, "infrai")
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            PY, "-m", "cleanup_sandbox.infrai", "--port", "0", "--key-env", "EMU_KEY",
            "--control-key-env", "EMU_CONTROL", "--latency-ms", str(sc.infrai_latency_ms),
            stdout=asyncio.subprocess.PIPE, stderr=err,
            env=clean_env(EMU_KEY=key, EMU_CONTROL=control), cwd=REPO)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line:
            await proc.wait()
            raise RuntimeError(f"the Infrai emulator exited {proc.returncode}; see {log}")
        yield Emulator(json.loads(line)["url"], key, control, http)
    finally:
        await stop_process(proc, grace_s=10)


async def drive_events(sc: Scenario, partner: Partner, t0: float,
                       applied: list[tuple[float, dict[str, float]]]) -> None:
    """Apply the scenario's partner events on time, relative to the tick at ``t0``."""
    for event in sorted(sc.events, key=lambda e: e.at_s):
        await asyncio.sleep(max(0.0, t0 + event.at_s - time.monotonic()))
        await partner.control(event.control())
        applied.append((time.monotonic() - t0, event.control()))


# -- the service's /metrics ------------------------------------------------------------


def parse_metrics(text: str) -> tuple[float | None, float]:
    """The limiter's rate (the first series, labelled or not) and the 429s answered so far."""
    rate: float | None = None
    throttled = 0.0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        try:
            if name == RATE_METRIC and rate is None:
                rate = float(value)
            elif name == RESPONSES_METRIC and 'status="429"' in labels:
                throttled += float(value)
        except ValueError:
            continue
    return rate, throttled


async def scrape_metrics(http: aiohttp.ClientSession, url: str, t0: float,
                         samples: list[Sample], interval_s: float = 0.25) -> None:
    """Every ``interval_s``: (seconds since tick, limiter rate, 429s answered so far)."""
    while True:
        started = time.monotonic()
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with http.get(f"{url}/metrics") as resp:
                text = await resp.text()
            rate, throttled = parse_metrics(text)
            samples.append((started - t0, rate, throttled))
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))


# -- the service's config ---------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def dump_toml(doc: dict[str, dict[str, Any]]) -> str:
    """The config as TOML: scalars and arrays inline, ``[[section.key]]`` for arrays of
    tables (``[[limits.quota]]``), ``[section.key]`` for sub-tables."""
    lines: list[str] = []
    for section, table in doc.items():
        lines.append(f"[{section}]")
        nested = {k: v for k, v in table.items() if isinstance(v, dict) or _is_table_array(v)}
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if k not in nested]
        lines.append("")
        for key, value in nested.items():
            for item in (value if isinstance(value, list) else [value]):
                lines.append(f"[[{section}.{key}]]" if isinstance(value, list)
                             else f"[{section}.{key}]")
                lines += [f"{k} = {_toml_value(v)}" for k, v in item.items()]
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


def service_config(sc: Scenario, data_dir: Path, port: int, partner: Partner,
                   overrides: dict[str, dict[str, Any]],
                   source_file: Path | None = None) -> dict[str, dict[str, Any]]:
    """config/default.toml for one run. ``source_file``: a JSONL source of IDs instead
    of paging the partner's listing (the multi-tick scenario: each tick its own IDs).
    The listing is read from the simulator itself (the team's own data, not behind the
    partner's gateway); deletes go to ``partner.api_url``."""
    partner_url = partner.url
    doc: dict[str, dict[str, Any]] = tomllib.loads((REPO / "config/default.toml").read_text())
    doc.pop("schedule", None)
    doc["service"].update(data_dir=str(data_dir), listen=f"127.0.0.1:{port}",
                          log_level="warning")
    if source_file is None:
        doc["source"].update(kind="http", url=f"{partner_url}/stale-recipients",
                             token_env="CUSTOMER_API_TOKEN")
    else:
        for key in ("url", "items_field", "next_cursor_field", "token_env"):
            doc["source"].pop(key, None)
        doc["source"].update(kind="file", path=str(source_file), format="jsonl")
    doc["partner"].update(base_url=partner.api_url)
    doc["limits"].update(rate_per_second=sc.ceiling, concurrency=sc.concurrency)
    for section, key, value in sc.service_set:
        doc.setdefault(section, {})[key] = value
    for section, table in overrides.items():
        doc.setdefault(section, {}).update(table)
    return doc


def write_ids(path: Path, population: int, first: int, count: int) -> None:
    """IDs ``first+1 .. first+count`` of a partner holding ``population`` (its naming)."""
    width = max(6, len(str(population)))
    with path.open("w") as fh:
        for i in range(first + 1, first + count + 1):
            fh.write(f'{{"id": "r-{i:0{width}d}"}}\n')


# -- the service process ----------------------------------------------------------------


class Service:
    """``supervisor serve`` on a fixed config, port and data dir; startable again."""

    def __init__(self, http: aiohttp.ClientSession, config: Path, port: int, cwd: Path,
                 log: Path, env: dict[str, str]) -> None:
        self.http, self.config, self.port, self.cwd, self.log = http, config, port, cwd, log
        self.trigger_token = secrets.token_urlsafe(24)  # 32 characters: the minimum
        self.env = {**env, "CLEANUP_TRIGGER_TOKEN": self.trigger_token}
        self.base = f"http://127.0.0.1:{port}"
        self.auth = {"Authorization": f"Bearer {self.trigger_token}"}
        self.proc: asyncio.subprocess.Process | None = None
        self.starts = 0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self, ready_within_s: float = 30.0) -> None:
        self.starts += 1
        with self.log.open("ab") as log:
            log.write(f"--- bench: start #{self.starts}\n".encode())
            log.flush()
            self.proc = await asyncio.create_subprocess_exec(
                PY, "-m", "supervisor", "serve", "--config", str(self.config), cwd=self.cwd,
                stdout=log, stderr=log, env=self.env)
        deadline = time.monotonic() + ready_within_s
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                raise RuntimeError(f"service exited {self.proc.returncode} at start-up "
                                   f"({self.log_tail()}); see {self.log}")
            with contextlib.suppress(aiohttp.ClientError):
                async with self.http.get(f"{self.base}/readyz") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"service not ready within {ready_within_s:g} s; see {self.log}")

    def log_tail(self, lines: int = 2) -> str:
        with contextlib.suppress(OSError):
            text = self.log.read_text(errors="replace").strip().splitlines()
            tail = [line.strip() for line in text if not line.startswith("--- bench:")]
            return " / ".join(tail[-lines:])[-400:] or "no output"
        return "no log"

    async def stop(self) -> int | None:
        """SIGTERM (SIGKILL after 30 s); the exit code."""
        if self.proc is None:
            return None
        return await stop_process(self.proc, grace_s=30)

    async def tick(self) -> str:
        """POST /v1/runs (keyed, so a second tick is a new run); the run's ID."""
        headers = {**self.auth, "Idempotency-Key": f"bench-{uuid.uuid4().hex}"}
        async with self.http.post(f"{self.base}/v1/runs", headers=headers,
                                  json={"schedule": "bench"}) as resp:
            opened = await resp.json()
            if resp.status >= 300:
                raise RuntimeError(f"trigger refused: {resp.status} {opened}")
        if opened.get("created") is False:
            raise RuntimeError(f"the tick opened no new run (deduplicated): {opened}")
        return str(opened["run"]["id"])

    async def wait_run(self, run_id: str, deadline: float) -> dict[str, Any]:
        """Long-poll the run until it is done or ``deadline`` (monotonic) passes."""
        while True:
            timeout = max(1, min(5, math.ceil(deadline - time.monotonic())))
            async with self.http.get(f"{self.base}/v1/runs/{run_id}?wait=done&timeout={timeout}",
                                     headers=self.auth) as resp:
                run = await resp.json()
                if resp.status >= 300:
                    raise RuntimeError(f"GET /v1/runs/{run_id}: {resp.status} {run}")
            if run["state"] == "done" or time.monotonic() >= deadline:
                return dict(run)
