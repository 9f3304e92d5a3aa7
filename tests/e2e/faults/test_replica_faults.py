"""A SIGKILL storm across three replicas on one PostgreSQL schema (issue 10, point 4), in
both partner modes: at least 20 kills at seeded execution counts, each of a replica
chosen by the case's RNG (role holders included), each restarted at once while the others
carry on. Nothing may be lost or doubled: the killed replica's leases and in-flight guards
are released by whichever survivor notices, its roles are taken over, and its requests
caught in the air are resent with their key (keys honoured) or probed before anything is
sent again (keys ignored).

Read through the API, the partner's own record and the Ledger protocol: no table is read.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Any

import pytest

from tests.e2e.faults.harness import Fault, FaultService, Mode, fault_service
from tests.e2e.harness import E2E
from tests.e2e.ledger_file import UNRESOLVED
from tests.e2e.replica_harness import (
    SINGLETONS,
    ledger_reader,
    metrics_of,
    role_holders,
    settle_run,
    some_replicas_up,
)

pytestmark = pytest.mark.e2e

POPULATION = 2400
KILLS = 21
REPLICAS = 3


def _replica(e2e: E2E, sandbox: Any, pg: Any, i: int, mode: Mode) -> FaultService:
    svc = fault_service(e2e, sandbox, {
        "ledger": {"backend": "postgres", "schema": pg.schema, "heartbeat_seconds": 0.5,
                   "dead_after_seconds": 3.0, "role_poll_seconds": 0.5},
        "queue": {"backend": "postgres", "lease_seconds": 30.0},
        # Short enough for dead_after (connect + request + heartbeat below it).
        "partner": {"connect_timeout_seconds": 0.5, "request_timeout_seconds": 1.5},
        "source": {"page_size": 200},
        "limits": {"rate_per_second": 150, "concurrency": 8},
    }, mode.overrides, name=f"replica-{i + 1}")
    svc.env["CLEANUP_DATABASE_URL"] = pg.dsn
    return svc


@pytest.mark.one_mode("no-keys")
async def test_sigkill_storm_across_replicas(pg: Any, e2e: E2E, fault: Fault,
                                             mode: Mode) -> None:
    rng = fault.rng
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--seed", fault.seed,
                                "--rate", 2000, "--burst", 50, "--latency-ms", 10,
                                "--page-delay-ms", 40, *mode.sandbox_args)
    services = [_replica(e2e, sandbox, pg, i, mode) for i in range(REPLICAS)]
    await asyncio.gather(*(svc.start() for svc in services))
    run_id = await services[0].open_run()

    targets = sorted(rng.sample(range(POPULATION // 20, POPULATION * 9 // 10), KILLS))
    restarts: list[asyncio.Task[Any]] = []
    caught: Counter[str] = Counter()
    for target in targets:
        await sandbox.wait(60, executions=target)
        # Every replica may still be restarting (a busy machine starts them slowly): the
        # kill then waits for one to be back instead of being skipped.
        up = await some_replicas_up(services, restarts)
        held = await role_holders(services)
        holders = {h[0] for h in held.values() if h}
        # Every third kill aims at a role holder: its roles must move.
        pool = [i for i in up if i in holders] if caught["kills"] % 3 == 0 else up
        victim = rng.choice(pool or up)
        caught["role_holder_killed"] += victim in holders
        await services[victim].kill()
        caught["kills"] += 1
        restarts.append(asyncio.create_task(services[victim].start(), name=f"start-{victim}"))
    await asyncio.gather(*restarts)

    run = await settle_run(services[0], run_id)
    stats = await sandbox.stats()
    log = await sandbox.log()
    ops = await services[1].operations(run_id)
    counts = run["counts"]

    # One operation per candidate; nothing lost, nothing left unfinished or ambiguous.
    assert run["discovered"] == POPULATION == len(ops), run
    assert len({op["recipient_id"] for op in ops}) == POPULATION
    assert run["unfinished"] == 0, run
    assert counts["failed"] == 0, run
    assert counts["ambiguous"] == 0, run
    assert counts["deleted"] + counts["already_absent"] == POPULATION, run
    # Never doubled, in either mode: no recipient executed twice.
    assert stats["duplicates"] == 0, stats
    executed = Counter(e["recipient_id"] for e in log)
    assert max(executed.values()) == 1, executed.most_common(3)
    assert stats["present"] == 0, stats
    if mode.keys:
        assert counts["deleted"] == stats["deleted"], (run, stats)

    # Attempts: none left open; without keys, no delete resent after an unknown outcome
    # unless a probe (or an operator) came between.
    retried = [op for op in ops if op["attempts"] > 1 or op["reason"]]
    outcomes: Counter[tuple[str, str | None]] = Counter()
    for op in retried:
        attempts = (await services[2].operation(op["id"]))["attempts_log"]
        assert all(a["outcome"] is not None for a in attempts), (op, attempts)
        for a in attempts:
            outcomes[(a["kind"], a["outcome"])] += 1
        if not mode.keys:
            for before, after in itertools.pairwise(attempts):
                if before["kind"] == "delete" and before["outcome"] in UNRESOLVED:
                    assert after["kind"] != "delete", (op, attempts)
    # The kills caught requests in the air (an attempt with an unknown outcome).
    assert outcomes[("delete", "unknown")] >= 1, outcomes

    # Nothing left in the queue or held by a dead replica, seen through the protocol.
    async with ledger_reader(pg.dsn, pg.schema) as ledger:
        q = await ledger.queue_stats()
        assert (q.depth, q.parked) == (0, 0), q
        assert (await ledger.stats()).ambiguous == 0

    # The survivors of each kill released the dead one's work; roles ended on one holder.
    reaped = sum(m.get("cleanup_replicas_reaped_total") for m in await metrics_of(services))
    held = await role_holders(services)
    assert all(len(held[r]) == 1 for r in SINGLETONS), held
    for svc in services:
        await svc.stop()
    assert caught["kills"] == KILLS, caught
    assert caught["role_holder_killed"] >= 3, caught
    fault.record.kills += caught["kills"]
    fault.record.processes += sum(len(s.history) for s in services)
    fault.record.operations += POPULATION
    fault.record.runs += 1
    fault.record.duplicates = stats["duplicates"]
    fault.record.notes.update({
        "replicas": REPLICAS, "role_holder_kills": caught["role_holder_killed"],
        "reaped": reaped, "unknown_outcomes": outcomes[("delete", "unknown")],
        "probes": sum(n for (kind, _), n in outcomes.items() if kind == "probe"),
        "replays": stats["replays"], "requests": stats["requests"]})
