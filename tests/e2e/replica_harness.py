"""Replicas on one PostgreSQL schema: real ``serve`` processes, each on its own port and
data dir, sharing the ledger, the queue and the rate budget in the test's own schema.

Results are read through the API, the partner's own record and the Ledger protocol
(a PostgresLedger of the test's own on the same schema), never a backend's tables.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from supervisor.postgres.database import PgDatabase
from supervisor.postgres.ledger import PostgresLedger
from tests.e2e.harness import E2E, Sandbox, Sections, Service, merge
from tests.helpers import Metrics

SINGLETONS = ("scan", "publisher", "redrive", "monitor")


def replica_overrides(schema: str) -> Sections:
    # dead_after must exceed connect + request timeouts + a heartbeat: short ones here,
    # the sandbox answers in milliseconds.
    return {"ledger": {"backend": "postgres", "schema": schema,
                       "heartbeat_seconds": 0.5, "dead_after_seconds": 3.0,
                       "role_poll_seconds": 0.5},
            "partner": {"connect_timeout_seconds": 0.5, "request_timeout_seconds": 1.5},
            "queue": {"backend": "postgres"}}


def replicas(e2e: E2E, sandbox: Sandbox, dsn: str, schema: str, n: int,
             *overrides: Sections) -> list[Service]:
    out = []
    for i in range(n):
        config = replica_overrides(schema)
        for o in overrides:
            config = merge(config, o)
        svc = e2e.service(sandbox, config, name=f"replica-{i + 1}")
        svc.env["CLEANUP_DATABASE_URL"] = dsn
        out.append(svc)
    return out


async def start_all(services: Sequence[Service]) -> None:
    await asyncio.gather(*(svc.start() for svc in services))


async def metrics_of(services: Sequence[Service]) -> list[Metrics]:
    return list(await asyncio.gather(*(svc.metrics() for svc in services)))


def settled_by(m: Metrics) -> int:
    return int(m.get("cleanup_operations_total", outcome="deleted")
               + m.get("cleanup_operations_total", outcome="already_absent"))


async def role_holders(services: Sequence[Service],
                       roles: Sequence[str] = SINGLETONS) -> dict[str, list[int]]:
    """Which replicas (by index) hold each of ``roles``, from their /metrics."""
    held: dict[str, list[int]] = {role: [] for role in roles}
    for i, svc in enumerate(services):
        if svc.current is None or svc.current.proc.returncode is not None:
            continue
        try:
            m = await svc.metrics()
        except aiohttp.ClientConnectionError:
            continue  # restarting: not listening yet
        for role in roles:
            if m.get("cleanup_role_held", role=role) == 1:
                held[role].append(i)
    return held


def replicas_up(services: Sequence[Service], restarts: Sequence[asyncio.Task[Any]]) -> list[int]:
    """The replicas (by index) running and not being restarted (a task named
    ``start-<index>``)."""
    return [i for i, s in enumerate(services) if s.current is not None
            and s.current.proc.returncode is None
            and not any(not t.done() and t.get_name() == f"start-{i}" for t in restarts)]


async def some_replicas_up(services: Sequence[Service],
                           restarts: Sequence[asyncio.Task[Any]]) -> list[int]:
    """The replicas up now; when all are restarting (a busy machine starts them slowly),
    once one is back, so a storm always has its kills."""
    while not (up := replicas_up(services, restarts)):
        done, _ = await asyncio.wait([t for t in restarts if not t.done()],
                                     return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()  # a replica that could not start fails the case here
    return up


async def wait_roles_on(services: Sequence[Service], alive: set[int],
                        within_s: float) -> dict[str, list[int]]:
    """Poll /metrics (a gauge has no event) until every role has one holder among
    ``alive``; return the holders."""
    deadline = time.monotonic() + within_s
    while True:
        held = await role_holders(services)
        if all(len(h) == 1 and h[0] in alive for h in held.values()):
            return held
        if time.monotonic() >= deadline:
            raise AssertionError(f"roles not taken over by {alive} within {within_s}s: {held}")
        await asyncio.sleep(0.2)


def max_per_window(times: Sequence[float], window_s: float = 1.0) -> int:
    """The most executions in any ``window_s`` window (sliding, starting at each one)."""
    ts = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(ts):
        while ts[j] <= t - window_s:
            j += 1
        best = max(best, i - j + 1)
    return best


def no_duplicates(log: Sequence[dict[str, Any]], stats: dict[str, Any]) -> None:
    executed = Counter(e["recipient_id"] for e in log)
    assert stats["duplicates"] == 0, stats
    assert max(executed.values(), default=0) <= 1, executed.most_common(3)


@asynccontextmanager
async def ledger_reader(dsn: str, schema: str) -> AsyncIterator[PostgresLedger]:
    """The test's own view of the shared ledger, through the protocol."""
    db = PgDatabase(dsn, schema, replica="e2e-reader", pool_size=2)
    await db.open()
    try:
        yield PostgresLedger(db, owns_queue=True)
    finally:
        await db.close()


async def settle_run(svc: Service, run_id: str, within_s: float = 120.0) -> dict[str, Any]:
    """The run once done with nothing ambiguous left. The probes that settle ambiguous
    operations run on whichever replica holds the reconcile role, so there is no one
    log to wait on: long-poll until done, then poll the run (a deadline, not a sync)."""
    deadline = time.monotonic() + within_s
    while True:
        left = int(min(30, max(1, deadline - time.monotonic())))
        status, doc = await svc.request("GET", f"/v1/runs/{run_id}?wait=done&timeout={left}")
        assert status == 200, doc
        assert doc["state"] != "done" or doc["unfinished"] == 0, doc
        if doc["state"] == "done" and not doc["counts"]["ambiguous"]:
            return dict(doc)
        if time.monotonic() >= deadline:
            raise AssertionError(f"run {run_id} not settled after {within_s}s: {doc}")
        if doc["state"] == "done":
            await asyncio.sleep(0.25)


async def batch_ids(dsn: str, schema: str) -> list[str]:
    """Every batch the shared ledger holds, by ID. The one read here not through the
    protocol: it hands out a batch by its ID and lists open jobs only, and "every batch
    closed" needs them all (a batch whose attempts were all closed without naming it
    could otherwise go unseen). Each one is then read through the protocol."""
    db = PgDatabase(dsn, schema, replica="e2e-reader", pool_size=1)
    await db.open()
    try:
        return [r[0] for r in await db.read("SELECT id FROM batches ORDER BY created_at, id")]
    finally:
        await db.close()


async def sending_pids(dsn: str, schema: str) -> set[int]:
    """The process IDs of the replicas holding operations in flight (a batch or a delete
    in the air, or about to be): where a kill aimed at a request must land to catch one.
    Read from the schema: the protocol names a replica's operations by its ID only."""
    db = PgDatabase(dsn, schema, replica="e2e-reader", pool_size=1)
    await db.open()
    try:
        return {r[0] for r in await db.read(
            "SELECT DISTINCT r.pid FROM operations o JOIN replicas r ON r.id = o.holder"
            " WHERE o.state = 'in_flight'")}
    finally:
        await db.close()
