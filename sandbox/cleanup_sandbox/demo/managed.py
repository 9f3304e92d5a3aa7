"""``cleanup-supervisor demo --shape managed``: the article's managed shape, end to end.

Infrai cron (the emulator's) calls the trigger; the run's operations are published to an
Infrai queue and pulled; the partner simulator deletes; every settled operation and the
finished run go as events to three sinks: an Infrai queue and two signed webhooks (local
receivers that verify each signature and count each event ID once). The last line is
``key=value`` figures, with the events each sink received.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import tempfile
import time
from typing import Any

import aiohttp
import orjson

from cleanup_sandbox.demo import DemoOptions, demo_environ, emulator_process, sandbox_process, start_service
from cleanup_sandbox.sink import WebhookSink
from supervisor import config
from supervisor.infrai.client import InfraiClient, InfraiError
from supervisor.infrai.cron import InfraiCron
from supervisor.service import Service

EVENTS_QUEUE = "cleanup-events"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run_managed(opts: DemoOptions) -> int:
    partner_token, trigger_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    tick_token = secrets.token_urlsafe(24)  # what Infrai's cron job carries
    infrai_key, control = "ifr_" + secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    hooks = [WebhookSink(f"hook-{i}", f"DEMO_HOOK_{i}") for i in range(2)]
    sandbox_args = ["--recipients", str(opts.recipients), "--rate", str(opts.partner_rate),
                    "--absent-share", str(opts.absent_share)]
    port = free_port()
    service_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="cleanup-demo-") as data_dir:
        async with contextlib.AsyncExitStack() as stack:
            sandbox = await stack.enter_async_context(sandbox_process(sandbox_args, partner_token))
            emulator = await stack.enter_async_context(emulator_process(
                ["--cron-allow-private-targets", "--cron-poll-seconds", "0.05"],
                infrai_key, control))
            for hook in hooks:
                await hook.start()
                stack.push_async_callback(hook.close)
            sinks = (f'[{{name = "warehouse", kind = "infrai", queue = "{EVENTS_QUEUE}"}}, '
                     + ", ".join(f'{{name = "hook-{i}", kind = "webhook", url = "{h.url}", '
                                 f'secret_env = "DEMO_HOOK_{i}"}}' for i, h in enumerate(hooks))
                     + "]")
            environ = demo_environ(data_dir, sandbox.url, partner_token, trigger_token, {
                "CLEANUP__SERVICE__LISTEN": f"127.0.0.1:{port}",
                "CLEANUP__SCHEDULE__CRON": "0 2 * * 1", "CLEANUP__SCHEDULE__CLOCK": "external",
                "CLEANUP__QUEUE__BACKEND": "infrai", "CLEANUP__INFRAI__BASE_URL": emulator.url,
                "CLEANUP__INFRAI__TRIGGER_URL": f"{service_url}/v1/runs",
                "CLEANUP__EVENTS__SINK": sinks, "INFRAI_API_KEY": infrai_key,
                "CLEANUP_TICK_TOKEN": tick_token,
                **{h.secret_env: h.secret for h in hooks}})
            cfg = config.load(opts.config_path, environ)
            service = Service(cfg)
            task = await start_service(service)
            if task.done():
                return await task
            print(f"managed shape: Infrai emulator {emulator.url} (cron, queue, events), "
                  f"partner {sandbox.url} ({opts.recipients} stale, {opts.partner_rate:g}/s), "
                  f"service {service_url}, sinks: an Infrai queue and 2 webhooks", flush=True)
            try:
                report = await _drive(cfg, service_url, trigger_token, sandbox.url,
                                      partner_token, hooks, emulator.url, control)
            finally:
                service.request_stop()
                code = await task
    ok = (code == 0 and report["duplicates"] == 0 and report["failed"] == 0
          and report["discovered"] == opts.recipients
          and all(report[f"sink_{n}"] == report["events"] for n in ("warehouse", "hook-0",
                                                                    "hook-1")))
    print(" ".join(f"{k}={v}" for k, v in report.items()), flush=True)
    return 0 if ok else 1


async def _drive(cfg: config.Config, service_url: str, trigger_token: str, partner_url: str,
                 partner_token: str, hooks: list[WebhookSink], emulator_url: str,
                 control: str) -> dict[str, Any]:
    client = InfraiClient(cfg.infrai)
    await client.start()
    auth = {"Authorization": f"Bearer {trigger_token}"}
    started = time.monotonic()
    try:
        cron = InfraiCron(client, cfg.infrai, cfg.trigger.tick_token)
        done, job = await cron.apply(cron.spec(cfg.schedule.name, cfg.schedule.cron or "",
                                               cfg.schedule.timezone))
        print(f"infrai cron apply: {done} job {job['cron_id']} ({job['schedule']}); "
              "running it now", flush=True)
        await client.call("cron.trigger", f"/v1/cron/trigger/{job['cron_id']}")
        async with aiohttp.ClientSession() as http:
            run = await _wait_run(http, service_url, auth)
            drained = time.monotonic()
            deadline = time.monotonic() + 60
            expected = run["discovered"] + 1  # each operation settled, and the run
            pulled: set[str] = set()
            while time.monotonic() < deadline:
                got = await _infrai_events(client, pulled)
                if min(len(pulled), *(len(h.ids) for h in hooks)) >= expected:
                    break
                if not got:
                    await asyncio.sleep(0.2)  # the sinks are other tasks' work: poll
            async with http.get(f"{partner_url}/_sandbox/stats",
                                headers={"Authorization": f"Bearer {partner_token}"}) as resp:
                stats = orjson.loads(await resp.read())
            async with http.get(f"{emulator_url}/_emulator/stats",
                                headers={"X-Emulator-Control": control}) as resp:
                calls = orjson.loads(await resp.read())["total_calls"]
    finally:
        await client.close()
    c = run["counts"]
    return {"discovered": run["discovered"], "deleted": c["deleted"],
            "already_absent": c["already_absent"], "failed": c["failed"],
            "ambiguous": c["ambiguous"], "duplicates": stats["duplicates"],
            "seconds": round(drained - started, 1), "events": expected,
            "events_after_s": round(time.monotonic() - drained, 1),
            "sink_warehouse": len(pulled), "sink_hook-0": len(hooks[0].ids),
            "sink_hook-1": len(hooks[1].ids), "infrai_calls": calls}


async def _wait_run(http: aiohttp.ClientSession, url: str,
                    auth: dict[str, str]) -> dict[str, Any]:
    """The run Infrai's cron opened, long-polled until done, with a line each second."""
    run_id = None
    t0 = time.monotonic()
    while run_id is None:
        async with http.get(f"{url}/v1/runs?limit=1", headers=auth) as resp:
            runs = orjson.loads(await resp.read())["runs"]
        run_id = runs[0]["id"] if runs else None
        if run_id is None:
            await asyncio.sleep(0.1)  # Infrai's POST is on its way: poll for it
    print(f"Infrai cron -> trigger -> run {run_id}", flush=True)
    while True:
        async with http.get(f"{url}/v1/runs/{run_id}?wait=done&timeout=1",
                            headers=auth) as resp:
            run: dict[str, Any] = orjson.loads(await resp.read())
        c = run["counts"]
        print(f"  {time.monotonic() - t0:6.1f}s {run['state']:9} deleted={c['deleted']} "
              f"already_absent={c['already_absent']} waiting={run['unfinished']}", flush=True)
        if run["state"] == "done":
            return run


async def _infrai_events(client: InfraiClient, pulled: set[str]) -> int:
    """What the Infrai sink received: pulled from its queue into ``pulled``, each event
    ID once (the queue may not exist before the first event). Returns messages taken."""
    try:
        data = await client.call("queue.consume", "/v1/queue/consume",
                                 {"queue": EVENTS_QUEUE, "max_messages": 10,
                                  "visibility_timeout": 30})
    except InfraiError:
        return 0
    items = data.get("messages") if isinstance(data, dict) else data
    for item in items or []:
        pulled.update(e["id"] for e in item["payload"]["events"])
        await client.call("queue.ack", "/v1/queue/ack",
                          {"queue": EVENTS_QUEUE, "message_id": item["message_id"]})
    return len(items or [])
