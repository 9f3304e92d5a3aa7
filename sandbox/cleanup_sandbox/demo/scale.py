"""``cleanup-supervisor demo --shape scale``: three replicas on one PostgreSQL, one budget.

The scenario of packaging/compose.yaml without containers: the partner simulator in its
own process, three ``serve`` processes on this machine's PostgreSQL (``$CLEANUP_DATABASE_URL``,
else postgres on 127.0.0.1:5432) in a schema of their own, dropped afterwards. The tick
goes to one replica; all three drain it through one shared rate budget. The last lines
are the demo's figures and what each replica did.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from cleanup_sandbox.demo import DemoOptions, _drive, demo_environ, sandbox_process

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
REPLICAS = 3
START_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    name: str
    url: str
    proc: asyncio.subprocess.Process
    lines: list[str]

    def tail(self, n: int = 15) -> str:
        return "\n".join(f"  {self.name}| {line}" for line in self.lines[-n:])


async def _start(name: str, config_path: Path, env: dict[str, str]) -> Replica:
    port = _free_port()
    env = {**env, "CLEANUP__SERVICE__LISTEN": f"127.0.0.1:{port}",
           "CLEANUP__SERVICE__DATA_DIR": env["CLEANUP__SERVICE__DATA_DIR"] + f"/{name}"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor", "serve", "--config", str(config_path),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, env=env)
    assert proc.stderr is not None
    lines: list[str] = []
    async with asyncio.timeout(START_TIMEOUT_S):
        while True:
            line = await proc.stderr.readline()
            if not line:
                raise RuntimeError(f"replica {name} exited ({await proc.wait()}) before it "
                                   "listened: " + " | ".join(lines[-5:]))
            lines.append(line.decode(errors="replace").rstrip())
            if b"action=started" in line:
                break
    replica = Replica(name, f"http://127.0.0.1:{port}", proc, lines)
    # Keep reading its log (shown if the demo fails) so the pipe never fills.
    asyncio.get_running_loop().create_task(_read(replica))
    return replica


async def _read(replica: Replica) -> None:
    assert replica.proc.stderr is not None
    while line := await replica.proc.stderr.readline():
        replica.lines.append(line.decode(errors="replace").rstrip())
        del replica.lines[:-200]


async def _counts(session: aiohttp.ClientSession, replica: Replica) -> dict[str, float]:
    async with session.get(f"{replica.url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "cleanup_operations_total":
                out[s.labels["outcome"]] = s.value
            elif s.name == "cleanup_partner_responses_total" and s.labels.get("status") == "429":
                out["429"] = out.get("429", 0.0) + s.value
            elif s.name == "cleanup_role_held" and s.value == 1:
                out[f"role:{s.labels['role']}"] = 1
    return out


async def run_scale(opts: DemoOptions) -> int:
    dsn = os.environ.get("CLEANUP_DATABASE_URL", DEFAULT_DSN)
    schema = f"demo_{secrets.token_hex(4)}"
    partner_token = secrets.token_urlsafe(24)
    trigger_token = secrets.token_urlsafe(24)
    sandbox_args = ["--recipients", str(opts.recipients), "--rate", str(opts.partner_rate),
                    "--absent-share", str(opts.absent_share)]
    replicas: list[Replica] = []
    code = 1
    with tempfile.TemporaryDirectory(prefix="cleanup-scale-") as data_dir:
        async with sandbox_process(sandbox_args, partner_token) as sandbox:
            env = demo_environ(data_dir, sandbox.url, partner_token, trigger_token, {
                "CLEANUP__LEDGER__BACKEND": "postgres", "CLEANUP__QUEUE__BACKEND": "postgres",
                "CLEANUP__LEDGER__SCHEMA": schema, "CLEANUP_DATABASE_URL": dsn,
                "CLEANUP__PARTNER__REQUEST_TIMEOUT_SECONDS": "2"})
            try:
                replicas = list(await asyncio.gather(*(
                    _start(f"replica-{i + 1}", opts.config_path, env) for i in range(REPLICAS))))
                print(f"partner simulator {sandbox.url}: {opts.recipients} stale recipients, "
                      f"limit {opts.partner_rate:g}/s; {REPLICAS} replicas "
                      f"({', '.join(r.url for r in replicas)}) on PostgreSQL schema {schema}",
                      flush=True)
                started = time.monotonic()
                report = await _drive(replicas[0].url, sandbox.url, trigger_token,
                                      partner_token)
                async with aiohttp.ClientSession() as session:
                    per_replica = [await _counts(session, r) for r in replicas]
                ideal = opts.recipients / opts.partner_rate
                report["ideal_seconds"] = round(ideal, 1)
                print(f"\nrun {report.pop('run_id')}: ratio to ideal "
                      f"{report['seconds'] / ideal:.3f}, partner saw "
                      f"{report.pop('executions')} executed deletes, "
                      f"{time.monotonic() - started:.1f}s")
                keys = ("discovered", "deleted", "already_absent", "failed", "ambiguous",
                        "duplicates", "rate_limited", "seconds", "ideal_seconds")
                print(" ".join(f"{k}={report[k]}" for k in keys), flush=True)
                for r, counts in zip(replicas, per_replica, strict=True):
                    roles = ",".join(sorted(k[5:] for k in counts if k.startswith("role:")))
                    print(f"{r.name}: deleted={int(counts.get('deleted', 0))} "
                          f"already_absent={int(counts.get('already_absent', 0))} "
                          f"429s={int(counts.get('429', 0))} roles={roles or '-'}", flush=True)
                settled = sum(c.get("deleted", 0) + c.get("already_absent", 0)
                              for c in per_replica)
                code = 0 if (report["duplicates"] == 0 and report["failed"] == 0
                             and report["unfinished"] == 0 and settled == opts.recipients
                             and report["discovered"] == opts.recipients) else 1
            finally:
                if code != 0:
                    for r in replicas:
                        print(f"{r.name} log (last lines):\n{r.tail()}", file=sys.stderr)
                for r in replicas:
                    if r.proc.returncode is None:
                        r.proc.terminate()
                for r in replicas:
                    with contextlib.suppress(ProcessLookupError):
                        await r.proc.wait()
                await _drop(dsn, schema)
    return code


async def _drop(dsn: str, schema: str) -> None:
    with contextlib.suppress(OSError, asyncpg.PostgresError):
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        finally:
            await conn.close()
