"""The service on a Redis stream (``queue.backend = "redis"``, issue 21, point 1) under
SIGKILLs and broker faults, with the SQLite ledger, in both partner modes.

Kills land at seeded execution counts of the partner (a DELETE just executed: its
answer on the way back, its outcome being committed, or committed and its ack not yet
sent, so the entry stays pending to a dead consumer until another claims it after the
lease), each followed by a restart; between them Redis drops every connection of the
service (``CLIENT KILL``, what a broker restart or a failover does to clients). Nothing
may be lost or doubled: the run ends with every recipient deleted once and the ledger's
counts equal to the partner's record; what a kill left pending to a dead consumer is
claimed after the lease by the next process and dropped (its operation settled, the
partner sees no request more), and then nothing is left in Redis (no entry, none
pending, none parked).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.conftest import RedisKey
from tests.e2e.faults.harness import Fault, Mode, fault_service, verify
from tests.e2e.harness import E2E
from tests.e2e.replica_harness import metrics_of, no_duplicates, replicas, settled_by, start_all

# Exclusive: the broker drops every client it has, a parallel test's as well as ours.
pytestmark = [pytest.mark.e2e, pytest.mark.exclusive]

POPULATION = 600
KILLS = 6
BROKER_DROPS = 2


async def emptied(admin: aioredis.Redis, redis_key: RedisKey, within_s: float = 60.0) -> None:
    """Until the stream holds no entry, none pending and none parked. Redis has no event
    for an emptied stream: it is read every 0.2 s (the claims wait out a 3 s lease)."""
    stream = f"{redis_key.key}:work"
    async with asyncio.timeout(within_s):
        while True:
            pending = int((await admin.xpending(stream, redis_key.key))["pending"])
            if (await admin.xlen(stream), pending,
                    await admin.zcard(f"{redis_key.key}:delayed")) == (0, 0, 0):
                return
            await asyncio.sleep(0.2)


async def test_sigkill_and_dropped_connections_on_redis(e2e: E2E, fault: Fault, mode: Mode,
                                                       redis_key: RedisKey) -> None:
    rng = fault.rng
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--seed", fault.seed,
                                "--rate", 2000, "--burst", 50, "--latency-ms", 5,
                                "--page-delay-ms", 30, *mode.sandbox_args)
    svc = fault_service(e2e, sandbox, {
        "source": {"page_size": 100},
        "limits": {"rate_per_second": 400, "concurrency": 8},
        # A dead consumer's entries are claimed by the next process after this lease.
        # What the queue lost for good is the redrive's to republish: every second here,
        # not every 60 s, or a loss is found just as the run's 60 s wait ends (CI, stop 31).
        "queue": {"backend": "redis", "redis_key": redis_key.key, "lease_seconds": 3.0,
                  "redrive_interval_seconds": 1.0, "redrive_grace_seconds": 20.0},
    }, mode.overrides)
    svc.env["CLEANUP_REDIS_URL"] = redis_key.url
    await svc.start()
    run_id = await svc.open_run()

    plan = ["kill"] * KILLS + ["drop"] * BROKER_DROPS
    rng.shuffle(plan)
    targets = iter(sorted(rng.sample(range(POPULATION // 10, POPULATION * 9 // 10),
                                     len(plan))))
    caught: Counter[str] = Counter()
    admin = aioredis.Redis.from_url(redis_key.url)
    try:
        for kind in plan:
            await sandbox.wait(60, executions=next(targets))
            if kind == "kill":
                await svc.kill()
                pending = (await admin.xpending(f"{redis_key.key}:work", redis_key.key))
                caught["pending_at_kill"] += int(pending["pending"])
                await svc.start()
            else:
                # Every connection but the test's own: the service's pool and its
                # blocked read all see the broker go away at once.
                caught["connections_dropped"] += int(
                    await admin.client_kill_filter(_type="normal", skipme=True))
            caught[kind] += 1

        v = await verify(e2e, svc, sandbox, run_id, mode, fault)
        stream, delayed = f"{redis_key.key}:work", f"{redis_key.key}:delayed"

        async def left() -> tuple[int, int, int]:
            return (await admin.xlen(stream),
                    int((await admin.xpending(stream, redis_key.key))["pending"]),
                    await admin.zcard(delayed))

        # What a kill caught after its outcome's commit and before the ack is still
        # pending to the dead consumer when the run ends (the run needs nothing more of
        # it). The next process claims each after the lease and drops it: its operation
        # is settled. Nothing is parked.
        caught["left_at_end"] = (await left())[0]
        assert (await left())[2] == 0
        await svc.start()
        await emptied(admin, redis_key)
        await svc.stop()
    finally:
        await admin.aclose()
    # The partner saw nothing more: the entries left were dropped, not worked again.
    assert (await sandbox.stats())["requests"] == v.stats["requests"]

    assert svc.kills == KILLS
    # The kills caught entries held by the process they killed (claimed back after the
    # lease), and the drops cut live connections.
    assert caught["pending_at_kill"] >= 1, caught
    assert caught["connections_dropped"] >= BROKER_DROPS, caught
    fault.record.notes.update(caught)
    fault.record.notes["queue"] = "redis"
    assert v.stats["duplicates"] == 0


async def test_replicas_on_postgres_share_one_redis_stream(pg: Any, e2e: E2E,
                                                           redis_key: RedisKey) -> None:
    """Three replicas (PostgreSQL ledger) consume one stream as one group; one is killed
    mid-run and the survivors claim what it held after the lease: one run, every
    recipient deleted once, each survivor a consumer of its share, Redis left empty."""
    population = 600
    sandbox = await e2e.sandbox("--recipients", population, "--rate", 400, "--burst", 20,
                                "--latency-ms", 20)
    services = replicas(e2e, sandbox, pg.dsn, pg.schema, 3, {
        "limits": {"rate_per_second": 150.0, "concurrency": 8},
        "source": {"page_size": 100},
        "queue": {"backend": "redis", "redis_key": redis_key.key, "lease_seconds": 3.0}})
    for svc in services:
        svc.env["CLEANUP_REDIS_URL"] = redis_key.url
    await start_all(services)
    run_id = await services[0].open_run()
    await sandbox.wait(30, executions=population // 3)
    victim = services[1]
    await victim.kill()
    survivors = [services[0], services[2]]
    run = await survivors[0].wait_done(run_id, within_s=90)
    _, stats = await e2e.assert_complete(survivors[1], run, sandbox)
    no_duplicates(await sandbox.log(), stats)
    assert run["counts"]["ambiguous"] == 0, run
    per_replica = [settled_by(m) for m in await metrics_of(survivors)]
    assert all(n > 0 for n in per_replica), per_replica
    admin = aioredis.Redis.from_url(redis_key.url)
    stream = f"{redis_key.key}:work"
    try:
        # What the victim held and had settled is claimed and dropped after the lease.
        await emptied(admin, redis_key)
        consumers = await admin.xinfo_consumers(stream, redis_key.key)
    finally:
        await admin.aclose()
    # One consumer per process that ever ran, none holding anything now.
    assert len(consumers) >= 3, consumers
    assert all(int(c["pending"]) == 0 for c in consumers), consumers
