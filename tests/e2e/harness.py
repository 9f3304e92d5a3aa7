"""The harness of the end-to-end suite (its fixtures: tests/e2e/conftest.py).

Every test drives real processes over loopback HTTP:

* the partner simulator, ``python -m cleanup_sandbox`` (prints ``{"url", "pid"}`` once
  listening);
* the Infrai queue emulator, ``python -m cleanup_sandbox.infrai`` (prints ``{"url",
  "pid"}`` once listening), for services configured with ``queue.backend = "infrai"``;
* the service, ``python -m supervisor serve --config <tmp toml>`` (logs a line with
  ``action=started`` on stderr once listening), restartable on the same data dir.

Synchronisation goes through events the processes publish: the service's log lines, the
service's ``?wait=done`` long-poll and the simulator's ``/_sandbox/wait`` long-poll. Every
process a test starts is killed at teardown, pass or fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.e2e.ledger_file import LedgerRows, read_ledger
from tests.helpers import Metrics, free_port

STARTUP_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 15.0
# The longest a test waits for a run to finish; every test is sized to finish far sooner.
RUN_TIMEOUT_S = 45.0

Sections = Mapping[str, Mapping[str, Any]]


# -- small helpers ------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return orjson.dumps(str(value)).decode()  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table: how an array of tables is written here
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")


def toml_text(sections: Sections) -> str:
    lines: list[str] = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
        lines.append("")
    return "\n".join(lines)


def merge(base: Sections, overrides: Sections) -> dict[str, dict[str, Any]]:
    out = {name: dict(table) for name, table in base.items()}
    for name, table in overrides.items():
        out.setdefault(name, {}).update(table)
    return out


async def _json(resp: aiohttp.ClientResponse) -> Any:
    body = await resp.read()
    ctype = resp.headers.get("Content-Type", "")
    if not ctype.startswith("application/json"):
        return body.decode(errors="replace")
    return orjson.loads(body) if body else None


# -- process bookkeeping ------------------------------------------------------------


class Processes:
    """Every child a test started; :meth:`close` kills whatever still runs."""

    def __init__(self) -> None:
        self._procs: list[asyncio.subprocess.Process] = []

    def add(self, proc: asyncio.subprocess.Process) -> None:
        self._procs.append(proc)

    async def close(self) -> None:
        for proc in self._procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        for proc in self._procs:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EXIT_TIMEOUT_S):
                    await proc.wait()


# -- the partner simulator ----------------------------------------------------------


class Sandbox:
    """One simulator process and a client for its ``/_sandbox`` endpoints."""

    def __init__(self, url: str, proc: asyncio.subprocess.Process, token: str,
                 http: aiohttp.ClientSession, args: tuple[str, ...]) -> None:
        self.url = url
        self.proc = proc
        self.args = args
        self._auth = {"Authorization": f"Bearer {token}"}
        self._http = http

    async def _get(self, path: str, **params: Any) -> tuple[int, Any]:
        async with self._http.get(f"{self.url}{path}", params=params, headers=self._auth) as r:
            return r.status, await _json(r)

    async def stats(self) -> dict[str, Any]:
        status, doc = await self._get("/_sandbox/stats")
        assert status == 200, doc
        return dict(doc)

    async def wait(self, within_s: float = 30.0, **targets: int) -> dict[str, Any]:
        """Long-poll until every counter named (executions, pages, requests) reaches its target."""
        status, doc = await self._get("/_sandbox/wait", timeout=within_s, **targets)
        assert status == 200, f"sandbox never reached {targets}: {doc}"
        return dict(doc)

    async def control(self, **changes: float) -> dict[str, Any]:
        async with self._http.post(f"{self.url}/_sandbox/control", json=changes,
                                   headers=self._auth) as r:
            doc = await _json(r)
            assert r.status == 200, doc
            return dict(doc)

    async def log(self) -> list[dict[str, Any]]:
        status, doc = await self._get("/_sandbox/log")
        assert status == 200, doc
        return list(doc)

    async def requests(self) -> list[dict[str, Any]]:
        """Every authorised DELETE the partner received: arrival, answer, and how many of
        the same recipient were in the air when it arrived."""
        status, doc = await self._get("/_sandbox/requests")
        assert status == 200, doc
        return list(doc)


# -- the Infrai queue emulator --------------------------------------------------------

INFRAI_QUEUE = "cleanup-e2e"
# The adapter keys each publish "pub-<operation id>-<random>" (supervisor/infrai/queue.py):
# the emulator's call log keeps no payloads, so this key is how a message is tied to its
# operation from the emulator's side.
_PUBLISH_KEY = re.compile(r"^pub-(?P<op>.+)-[0-9a-f]+$")


@dataclass
class InfraiMessages:
    """The emulator's messages of one queue, rebuilt from its call log."""

    operation_of: dict[str, str]  # message_id -> operation_id, every message published
    acked: set[str]  # message_ids an ack call named (acked:false ones too)
    deliveries: Counter[str]  # message_id -> times a consume handed it out
    delivered_at: dict[str, list[float]]  # message_id -> each consume's emulator time
    acked_at: dict[str, float]  # message_id -> the first ack's emulator time

    @property
    def held(self) -> dict[str, str]:
        """message_id -> operation_id of every message still in the queue (visible,
        delayed or leased): published and never acked."""
        return {m: op for m, op in self.operation_of.items() if m not in self.acked}

    def by_operation(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for m, op in self.held.items():
            out.setdefault(op, set()).add(m)
        return out

    def publishes_of(self) -> Counter[str]:
        return Counter(self.operation_of.values())


class Infrai:
    """One emulator process and a client for its ``/_emulator`` control surface."""

    def __init__(self, url: str, proc: asyncio.subprocess.Process, key: str, control_key: str,
                 http: aiohttp.ClientSession, args: tuple[str, ...],
                 queue: str = INFRAI_QUEUE) -> None:
        self.url = url
        self.proc = proc
        self.key = key
        self.args = args
        self.queue = queue
        self._control = {"X-Emulator-Control": control_key}
        self._http = http
        self._log: list[dict[str, Any]] = []

    def overrides(self, **infrai: Any) -> Sections:
        """The service configuration that consumes from this emulator: quick client
        retries (a burst must delay a call, not fail it for long) unless overridden."""
        return {"queue": {"backend": "infrai"},
                "infrai": {"base_url": self.url, "queue": self.queue,
                           "backoff_initial_seconds": 0.05, "backoff_max_seconds": 0.5,
                           "request_timeout_seconds": 5.0, **infrai}}

    async def _get(self, path: str, **params: Any) -> Any:
        async with self._http.get(f"{self.url}{path}", params=params,
                                  headers=self._control) as r:
            doc = await _json(r)
            assert r.status == 200, doc
            return doc

    async def control(self, **faults: Any) -> dict[str, Any]:
        """POST /_emulator/faults: change fault fields at runtime; returns them all."""
        async with self._http.post(f"{self.url}/_emulator/faults", json=faults,
                                   headers=self._control) as r:
            doc = await _json(r)
            assert r.status == 200, doc
            return dict(doc)

    async def stats(self) -> dict[str, Any]:
        return dict(await self._get("/_emulator/stats"))

    async def queue_stats(self) -> dict[str, int]:
        """The counters of this service's queue (zeros before it exists)."""
        return dict((await self.stats())["queues"].get(self.queue, {}))

    async def log(self) -> list[dict[str, Any]]:
        """Every /v1 call so far, in order (fetched incrementally)."""
        since = self._log[-1]["seq"] if self._log else 0
        self._log += await self._get("/_emulator/log", since=since)
        # seq is dense from 1: a gap means the emulator's log_limit dropped entries.
        assert not self._log or self._log[-1]["seq"] == len(self._log), \
            "the emulator's call log dropped entries (raise its --log-limit)"
        return self._log

    async def messages(self) -> InfraiMessages:
        """What the queue holds, by operation, from the publish, consume and ack entries
        of the call log (the emulator lists no messages by payload)."""
        operation_of: dict[str, str] = {}
        acked: set[str] = set()
        deliveries: Counter[str] = Counter()
        delivered_at: dict[str, list[float]] = {}
        acked_at: dict[str, float] = {}
        for e in await self.log():
            if not e["ok"] or e["queue"] != self.queue:
                continue
            if e["capability"] == "queue.publish":
                m = _PUBLISH_KEY.match(e["idempotency_key"] or "")
                assert m is not None, f"publish not keyed by its operation: {e}"
                [message_id] = e["message_ids"]
                operation_of[message_id] = m["op"]
            elif e["capability"] == "queue.consume":
                for message_id in e["message_ids"]:
                    deliveries[message_id] += 1
                    delivered_at.setdefault(message_id, []).append(e["t"])
            elif e["capability"] == "queue.ack":
                [message_id] = e["message_ids"]
                acked.add(message_id)
                acked_at.setdefault(message_id, e["t"])
        return InfraiMessages(operation_of, acked, deliveries, delivered_at, acked_at)


# -- the service ---------------------------------------------------------------------


class ServiceProcess:
    """One ``serve`` process; its stderr is read line by line into :attr:`lines`."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = asyncio.Event()
        self._eof = False
        self._reader = asyncio.create_task(self._read(), name=f"stderr-{proc.pid}")

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        try:
            while line := await self.proc.stderr.readline():
                self.lines.append(line.decode(errors="replace").rstrip("\n"))
                self._notify()
        finally:
            self._eof = True
            self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    async def wait_for_line(self, pattern: str, within_s: float = STARTUP_TIMEOUT_S,
                            after: int = 0) -> str:
        """The first stderr line matching ``pattern`` (at index ``after`` or later); fails
        if the process ends first."""
        regex = re.compile(pattern)
        seen = after
        try:
            async with asyncio.timeout(within_s):
                while True:
                    for line in self.lines[seen:]:
                        if regex.search(line):
                            return line
                    seen = len(self.lines)
                    if self._eof:
                        break
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"no log line /{pattern}/ within {within_s}s:\n{self.tail()}"
                                 ) from None
        raise AssertionError(f"service exited ({self.proc.returncode}) before logging "
                             f"/{pattern}/:\n{self.tail()}")

    def send(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    async def wait_exit(self, within_s: float = EXIT_TIMEOUT_S) -> int:
        try:
            async with asyncio.timeout(within_s):
                code = await self.proc.wait()
                await self._reader
        except TimeoutError:
            raise AssertionError(f"service still running {within_s}s later:\n{self.tail()}"
                                 ) from None
        return code

    async def close(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(EXIT_TIMEOUT_S):
                await self.proc.wait()
                await self._reader


class Service:
    """A service configuration on one data dir; :meth:`start` runs it as a process, again
    and again (after a kill the next process resumes from the same ledger)."""

    def __init__(self, e2e: E2E, config: dict[str, dict[str, Any]], name: str,
                 infrai: Infrai | None = None) -> None:
        self.e2e = e2e
        self.config = config
        # The emulator its queue lives in (queue.backend = "infrai"), and the project key
        # in its environment; None for the embedded queue.
        self.infrai = infrai
        self.env = dict(e2e.env)
        if infrai is not None:
            self.env["INFRAI_API_KEY"] = infrai.key
        self.port = int(config["service"]["listen"].rpartition(":")[2])
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = Path(config["service"]["data_dir"])
        self.config_path = e2e.tmp_path / f"{name}.toml"
        self.config_path.write_text(toml_text(config), encoding="utf-8")
        self.current: ServiceProcess | None = None
        self.history: list[ServiceProcess] = []
        self._auth = {"Authorization": f"Bearer {e2e.trigger_token}"}

    # process control

    # What a subclass changes of its processes: their class, global flags, and whether
    # their stdout is kept (the fault suite's are).
    process_type: type[ServiceProcess] = ServiceProcess
    global_args: tuple[str, ...] = ()
    keep_stdout = False

    async def spawn(self) -> ServiceProcess:
        """Start a ``serve`` process without waiting for it to listen."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "supervisor", *self.global_args, "serve",
            "--config", str(self.config_path), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if self.keep_stdout else asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=self.env)
        self.e2e.processes.add(proc)
        sp = self.process_type(proc)
        self.history.append(sp)
        self.current = sp
        return sp

    async def start(self) -> ServiceProcess:
        """Start a process and return once it logs ``action=started`` (it listens).

        A first start whose port another process took between free_port() and the bind
        (a busy machine runs other suites, benchmarks, brokers) moves to a new port; a
        restart keeps its URL, which the test may hold."""
        for attempt in range(3):
            sp = await self.spawn()
            try:
                line = await sp.wait_for_line(r"\baction=started\b")
            except AssertionError as exc:
                taken = "address already in use" in str(exc)
                if not taken or self.history[:-1] or attempt == 2:
                    raise
                await sp.proc.wait()
                self.history.remove(sp)
                self._move(free_port())
                continue
            assert f"listening on {self.url};" in line, line
            return sp
        raise AssertionError("unreachable")

    def _move(self, port: int) -> None:
        self.config["service"]["listen"] = f"127.0.0.1:{port}"
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.config_path.write_text(toml_text(self.config), encoding="utf-8")

    async def kill(self) -> int:
        """SIGKILL: no drain, no commit of anything in progress."""
        assert self.current is not None
        self.current.send(signal.SIGKILL)
        code = await self.current.wait_exit()
        assert code == -signal.SIGKILL, code
        return code

    # HTTP API

    async def request(self, method: str, path: str, *, auth: bool = True,
                      **kwargs: Any) -> tuple[int, Any]:
        headers = dict(kwargs.pop("headers", {}))
        if auth:
            headers.setdefault("Authorization", self._auth["Authorization"])
        async with self.e2e.http.request(method, f"{self.url}{path}", headers=headers,
                                         **kwargs) as resp:
            return resp.status, await _json(resp)

    async def trigger(self, **body: Any) -> tuple[int, Any]:
        return await self.request("POST", "/v1/runs", json=body)

    async def open_run(self, **body: Any) -> str:
        status, doc = await self.trigger(**body)
        assert status == 201, (status, doc)
        assert doc["created"] is True, doc
        return str(doc["run"]["id"])

    async def run(self, run_id: str) -> dict[str, Any]:
        status, doc = await self.request("GET", f"/v1/runs/{run_id}")
        assert status == 200, doc
        return dict(doc)

    async def wait_done(self, run_id: str, within_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:
        """Long-poll ``?wait=done`` until the run is done; fail after ``within_s``."""
        deadline = time.monotonic() + within_s
        while True:
            left = int(min(30, max(1, deadline - time.monotonic())))
            status, doc = await self.request("GET", f"/v1/runs/{run_id}?wait=done&timeout={left}")
            assert status == 200, doc
            if doc["state"] == "done":
                return dict(doc)
            if time.monotonic() >= deadline:
                raise AssertionError(f"run {run_id} not done after {within_s}s: {doc}")

    async def operations(self, run_id: str, state: str | None = None) -> list[dict[str, Any]]:
        """Every operation of the run (in discovery order), paged through the API."""
        out: list[dict[str, Any]] = []
        after = ""
        while True:
            path = f"/v1/runs/{run_id}/operations?limit=1000&after={after}"
            if state is not None:
                path += f"&state={state}"
            status, doc = await self.request("GET", path)
            assert status == 200, doc
            out += doc["operations"]
            if doc["next_after"] is None:
                return out
            after = doc["next_after"]

    async def operation(self, op_id: str) -> dict[str, Any]:
        status, doc = await self.request("GET", f"/v1/operations/{op_id}")
        assert status == 200, doc
        return dict(doc)

    async def metrics(self) -> Metrics:
        # Open by default; with service.metrics_token_env set the operator's token reads too.
        async with self.e2e.http.get(f"{self.url}/metrics", headers=self._auth) as resp:
            assert resp.status == 200
            return Metrics(await resp.text())

    async def paused_until(self, within_s: float = 5.0) -> float:
        """The paused-until gauge once it is set (0 if not by the deadline). A gauge has no
        event to wait for and the monitor refreshes it each second: this reads /metrics
        every 50 ms until the deadline."""
        deadline = time.monotonic() + within_s
        while True:
            value = (await self.metrics()).value("cleanup_limiter_paused_until_timestamp_seconds")
            if value > 0 or time.monotonic() >= deadline:
                return value
            await asyncio.sleep(0.05)

    # the ledger file, read directly only while no process holds it

    @property
    def ledger_path(self) -> Path:
        return self.data_dir / "cleanup.sqlite3"

    def ledger(self) -> LedgerRows:
        """Read the ledger file; only while no process of this service runs."""
        assert self.current is None or self.current.proc.returncode is not None
        return read_ledger(self.ledger_path, embedded=self.infrai is None)


class E2E:
    """Factories for sandboxes and services, and the checks every drain test ends with."""

    def __init__(self, tmp_path: Path, http: aiohttp.ClientSession,
                 processes: Processes) -> None:
        self.tmp_path = tmp_path
        self.http = http
        self.processes = processes
        self.partner_token = secrets.token_urlsafe(24)
        self.trigger_token = secrets.token_urlsafe(24)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CLEANUP")}
        self.env.update({"CUSTOMER_API_TOKEN": self.partner_token,
                         "CLEANUP_TRIGGER_TOKEN": self.trigger_token,
                         "SANDBOX_TOKEN": self.partner_token,
                         "PYTHONUNBUFFERED": "1"})
        self.services: list[Service] = []

    async def _listening(self, what: str, module: str, argv: tuple[str, ...],
                         env: dict[str, str]) -> tuple[str, asyncio.subprocess.Process]:
        """Start ``python -m module --port 0 argv`` and read the URL it prints once it
        listens."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, "--port", "0", *argv,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, env=env)
        self.processes.add(proc)
        assert proc.stdout is not None
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            line = await proc.stdout.readline()
        if not line:
            raise AssertionError(f"the {what} exited ({await proc.wait()}) before it "
                                 f"listened; args {argv}")
        return str(orjson.loads(line)["url"]), proc

    async def sandbox(self, *args: str | float) -> Sandbox:
        argv = tuple(str(a) for a in args)
        url, proc = await self._listening("partner simulator", "cleanup_sandbox",
                                          ("--token-env", "SANDBOX_TOKEN", *argv), self.env)
        return Sandbox(url, proc, self.partner_token, self.http, argv)

    async def infrai(self, *args: str | float) -> Infrai:
        """Start the Infrai emulator (``args`` are its flags, one per EmulatorConfig
        field) with a project key and a control key of its own."""
        argv = tuple(str(a) for a in args)
        key = "ifr_" + secrets.token_urlsafe(24)
        control_key = secrets.token_urlsafe(24)
        env = {**self.env, "E2E_INFRAI_KEY": key, "E2E_INFRAI_CONTROL_KEY": control_key}
        url, proc = await self._listening(
            "Infrai emulator", "cleanup_sandbox.infrai",
            ("--key-env", "E2E_INFRAI_KEY", "--control-key-env", "E2E_INFRAI_CONTROL_KEY",
             *argv), env)
        return Infrai(url, proc, key, control_key, self.http, argv)

    def service(self, sandbox: Sandbox | None, overrides: Sections | None = None,
                name: str = "service", infrai: Infrai | None = None) -> Service:
        """A service on ``sandbox``; with ``infrai`` its queue is that emulator's
        (``queue.backend = "infrai"``, the project key in its environment)."""
        partner_url = sandbox.url if sandbox else "http://127.0.0.1:9"
        base: Sections = {
            "service": {"data_dir": str(self.tmp_path / f"{name}-data"),
                        "listen": f"127.0.0.1:{free_port()}",
                        "shutdown_grace_seconds": 5.0, "log_level": "info"},
            "trigger": {"token_env": "CLEANUP_TRIGGER_TOKEN"},
            "schedule": {"name": "e2e"},
            "source": {"kind": "http", "url": f"{partner_url}/stale-recipients",
                       "token_env": "CUSTOMER_API_TOKEN", "page_size": 500},
            "queue": {"lease_seconds": 30.0},
            "partner": {"base_url": partner_url, "token_env": "CUSTOMER_API_TOKEN",
                        "request_timeout_seconds": 5.0},
            "limits": {"rate_per_second": 300.0, "concurrency": 8},
        }
        if infrai is not None:
            base = merge(base, infrai.overrides())
        svc = Service(self, merge(base, overrides or {}), name, infrai)
        self.services.append(svc)
        return svc

    async def cli(self, *args: str, env: Mapping[str, str] | None = None,
                  ) -> tuple[int, str, str]:
        """Run the console script to completion; return (exit code, stdout, stderr)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "supervisor", *args, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=self.env if env is None else env)
        self.processes.add(proc)
        async with asyncio.timeout(STARTUP_TIMEOUT_S):
            out, err = await proc.communicate()
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def assert_complete(self, svc: Service, run: dict[str, Any], sandbox: Sandbox,
                              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The checks every drain ends with, against the API and the partner's own record.

        Every operation terminal and accounted for, one operation per candidate, one
        executed DELETE per recipient, each sent with the operation ID as Idempotency-Key.
        """
        stats = await sandbox.stats()
        population = stats["population"]
        counts = run["counts"]
        assert run["state"] == "done", run
        assert run["unfinished"] == 0, run
        assert run["discovered"] == population, (run, stats)
        assert counts["failed"] == 0, run
        assert counts["ambiguous"] == 0, run
        assert counts["deleted"] + counts["already_absent"] == population, run
        assert sum(counts.values()) == population, run
        # What the API reports is what the partner saw.
        assert counts["deleted"] == stats["deleted"], (run, stats)
        assert counts["already_absent"] == stats["initially_absent"], (run, stats)
        assert stats["present"] == 0, stats
        assert stats["duplicates"] == 0, stats
        assert stats["executions"] == population, stats

        ops = await svc.operations(run["id"])
        assert len(ops) == population
        assert len({op["recipient_id"] for op in ops}) == population
        assert len({op["id"] for op in ops}) == population
        assert {op["state"] for op in ops} <= {"deleted", "already_absent"}
        key_of = {e["recipient_id"]: e["idempotency_key"] for e in await sandbox.log()}
        wrong = [op for op in ops if key_of.get(op["recipient_id"]) != op["id"]]
        assert not wrong, f"{len(wrong)} deletes not keyed by their operation ID: {wrong[:3]}"
        return ops, stats
