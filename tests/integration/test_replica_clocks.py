"""PostgreSQL only: replicas cannot be falsely reaped or skewed (review M2 and L2).

* A replica whose shared pool is saturated (every connection held by slow reads) still
  heartbeats: the heartbeat has a connection of its own, so no peer declares it dead.
* A replica whose clock runs 90 s ahead (a real process under ``faketime -f +90s``) claims
  no message a peer holds or has parked, and passes no peer's in-flight guard: leases and
  guards are compared on the database's clock, never on a replica's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.errors import OperationBusy
from supervisor.queue.courier import Courier
from tests.helpers import still_waiting

from .test_pg_queue import CONFIG, replicas

REPO = Path(__file__).resolve().parents[2]
SKEW = "+90s"

# The replica with the fast clock: joins, claims what it can, tries to start an attempt
# on the operation the other replica holds in flight; prints what it got.
FAST_REPLICA = """
import asyncio, json, sys, time
from supervisor.errors import OperationBusy
from supervisor.postgres import sql as pg_sql
from supervisor.postgres.database import PgDatabase
from supervisor.postgres.ledger import PostgresLedger
from supervisor.ledger.settings import LedgerConfig
from supervisor.postgres.queue import PostgresQueue
from supervisor.postgres.replicas import AdvisoryRoles, Membership

async def main(dsn, schema, held_op):
    db = PgDatabase(dsn, schema, "fast")
    await db.open(pg_sql.MIGRATIONS)
    roles = AdvisoryRoles(dsn, schema, 1.0)
    membership = Membership(db, LedgerConfig(), roles)
    try:
        await membership.join()
        claimed = await PostgresQueue(db).receive(10, 30.0)
        try:
            await PostgresLedger(db, owns_queue=True, fence_s=60.0).begin_attempt(
                held_op, "delete", owner="fast-lease", busy_s=30.0)
            busy = None
        except OperationBusy as exc:
            busy = exc.until - time.time()
        print(json.dumps({"now": time.time(), "busy_for": busy,
                          "claimed": [d.message.operation_id for d in claimed]}))
    finally:
        await membership.close()
        await roles.close()
        await db.close()

asyncio.run(main(*sys.argv[1:4]))
"""


async def test_a_saturated_pool_does_not_stop_the_heartbeat(pg: Any) -> None:
    async with replicas(pg, "busy", "judge") as (busy, judge):
        # Both steady, so the judge may declare the other dead once it is silent.
        deadline = time.monotonic() + CONFIG.dead_after_seconds + CONFIG.heartbeat_seconds
        while time.monotonic() < deadline:
            await busy.membership.beat()
            await judge.membership.beat()
            await asyncio.sleep(CONFIG.heartbeat_seconds)  # the beat's own period
        # Every connection of the busy replica's pool is taken (long reads, say).
        held = [await busy.db.pool.acquire() for _ in range(busy.db.pool_size)]
        blocked = asyncio.ensure_future(busy.db.read("SELECT 1"))
        try:
            assert await still_waiting(blocked, 0.3)  # the pool is saturated indeed
            # Beat through a whole dead time: each beat within its bound, never reaped.
            deadline = time.monotonic() + CONFIG.dead_after_seconds + CONFIG.heartbeat_seconds
            while time.monotonic() < deadline:
                async with asyncio.timeout(CONFIG.dead_after_seconds / 2):
                    await busy.membership.beat()
                await judge.membership.beat()
                await asyncio.sleep(CONFIG.heartbeat_seconds)
            assert busy.membership.fresh
            assert judge.membership.reaped == 0
            assert "busy" in {r["id"] for r in await judge.membership.live()}
        finally:
            for conn in held:
                await busy.db.pool.release(conn)
            await blocked


async def test_a_replica_whose_clock_runs_ahead_takes_nothing_a_peer_holds(pg: Any) -> None:
    faketime = shutil.which("faketime")
    if faketime is None:
        message = ("faketime is not installed (apt-get install -y faketime): it runs the "
                   "replica whose clock is off (CLEANUP_REQUIRE_FAKETIME=1: a failure)")
        if os.environ.get("CLEANUP_REQUIRE_FAKETIME") == "1":
            pytest.fail(message)
        pytest.skip(message)
    async with replicas(pg, "honest") as (honest,):
        run = await honest.ledger.open_run("weekly@1", "weekly", None, {"kind": "inline"},
                                           False)
        assert run.run is not None
        await honest.ledger.record_page(run.run.id, ["held", "parked", "free"], None, 0)
        await Courier(honest.ledger, honest.queue).publish(
            await honest.ledger.unpublished(10), outbox=True)
        by_recipient = {op.recipient_id: op.id for op in
                        await honest.ledger.list_operations(run.run.id, None, None, 10)}
        claimed = {d.message.operation_id: d for d in await honest.queue.receive(2, 30.0)}
        assert len(claimed) == 2
        held_op = by_recipient["held"] if by_recipient["held"] in claimed else \
            next(iter(claimed))
        parked_op = next(op for op in claimed if op != held_op)
        # One in flight for 30 s (leased and guarded), one parked for a retry in 30 s.
        await honest.ledger.begin_attempt(held_op, "delete", owner=claimed[held_op].receipt,
                                          busy_s=30.0)
        await honest.queue.nack(claimed[parked_op], 30.0)
        free_op = next(op for op in by_recipient.values() if op not in claimed)

        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = await asyncio.create_subprocess_exec(
            faketime, "-f", SKEW, sys.executable, "-c", FAST_REPLICA, pg.dsn, pg.schema, held_op,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        seen = json.loads(out.decode().strip().splitlines()[-1])
        # Its clock really is ahead, as a skewed host's would be.
        assert seen["now"] > time.time() + 60
        # Only the message nobody holds and nothing parks: not the leased one (30 s left
        # on the database's clock), not the parked one (due in 30 s), though its own
        # clock says both are a minute overdue.
        assert seen["claimed"] == [free_op]
        # The peer's in-flight guard holds for it too, for what is left of it (not -60 s).
        assert seen["busy_for"] is not None
        assert 20 < seen["busy_for"] <= 30
        # And the honest replica's attempt is untouched: still its own, still busy.
        with pytest.raises(OperationBusy):
            await honest.ledger.begin_attempt(held_op, "delete", owner="another", busy_s=30.0)
