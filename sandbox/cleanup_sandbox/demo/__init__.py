"""``cleanup-supervisor demo``: the real service against the partner simulator, end to end.

The simulator runs in its own process on loopback; the service runs here on the default
configuration, pointed at it. A run is opened over HTTP, progress is shown live, and the
last line of the report is ``key=value`` figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from supervisor import config, metrics
from supervisor.batchsettings import BatchConfig
from supervisor.plan import Plan, batching
from supervisor.service import Service
from supervisor.status.history import counter_total


@dataclass(frozen=True, slots=True)
class SandboxProcess:
    url: str
    process: asyncio.subprocess.Process


@contextlib.asynccontextmanager
async def sandbox_process(args: Sequence[str], token: str) -> AsyncIterator[SandboxProcess]:
    """Start ``python -m cleanup_sandbox`` on a free port; stop it with SIGTERM."""
    env = {**os.environ, "SANDBOX_TOKEN": token}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cleanup_sandbox", "--port", "0", "--token-env",
        "SANDBOX_TOKEN", *args, stdout=asyncio.subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if not line:
            raise RuntimeError("the partner simulator exited before it listened")
        yield SandboxProcess(orjson.loads(line)["url"], proc)
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()


@contextlib.asynccontextmanager
async def emulator_process(args: Sequence[str], key: str,
                           control_key: str) -> AsyncIterator[SandboxProcess]:
    """Start ``python -m cleanup_sandbox.infrai`` (the Infrai emulator) on a free port."""
    env = {**os.environ, "EMULATOR_KEY": key, "EMULATOR_CONTROL_KEY": control_key}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cleanup_sandbox.infrai", "--port", "0", "--key-env",
        "EMULATOR_KEY", "--control-key-env", "EMULATOR_CONTROL_KEY", *args,
        stdout=asyncio.subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        line = await proc.stdout.readline()
        if not line:
            raise RuntimeError("the Infrai emulator exited before it listened")
        yield SandboxProcess(orjson.loads(line)["url"], proc)
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()


def demo_environ(data_dir: str, partner_url: str, partner_token: str, trigger_token: str,
                 more: dict[str, str]) -> dict[str, str]:
    """The service's environment for a demo: the caller's, without any CLEANUP__
    override of theirs, then the demo's own settings, then ``more`` (which wins: an
    INFRAI_API_KEY of the caller's must never send a demo to a real account)."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("CLEANUP__")},
        "CUSTOMER_API_TOKEN": partner_token,
        "CLEANUP_TRIGGER_TOKEN": trigger_token,
        "CLEANUP__SERVICE__DATA_DIR": data_dir,
        "CLEANUP__SOURCE__KIND": "http",
        "CLEANUP__SOURCE__URL": f"{partner_url}/stale-recipients",
        "CLEANUP__SOURCE__TOKEN_ENV": "CUSTOMER_API_TOKEN",
        "CLEANUP__PARTNER__BASE_URL": partner_url,
        **more,
    }


async def start_service(service: Service) -> asyncio.Task[int]:
    """Run the service until it has started (or exited: the task is then done)."""
    task = asyncio.create_task(service.run(), name="service")
    started = asyncio.create_task(service.started.wait())
    await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
    started.cancel()
    return task


@dataclass(frozen=True, slots=True)
class DemoOptions:
    config_path: Path
    recipients: int = 3000
    partner_rate: float = 100.0
    absent_share: float = 0.05
    fault_5xx: float = 0.0
    fault_timeout_after_act: float = 0.0
    queue: str = "sqlite"
    # "single": one DELETE per recipient; "batch" (per_item), "per_item", "accepted" or
    # "job": the simulator plays that batch partner and the service is configured for it.
    partner: str = "single"

    @property
    def batch_shape(self) -> str:
        return {"single": "", "batch": "per_item"}.get(self.partner, self.partner)


BATCH_PATHS = {"per_item": "/recipients/batch-delete", "accepted": "/recipients/batch-archive",
               "job": "/recipients/batch-jobs"}
BATCH_SIZE = 100
# The simulated partner's faults and jobs, per shape: the share of ids a per-item answer
# throttles, the share an accepted batch silently leaves in place, and a job partner's
# duration (D) and jobs in flight at once (J), which the service is told as well.
ITEM_THROTTLE_SHARE = 0.02
SILENT_MISS_SHARE = 0.02
JOB_SECONDS = 1.0
MAX_JOBS = 4


def batch_environ(opts: DemoOptions) -> tuple[list[str], dict[str, str]]:
    """The simulator's flags and the service's settings for a batch partner demo."""
    shape = opts.batch_shape
    if not shape:
        return [], {}
    args = ["--batch", shape, "--batch-max-items", str(BATCH_SIZE)]
    env = {"CLEANUP__BATCH__SHAPE": shape, "CLEANUP__BATCH__PATH": BATCH_PATHS[shape],
           "CLEANUP__BATCH__MAX_ITEMS": str(BATCH_SIZE)}
    if shape == "per_item":
        args += ["--batch-item-throttle-share", str(ITEM_THROTTLE_SHARE)]
    elif shape == "accepted":
        args += ["--batch-silent-miss-share", str(SILENT_MISS_SHARE)]
    else:
        args += ["--batch-job-seconds", str(JOB_SECONDS), "--batch-max-jobs", str(MAX_JOBS)]
        # The service is told J too: the ideal reads it from the service's [batch], and a
        # caller's configuration file must not make it other than the partner's.
        env["CLEANUP__BATCH__MAX_JOBS_IN_FLIGHT"] = str(MAX_JOBS)
    return args, env


def ideal_seconds(opts: DemoOptions, batch: BatchConfig) -> float:
    """The least any tool can take, as ``cleanup-supervisor plan`` works it out: N / R for
    single deletes; for a batch partner a request per batch, a probe per id of an accepted
    batch and a job's polls, all at R, and no less than the jobs' own rounds (``batch``:
    the service's [batch], which the demo's settings made the simulator's)."""
    # A job's duration counts only for a job partner (plan.Plan reads it for no other).
    b = batching(batch, job_s=JOB_SECONDS) if opts.batch_shape else None
    # The cron ceiling, start and cutoff play no part in the least time.
    return Plan(candidates=opts.recipients, rate=opts.partner_rate, cron_ceiling_s=900.0,
                limit="known", start=0.0, cutoff_s=None, batch=b).least_s


@dataclass(frozen=True, slots=True)
class ServiceCalls:
    """The service's partner requests the simulator does not count, from this process's
    metrics (the service runs here): probes (GET of one recipient) and job status reads.
    A job lookup by tag (only after a submission's answer was lost) is counted by neither."""

    probes: float
    job_polls: float

    @classmethod
    def now(cls) -> ServiceCalls:
        return cls(counter_total(metrics.PROBES), counter_total(metrics.BATCH_JOB_POLLS))

    def since(self, before: ServiceCalls) -> ServiceCalls:
        return ServiceCalls(self.probes - before.probes, self.job_polls - before.job_polls)


# The machine's brokers unless the environment names others (as the service reads them).
BROKERS = {"redis": ("CLEANUP_REDIS_URL", "redis://127.0.0.1:6379/0"),
           "rabbitmq": ("CLEANUP_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")}


@contextlib.asynccontextmanager
async def broker_queue(kind: str) -> AsyncIterator[dict[str, str]]:
    """The service's environment for a queue of the demo's own on a Redis or RabbitMQ
    broker, removed after the demo (a demo leaves nothing behind on a team's broker)."""
    var, default = BROKERS[kind]
    url = os.environ.get(var, default)
    name = f"cleanup-demo-{secrets.token_hex(4)}"
    if kind == "redis":
        yield {"CLEANUP__QUEUE__BACKEND": "redis", "CLEANUP__QUEUE__REDIS_KEY": name, var: url}
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        try:
            await client.delete(f"{name}:work", f"{name}:delayed", f"{name}:leases")
        finally:
            await client.aclose()
        return
    yield {"CLEANUP__QUEUE__BACKEND": "rabbitmq", "CLEANUP__QUEUE__RABBITMQ_QUEUE": name,
           var: url}
    import aio_pika

    from supervisor.amqp.queue import DELAYS

    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        for queue in (name, *(f"{name}.delay.{d:g}s" for d in DELAYS)):
            await channel.queue_delete(queue)
    finally:
        await connection.close()


async def run_demo(opts: DemoOptions) -> int:
    partner_token = secrets.token_urlsafe(24)
    trigger_token = secrets.token_urlsafe(24)
    sandbox_args = ["--recipients", str(opts.recipients), "--rate", str(opts.partner_rate),
                    "--absent-share", str(opts.absent_share), "--fault-5xx",
                    str(opts.fault_5xx), "--fault-timeout-after-act",
                    str(opts.fault_timeout_after_act), "--hang-seconds", "3"]
    batch_args, batch_env = batch_environ(opts)
    sandbox_args += batch_args
    with tempfile.TemporaryDirectory(prefix="cleanup-demo-") as data_dir:
        async with contextlib.AsyncExitStack() as stack:
            sandbox = await stack.enter_async_context(
                sandbox_process(sandbox_args, partner_token))
            queue_env = {"CLEANUP__QUEUE__BACKEND": "sqlite"}
            emulator: SandboxProcess | None = None
            control_key = secrets.token_urlsafe(24)
            if opts.queue in BROKERS:
                queue_env = await stack.enter_async_context(broker_queue(opts.queue))
            if opts.queue == "infrai":
                infrai_key = "ifr_" + secrets.token_urlsafe(24)
                emulator = await stack.enter_async_context(
                    emulator_process([], infrai_key, control_key))
                queue_env = {"CLEANUP__QUEUE__BACKEND": "infrai",
                             "CLEANUP__INFRAI__BASE_URL": emulator.url,
                             "INFRAI_API_KEY": infrai_key}
            environ = demo_environ(data_dir, sandbox.url, partner_token, trigger_token,
                                   {"CLEANUP__SERVICE__LISTEN": "127.0.0.1:0",
                                    "CLEANUP__PARTNER__REQUEST_TIMEOUT_SECONDS": "2",
                                    **queue_env, **batch_env})
            cfg = config.load(opts.config_path, environ)
            service = Service(cfg)
            calls_before = ServiceCalls.now()
            task = await start_service(service)
            if task.done():
                return await task
            assert service.url is not None
            print(f"partner simulator {sandbox.url}: {opts.recipients} stale recipients, "
                  f"limit {opts.partner_rate:g}/s; service {service.url}, "
                  f"{cfg.limits.concurrency} workers; queue {cfg.queue.backend}"
                  + (f" (Infrai emulator {emulator.url})" if emulator else "")
                  + (f" (key {cfg.queue.redis_key})" if opts.queue == "redis" else "")
                  + (f" (quorum queue {cfg.queue.rabbitmq_queue})"
                     if opts.queue == "rabbitmq" else "")
                  + (f"; batch partner ({opts.batch_shape}, {BATCH_SIZE} ids a request)"
                     if opts.batch_shape else ""), flush=True)
            try:
                report = await _drive(service.url, sandbox.url, trigger_token, partner_token)
                if emulator is not None:
                    report["infrai_calls"] = await _infrai_calls(emulator.url, control_key)
            finally:
                service.request_stop()
                code = await task
            service_calls = ServiceCalls.now().since(calls_before)
    ideal = ideal_seconds(opts, cfg.batch)
    report["ideal_seconds"] = round(ideal, 2)
    per_op = _per_op(report, service_calls, opts.recipients, opts.batch_shape)
    report.update(per_op)
    counts = report
    ok = (code == 0 and counts["duplicates"] == 0 and counts["failed"] == 0
          and counts["unfinished"] == 0 and counts["discovered"] == opts.recipients)
    print(f"\nrun {report.pop('run_id')}: ratio to ideal {report['seconds'] / ideal:.3f}, "
          f"partner saw {report.pop('executions')} executed deletes")
    keys: tuple[str, ...] = ("discovered", "deleted", "already_absent", "failed", "ambiguous",
                             "duplicates", "rate_limited", "seconds", "ideal_seconds",
                             *per_op)
    if "infrai_calls" in report:
        calls = report["infrai_calls"]
        keys += ("infrai_calls",)
        report["infrai_calls_per_op"] = round(calls / max(1, report["discovered"]), 2)
        keys += ("infrai_calls_per_op",)
    print(" ".join(f"{k}={report[k]}" for k in keys), flush=True)
    return 0 if ok else 1


def _per_op(report: dict[str, Any], calls: ServiceCalls, n: int,
            shape: str) -> dict[str, float]:
    """Every request the service made to the partner, per operation, and for a batch
    partner where they went. DELETEs and batch submissions as the simulator counted them
    (a 429 included), probes and job polls as the service did."""
    deletes, batches = report.pop("requests"), report.pop("batch_requests")
    n = max(1, n)
    out = {"requests_per_op":
           round((deletes + batches + calls.probes + calls.job_polls) / n, 3)}
    if shape:
        out |= {"batch_requests_per_op": round(batches / n, 3),
                "probes_per_op": round(calls.probes / n, 3)}
    if shape == "job":
        out["job_polls_per_op"] = round(calls.job_polls / n, 3)
    return out


async def _infrai_calls(emulator_url: str, control_key: str) -> int:
    """Every call the service made to Infrai (each one is billed), from the emulator."""
    async with aiohttp.ClientSession() as session, session.get(
            f"{emulator_url}/_emulator/stats",
            headers={"X-Emulator-Control": control_key}) as resp:
        stats = orjson.loads(await resp.read())
    return int(sum(stats["calls"].values()))


async def _drive(service_url: str, sandbox_url: str, trigger_token: str,
                 partner_token: str) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {trigger_token}"}
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.post(f"{service_url}/v1/runs", headers=auth,
                                json={"schedule": "demo"}) as resp:
            opened = orjson.loads(await resp.read())
            if resp.status >= 300:
                raise RuntimeError(f"trigger refused: {resp.status} {opened}")
        run_id = opened["run"]["id"]
        print(f"tick -> run {run_id} (created={opened['created']})", flush=True)
        while True:
            # The long-poll returns as soon as the run is done, else after a second:
            # that second is the progress line's cadence.
            async with session.get(f"{service_url}/v1/runs/{run_id}?wait=done&timeout=1",
                                   headers=auth) as resp:
                run = orjson.loads(await resp.read())
            c = run["counts"]
            print(f"  {time.monotonic() - started:6.1f}s {run['state']:9} "
                  f"discovered={run['discovered']} deleted={c['deleted']} "
                  f"already_absent={c['already_absent']} waiting={run['unfinished']} "
                  f"failed={c['failed']} ambiguous={c['ambiguous']}", flush=True)
            if run["state"] == "done":
                break
        elapsed = time.monotonic() - started
        async with session.get(f"{sandbox_url}/_sandbox/stats",
                               headers={"Authorization": f"Bearer {partner_token}"}) as resp:
            stats = orjson.loads(await resp.read())
    c = run["counts"]
    return {"run_id": run_id, "discovered": run["discovered"], "deleted": c["deleted"],
            "already_absent": c["already_absent"], "failed": c["failed"],
            "ambiguous": c["ambiguous"], "unfinished": run["unfinished"],
            "duplicates": stats["duplicates"], "rate_limited": stats["rate_limited"],
            "executions": stats["executions"], "requests": stats["requests"],
            "batch_requests": stats.get("batch_requests", 0),
            "seconds": round(elapsed, 1)}


async def run_shape(shape: str, opts: DemoOptions) -> int:
    """The ``demo`` command: ``embedded`` (the default), ``managed`` or ``scale``."""
    if shape == "managed":
        from cleanup_sandbox.demo.managed import run_managed

        return await run_managed(opts)
    if shape == "scale":
        from cleanup_sandbox.demo.scale import run_scale

        return await run_scale(opts)
    return await run_demo(opts)
