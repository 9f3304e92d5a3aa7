"""The service on a RabbitMQ quorum queue (``queue.backend = "rabbitmq"``, issue 21,
point 2) under SIGKILLs and broker faults, with the SQLite ledger, in both partner modes,
and three replicas on PostgreSQL sharing the queue.

Kills land at seeded execution counts of the partner (a DELETE just executed: its answer
on the way back, its outcome being committed, or committed and its ack not yet sent; the
dead process's connection closes and the broker requeues what it held at once), each
followed by a restart; between them the broker closes every client connection
(``rabbitmqctl close_all_connections``, what a broker restart or a failover does): the
channels' delivery tags die with them. Nothing may be lost or doubled: every recipient
deleted once, the ledger's counts equal to the partner's record, no ack for a dead tag
(a channel error would show), and the queue empty at the end.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import aio_pika
import aiormq
import pytest

from supervisor.amqp.queue import DELAYS
from tests.conftest import RabbitQueueName
from tests.e2e.faults.harness import Fault, Mode, fault_service, verify
from tests.e2e.harness import E2E
from tests.e2e.replica_harness import metrics_of, no_duplicates, replicas, settled_by, start_all

# Exclusive: the broker drops every client it has, a parallel test's as well as ours.
pytestmark = [pytest.mark.e2e, pytest.mark.exclusive]

POPULATION = 600
KILLS = 5
BROKER_DROPS = 2


async def close_all_connections() -> None:
    """The broker closes every client connection (rabbitmqctl, as an operator would)."""
    proc = await asyncio.create_subprocess_exec(
        "rabbitmqctl", "close_all_connections", "cleanup-supervisor fault test",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode(errors="replace")


async def ready_messages(url: str, name: str) -> int:
    """Messages waiting in the queue and in each of its delay queues that exists."""
    total = 0
    connection = await aio_pika.connect(url)
    try:
        for queue in (name, *(f"{name}.delay.{d:g}s" for d in DELAYS)):
            channel = await connection.channel()
            raw = await channel.get_underlay_channel()
            try:
                ok = await raw.queue_declare(queue, passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                continue  # never declared: that delay was never used
            total += int(ok.message_count or 0)
            await channel.close()
    finally:
        await connection.close()
    return total


async def drained(url: str, name: str, within_s: float = 60.0) -> None:
    """Until the queue and its delay queues hold no message. The broker has no event
    for it: read every 0.2 s."""
    async with asyncio.timeout(within_s):
        while True:
            if await ready_messages(url, name) == 0:
                return
            await asyncio.sleep(0.2)


async def test_sigkill_and_closed_connections_on_rabbitmq(
        e2e: E2E, fault: Fault, mode: Mode, rabbit_queue: RabbitQueueName) -> None:
    rng = fault.rng
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--seed", fault.seed,
                                "--rate", 2000, "--burst", 50, "--latency-ms", 5,
                                "--page-delay-ms", 30, *mode.sandbox_args)
    svc = fault_service(e2e, sandbox, {
        "source": {"page_size": 100},
        "limits": {"rate_per_second": 400, "concurrency": 8},
        # What the broker lost for good is the redrive's to republish, every second here
        # (as in test_redis_faults.py).
        "queue": {"backend": "rabbitmq", "rabbitmq_queue": rabbit_queue.name,
                  "lease_seconds": 5.0, "redrive_interval_seconds": 1.0,
                  "redrive_grace_seconds": 20.0},
    }, mode.overrides)
    svc.env["CLEANUP_RABBITMQ_URL"] = rabbit_queue.url
    await svc.start()
    run_id = await svc.open_run()

    plan = ["kill"] * KILLS + ["drop"] * BROKER_DROPS
    rng.shuffle(plan)
    targets = iter(sorted(rng.sample(range(POPULATION // 10, POPULATION * 9 // 10),
                                     len(plan))))
    caught: Counter[str] = Counter()
    for kind in plan:
        await sandbox.wait(60, executions=next(targets))
        if kind == "kill":
            await svc.kill()
            await svc.start()
        else:
            await close_all_connections()
        caught[kind] += 1

    v = await verify(e2e, svc, sandbox, run_id, mode, fault)
    # A message of a settled operation may still be on its way (a retry's delayed copy
    # dead-lettered after its operation settled on a probe, a copy requeued by a kill):
    # the next process takes each and drops it, and then nothing is left anywhere.
    caught["left_at_end"] = await ready_messages(rabbit_queue.url, rabbit_queue.name)
    await svc.start()
    await drained(rabbit_queue.url, rabbit_queue.name)
    await svc.stop()
    assert (await sandbox.stats())["requests"] == v.stats["requests"]  # dropped, not worked
    # No ack ever named a dead tag (RabbitMQ would close the channel with
    # PRECONDITION_FAILED "unknown delivery tag").
    assert not any("unknown delivery tag" in line for line in svc.all_lines())
    assert svc.kills == KILLS
    assert v.stats["duplicates"] == 0
    fault.record.notes.update(caught)
    fault.record.notes["queue"] = "rabbitmq"


async def test_replicas_on_postgres_share_one_rabbitmq_queue(
        pg: Any, e2e: E2E, rabbit_queue: RabbitQueueName) -> None:
    """Three replicas (PostgreSQL ledger) pull from one quorum queue; one is killed
    mid-run (the broker requeues what it held): one run, every recipient deleted once,
    each survivor did its share, the queue empty at the end."""
    population = 600
    sandbox = await e2e.sandbox("--recipients", population, "--rate", 400, "--burst", 20,
                                "--latency-ms", 20)
    services = replicas(e2e, sandbox, pg.dsn, pg.schema, 3, {
        "limits": {"rate_per_second": 150.0, "concurrency": 8},
        "source": {"page_size": 100},
        "queue": {"backend": "rabbitmq", "rabbitmq_queue": rabbit_queue.name}})
    for svc in services:
        svc.env["CLEANUP_RABBITMQ_URL"] = rabbit_queue.url
    await start_all(services)
    run_id = await services[0].open_run()
    await sandbox.wait(30, executions=population // 3)
    await services[1].kill()
    survivors = [services[0], services[2]]
    run = await survivors[0].wait_done(run_id, within_s=90)
    _, stats = await e2e.assert_complete(survivors[1], run, sandbox)
    no_duplicates(await sandbox.log(), stats)
    assert run["counts"]["ambiguous"] == 0, run
    per_replica = [settled_by(m) for m in await metrics_of(survivors)]
    assert all(n > 0 for n in per_replica), per_replica
    await drained(rabbit_queue.url, rabbit_queue.name)
