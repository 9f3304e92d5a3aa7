"""PostgreSQL only: several replicas on one schema, each with a pool of its own.

Claims skip one another's locked rows; a publish on one replica wakes the others through
LISTEN/NOTIFY (not their fallback poll); a replica whose heartbeat lapsed loses its leases
and in-flight guards to whichever live replica notices, and starts no attempt until it is
registered again, while a live replica's are never touched; a singleton role runs on one
replica at a time and moves when its holder's lock connection goes.

What the tests set up by hand, and only that, is done on the database directly: a stale
heartbeat (an UPDATE on ``replicas``), a row lock held mid-claim, a terminated session.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from supervisor.errors import OperationBusy, ReplicaFenced, ScanConflict
from supervisor.ledger.settings import LedgerConfig
from supervisor.model import Delivery, Event, Settled, Settlement
from supervisor.postgres import connect as pgnames
from supervisor.postgres import sql as pg_sql
from supervisor.postgres.database import CHANNELS, PgDatabase
from supervisor.postgres.ledger import PostgresLedger
from supervisor.postgres.queue import FALLBACK_POLL_S, PostgresQueue
from supervisor.postgres.replicas import AdvisoryRoles, Membership, RoleLost
from supervisor.queue.courier import Courier
from supervisor.states import OpState
from tests.helpers import admin, advisory_lock_holder, eventually, msg, still_waiting

CONFIG = LedgerConfig(heartbeat_seconds=0.5, dead_after_seconds=3.0, role_poll_seconds=0.05)


@dataclass
class Replica:
    name: str
    db: PgDatabase
    ledger: PostgresLedger
    queue: PostgresQueue
    roles: AdvisoryRoles
    membership: Membership
    applied: list[str]  # the migrations its open applied


async def beat_steadily(*memberships: Membership) -> None:
    """Heartbeats at the configured period for the whole dead time (the beat's own period
    is the cadence, not a synchronisation)."""
    deadline = time.monotonic() + CONFIG.dead_after_seconds + CONFIG.heartbeat_seconds / 2
    while time.monotonic() < deadline:
        for m in memberships:
            await m.beat()
        await asyncio.sleep(CONFIG.heartbeat_seconds)


@asynccontextmanager
async def replicas(pg: Any, *names: str) -> AsyncIterator[list[Replica]]:
    """Replicas as the service opens them: a pool each, migrated (all at once), joined."""
    opened: list[Replica] = []
    try:
        for name in names:
            db = PgDatabase(pg.dsn, pg.schema, name, pool_size=4)
            roles = AdvisoryRoles(pg.dsn, pg.schema, CONFIG.role_poll_seconds)
            opened.append(Replica(name, db, PostgresLedger(db, owns_queue=True,
                                                           fence_s=CONFIG.dead_after_seconds / 2),
                                  PostgresQueue(db), roles, Membership(db, CONFIG, roles), []))
        applied = await asyncio.gather(*(r.db.open(pg_sql.MIGRATIONS) for r in opened))
        for r, done in zip(opened, applied, strict=True):
            r.applied = done
        for r in opened:
            await r.membership.join()
        yield opened
    finally:
        for r in opened:
            await r.membership.close()
            await r.roles.close()
            await r.db.close()



async def blocked_wait(queue: PostgresQueue) -> asyncio.Future[None]:
    """A ``wait(5)`` that blocks, there being nothing to take. A wake-up may end one
    early: every replica hears every notification, its own included, and its LISTEN
    connection may deliver one late (or say "look once" as it reconnects); the protocol
    allows that (a message *may* be there). So a few tries, each checked for 0.3 s."""
    for _ in range(5):
        waiter = asyncio.ensure_future(queue.wait(5.0))
        if await still_waiting(waiter, 0.3):
            return waiter
    raise AssertionError("wait() never blocked, with nothing to take")


async def queued_run(r: Replica, ids: list[str], tick: str = "weekly@1") -> str:
    opened = await r.ledger.open_run(tick, "weekly", None, {"kind": "inline"}, False)
    assert opened.run is not None
    await r.ledger.record_page(opened.run.id, ids, None, 0)
    await Courier(r.ledger, r.queue).publish(await r.ledger.unpublished(1000), outbox=True)
    return opened.run.id


# -- the queue -------------------------------------------------------------------------------


async def test_replicas_receiving_at_once_take_disjoint_messages(pg: Any) -> None:
    async with replicas(pg, "replica-a", "replica-b") as (a, b):
        await a.queue.publish([msg(i) for i in range(100)])
        batches = await asyncio.gather(*(r.queue.receive(7, 60) for r in (a, b) * 8))
        got = [d.message.operation_id for batch in batches for d in batch]
        assert len(got) == len(set(got)) == 100  # each message to exactly one claim
        assert await a.queue.receive(10, 60) == []
        assert await b.queue.receive(10, 60) == []

        # A claim that holds rows locked (another replica mid-claim) does not hold the
        # next claim up: that one skips the locked rows and takes the others.
        await a.queue.publish([msg(i) for i in range(100, 110)])
        async with admin(pg) as conn, conn.transaction():
            locked = [r[0] for r in await conn.fetch(
                "SELECT operation_id FROM messages WHERE available_at <= $1 "
                "ORDER BY available_at LIMIT 3 FOR UPDATE", time.time())]
            taken = await asyncio.wait_for(b.queue.receive(10, 60), 2)
            assert sorted(d.message.operation_id for d in taken) == sorted(
                {msg(i).operation_id for i in range(100, 110)} - set(locked))
        rest = await a.queue.receive(10, 60)
        assert sorted(d.message.operation_id for d in rest) == sorted(locked)


async def test_a_publish_on_one_replica_wakes_another_replicas_wait(pg: Any) -> None:
    async with replicas(pg, "replica-a", "replica-b") as (a, b):
        # What the wake-ups below must beat: the NOTIFY, not the poll, wakes them (half the
        # poll leaves a loaded machine its scheduling delays).
        assert FALLBACK_POLL_S >= 2.0
        waiter = await blocked_wait(b.queue)  # nothing there: it waits
        began = time.monotonic()
        await a.queue.publish([msg(1)])
        await asyncio.wait_for(waiter, FALLBACK_POLL_S / 2)
        assert time.monotonic() - began < FALLBACK_POLL_S / 2  # the NOTIFY, not the poll
        [d] = await b.queue.receive(1, 60)

        # A hand-back on b wakes a consumer waiting on a.
        waiter = await blocked_wait(a.queue)
        began = time.monotonic()
        await b.queue.nack(d, 0.0)
        await asyncio.wait_for(waiter, FALLBACK_POLL_S / 2)
        assert time.monotonic() - began < FALLBACK_POLL_S / 2
        [again] = await a.queue.receive(1, 60)
        assert again.message == msg(1)


async def test_a_dropped_listen_connection_is_reconnected(pg: Any) -> None:
    async with replicas(pg, "replica-a", "replica-b") as (a, b), admin(pg) as conn:
        # Each replica listens on a connection of its own, whose last statement is the
        # LISTEN of the last channel: that is how the sessions are found.
        last = f'LISTEN "{pgnames.channel(pg.schema, CHANNELS[-1])}"'

        async def listening() -> set[int]:
            rows = await conn.fetch("SELECT pid FROM pg_stat_activity WHERE query = $1", last)
            return {r[0] for r in rows}

        before = await listening()
        assert len(before) == 2
        await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE query = $1", last)

        async def relistened() -> bool:
            now = await listening()
            return len(now) == 2 and not now & before

        await eventually(relistened, within_s=10, what="both LISTEN connections again")
        waiter = await blocked_wait(b.queue)
        began = time.monotonic()
        await a.queue.publish([msg(1)])
        await asyncio.wait_for(waiter, FALLBACK_POLL_S / 2)
        assert time.monotonic() - began < FALLBACK_POLL_S / 2


# -- runs, scans and events across replicas --------------------------------------------------


async def test_a_schema_of_the_previous_release_gains_the_source_kind(pg: Any) -> None:
    """Ledger v3: runs written before it show their source's kind in list reads (which no
    longer read the JSON), and a schedule's runs are found through its index."""
    old = PgDatabase(pg.dsn, pg.schema, "old-release")
    # The release before ledger v3 (and the audit table) had ledger v1 and v2 only.
    await old.open([m for m in pg_sql.MIGRATIONS
                    if (m.component, m.version) in (("ledger", 1), ("ledger", 2))])
    await old.pool.execute(
        "INSERT INTO runs (id, tick_key, schedule, state, source, created_at) VALUES "
        "('run_1', 'weekly@1', 'weekly', 'done', '{\"kind\": \"http\"}', 1)")
    await old.close()
    new = PgDatabase(pg.dsn, pg.schema, "new-release")
    try:
        assert await new.open(pg_sql.MIGRATIONS) == ["audit v1", "ledger v3", "ledger v4"]
        ledger = PostgresLedger(new, owns_queue=True)
        [run] = await ledger.list_runs(10)
        assert (run.id, run.source) == ("run_1", {"kind": "http"})
        assert [r.id for r in await ledger.schedule_runs("weekly")] == ["run_1"]
        indexes = {r[0] for r in await new.pool.fetch(
            "SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND tablename = 'runs'",
            pg.schema)}
        assert {"runs_schedule", "runs_schedule_unfinished"} <= indexes
    finally:
        await new.close()


async def test_replicas_starting_together_migrate_once(pg: Any) -> None:
    async with replicas(pg, "replica-a", "replica-b", "replica-c") as reps:
        assert sorted(len(r.applied) for r in reps) == [0, 0, len(pg_sql.MIGRATIONS)]
        assert [r.applied for r in reps if r.applied] == [["audit v1", "ledger v1",
                                                           "ledger v2", "ledger v3", "ledger v4"]]
        again = PgDatabase(pg.dsn, pg.schema, "replica-d")
        try:
            assert await again.open(pg_sql.MIGRATIONS) == []  # a restart applies nothing
        finally:
            await again.close()


async def test_a_sink_reading_while_replicas_settle_never_skips_an_event(pg: Any) -> None:
    """Events commit in seq order whichever replica writes them: a reader past seq N never
    finds later an event below N that committed after it read."""
    async with replicas(pg, "replica-a", "replica-b") as (a, b):
        opened = await a.ledger.open_run("weekly@1", "weekly", None, {"kind": "inline"}, False)
        assert opened.run is not None
        await a.ledger.record_page(opened.run.id, [f"r-{i}" for i in range(120)], None, 0)
        ops = [op.id for op in await a.ledger.list_operations(opened.run.id, None, None, 200)]

        async def settle(r: Replica, mine: list[str]) -> None:
            for op in mine:
                attempt = await r.ledger.begin_attempt(op, "delete")
                await r.ledger.settle([Settlement(op, OpState.DELETED, None,
                                                  attempt_id=attempt)])

        seen: list[Event] = []
        cursor = 0
        writers = asyncio.ensure_future(asyncio.gather(
            *(settle(r, ops[i::8]) for i, r in enumerate((a, b) * 4))))
        while True:
            finished = writers.done()
            while page := await b.ledger.events_after(cursor, 7):
                seen += page
                cursor = page[-1].seq
            if finished:
                break
            await asyncio.sleep(0)  # a sink polling as fast as it can
        await writers
        assert sorted(e.operation_id or "" for e in seen) == sorted(ops)  # none skipped
        assert len({e.seq for e in seen}) == 120  # none twice


# -- runs and scans across replicas ----------------------------------------------------------


async def test_replicas_opening_one_tick_at_once_open_one_run(pg: Any) -> None:
    async with replicas(pg, "replica-a", "replica-b", "replica-c") as reps:
        for slot in range(3):
            results = await asyncio.gather(*(
                r.ledger.open_run(f"weekly@{slot}", "weekly", None, {"kind": "inline"}, True)
                for r in reps))
            assert sum(r.created for r in results) == 1
            assert len({r.run.id for r in results if r.run is not None}) == 1
            run = next(r.run for r in results if r.created and r.run is not None)
            await reps[0].ledger.record_page(run.id, [], None, 0)
            assert await reps[1].ledger.finish_runs() == [run.id]
        assert len(await reps[2].ledger.list_runs(10)) == 3


async def test_two_scanners_on_two_replicas_one_page_commits(pg: Any) -> None:
    async with replicas(pg, "replica-a", "replica-b") as (a, b):
        opened = await a.ledger.open_run("weekly@1", "weekly", None, {"kind": "inline"}, False)
        assert opened.run is not None
        run_id = opened.run.id
        # Both read the first page (one had lost the scan role without knowing).
        results = await asyncio.gather(
            a.ledger.record_page(run_id, ["x", "a1", "a2"], "a", 0, resumed_from=None),
            b.ledger.record_page(run_id, ["x", "b1"], "b", 0, resumed_from=None),
            return_exceptions=True)
        assert sorted(type(r).__name__ for r in results) == ["PageResult", "ScanConflict"]
        winner = "a" if isinstance(results[1], ScanConflict) else "b"
        run = await b.ledger.get_run(run_id)
        assert run is not None
        assert (run.scan_cursor, run.scan_pages) == (winner, 1)
        recipients = [op.recipient_id for op in
                      await a.ledger.list_operations(run_id, None, None, 100)]
        assert recipients == (["x", "a1", "a2"] if winner == "a" else ["x", "b1"])
        assert run.discovered == len(recipients)


# -- membership ------------------------------------------------------------------------------


async def test_a_dead_replicas_leases_and_guards_are_released_and_a_live_ones_never(
        pg: Any) -> None:
    async with replicas(pg, "replica-live", "replica-dead", "replica-other") as reps, \
            admin(pg) as conn:
        live, dead, other = reps
        await queued_run(live, [f"r-{i}" for i in range(5)])
        d1, d2 = await dead.queue.receive(2, 60)  # d1 with an attempt in flight, d2 held
        await dead.ledger.begin_attempt(d1.message.operation_id, "delete", owner=d1.receipt,
                                        busy_s=60)
        d3, d4 = await live.queue.receive(2, 60)
        await live.ledger.begin_attempt(d3.message.operation_id, "delete", owner=d3.receipt,
                                        busy_s=60)
        o1, = await other.queue.receive(1, 60)
        await other.ledger.begin_attempt(o1.message.operation_id, "delete", owner=o1.receipt,
                                         busy_s=60)
        assert await live.queue.receive(10, 60) == []  # all five held
        with pytest.raises(OperationBusy):
            await live.ledger.begin_attempt(d1.message.operation_id, "delete", owner="x")

        # Nobody is stale: beats release nothing. A replica judges others only once it
        # has itself beaten without a gap for the whole dead time (after an outage every
        # row is stale): the live ones beat for that long, the dead one stays silent.
        await beat_steadily(live.membership, other.membership, dead.membership)
        assert (live.membership.reaped, live.membership.released) == (0, 0)

        await conn.execute("UPDATE replicas SET heartbeat_at = heartbeat_at - 60 "
                           "WHERE id = 'replica-dead'")
        # Stale, not yet reaped: it starts no attempt (another may be releasing its work).
        with pytest.raises(ReplicaFenced):
            await dead.ledger.begin_attempt(d2.message.operation_id, "delete",
                                            owner=d2.receipt, busy_s=60)
        refused = await live.ledger.get_operation(d2.message.operation_id)
        assert refused is not None
        assert (refused.state, refused.attempts) == (OpState.QUEUED, 0)  # nothing written
        assert await live.ledger.attempts(d2.message.operation_id) == []
        await live.membership.beat()
        assert live.membership.reaped == 1
        assert live.membership.released == 3  # two leases, one in-flight guard
        assert [r["id"] for r in await live.membership.live()] == [
            "replica-live", "replica-other"]

        # The dead one's messages are claimable at once; no live replica's is.
        again = await other.queue.receive(10, 60)
        assert sorted(d.message.operation_id for d in again) == sorted(
            [d1.message.operation_id, d2.message.operation_id])
        # Its in-flight guard is gone: another owner may take the attempt over.
        await other.ledger.begin_attempt(d1.message.operation_id, "delete",
                                         owner=again[0].receipt, busy_s=60)
        # The live ones keep theirs: their guards and leases stand.
        for d in (d3, o1):
            with pytest.raises(OperationBusy):
                await other.ledger.begin_attempt(d.message.operation_id, "delete", owner="x")
        assert await live.queue.extend(d4, 60) is True
        assert await other.queue.extend(o1, 60) is True
        # The dead one lost its leases; when it beats again it is registered anew (its
        # held deliveries find their leases gone) and may start attempts again.
        assert await dead.queue.extend(d2, 60) is False
        with pytest.raises(ReplicaFenced):
            await dead.ledger.begin_attempt(d2.message.operation_id, "delete")
        await dead.membership.beat()
        assert dead.membership.reaped == 0  # it reaps nobody: the others are alive
        assert len(await dead.membership.live()) == 3
        [d5] = [d for d in again if d.message.operation_id == d2.message.operation_id]
        await dead.ledger.begin_attempt(d5.message.operation_id, "delete", owner=d5.receipt,
                                        busy_s=60)
        await live.membership.beat()
        assert live.membership.reaped == 1  # still only the one


async def test_a_replica_leaves_cleanly(pg: Any) -> None:
    async with replicas(pg, "replica-a", "replica-b") as (a, b):
        await a.membership.leave()
        assert [r["id"] for r in await b.membership.live()] == ["replica-b"]
        with pytest.raises(ReplicaFenced):
            await a.ledger.begin_attempt("op_any", "delete")
        await b.membership.beat()
        assert b.membership.reaped == 0


# -- singleton roles -------------------------------------------------------------------------


class RoleProbe:
    """Counts who runs a role: the factories of two replicas, each blocking until
    cancelled, recording any moment both ran at once."""

    def __init__(self) -> None:
        self.started = {"a": asyncio.Event(), "b": asyncio.Event()}
        self.active: set[str] = set()
        self.overlaps = 0

    def factory(self, who: str) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            self.active.add(who)
            self.overlaps += len(self.active) > 1
            self.started[who].set()
            try:
                await asyncio.Event().wait()  # a component: runs until cancelled
            finally:
                self.active.discard(who)

        return run

    async def first(self) -> str:
        waits = {who: asyncio.ensure_future(e.wait()) for who, e in self.started.items()}
        await asyncio.wait(waits.values(), timeout=5, return_when=asyncio.FIRST_COMPLETED)
        for w in waits.values():
            w.cancel()
        [who] = [who for who, e in self.started.items() if e.is_set()]
        return who


@asynccontextmanager
async def contenders(pg: Any) -> AsyncIterator[tuple[RoleProbe, dict[str, AdvisoryRoles],
                                                     dict[str, asyncio.Task[None]]]]:
    probe = RoleProbe()
    roles = {who: AdvisoryRoles(pg.dsn, pg.schema, CONFIG.role_poll_seconds) for who in "ab"}
    tasks = {who: asyncio.create_task(roles[who].run("scan", probe.factory(who)))
             for who in "ab"}
    try:
        yield probe, roles, tasks
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for r in roles.values():
            await r.close()


async def test_one_replica_runs_a_role_and_another_takes_it_when_the_holder_closes(
        pg: Any) -> None:
    async with contenders(pg) as (probe, roles, tasks):
        holder = await probe.first()
        other = "b" if holder == "a" else "a"
        # Several of the other's polls go by: it does not run the role meanwhile.
        assert await still_waiting(asyncio.ensure_future(probe.started[other].wait()), 0.3)
        assert roles[holder].holds("scan")
        assert not roles[other].holds("scan")
        await roles[holder].close()
        # The holder's component stops with its lock, and the other takes the role.
        with pytest.raises(RoleLost):
            await asyncio.wait_for(tasks[holder], 2)
        # Within a few role polls (0.05 s), not the heartbeat's dead time.
        await asyncio.wait_for(probe.started[other].wait(), 3)
        assert roles[other].holds("scan")
        assert not roles[holder].holds("scan")
        assert probe.overlaps == 0


async def test_a_role_moves_when_its_holders_session_is_terminated(pg: Any) -> None:
    async with contenders(pg) as (probe, roles, tasks), admin(pg) as conn:
        holder = await probe.first()
        other = "b" if holder == "a" else "a"
        pid = await advisory_lock_holder(pg, conn, "scan")
        assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
        await asyncio.wait_for(probe.started[other].wait(), 3)
        assert await advisory_lock_holder(pg, conn, "scan") != pid
        # The old holder learns at its next probe (the heartbeat's) and stops its
        # component: the lock went with the session.
        await roles[holder].check()
        with pytest.raises(RoleLost):
            await asyncio.wait_for(tasks[holder], 2)
        assert not roles[holder].holds("scan")
        assert probe.active == {other}
        # It competes again, and waits: the other holds the role now.
        again = asyncio.create_task(roles[holder].run("scan", probe.factory(holder)))
        try:
            assert await still_waiting(again, 0.3)
        finally:
            again.cancel()
            await asyncio.gather(again, return_exceptions=True)


async def test_delivery_of_a_message_keeps_its_identity_across_replicas(pg: Any) -> None:
    async with replicas(pg, "replica-a", "replica-b") as (a, b):
        [mid] = await a.queue.publish([msg(1)])
        [d] = await b.queue.receive(1, 0.1)
        assert (d.message, d.message_id) == (msg(1), mid)
        await asyncio.sleep(0.25)  # the lease is wall-clock: let it run out
        [again] = await a.queue.receive(1, 60)
        assert isinstance(again, Delivery)
        assert (again.message_id, again.message) == (mid, msg(1))
        assert again.receipt != d.receipt
        await b.queue.ack([d])  # too late: the lease moved on
        assert (await a.queue.stats()).leased == 1
        await a.queue.ack([again])
        assert (await b.queue.stats()).leased == 0


async def test_a_replica_declared_dead_cannot_write_over_the_one_that_took_over(
        pg: Any) -> None:
    async with replicas(pg, "replica-stalled", "replica-new") as (stalled, new):
        await queued_run(new, ["r-1"])
        [d] = await stalled.queue.receive(1, 60)
        op_id = d.message.operation_id
        mine = await stalled.ledger.begin_attempt(op_id, "delete", owner=d.receipt, busy_s=60)
        # The stalled replica's request is in the air, and it stops heartbeating (a
        # stall, a partition): the other, beating steadily, declares it dead.
        await beat_steadily(new.membership)
        assert new.membership.reaped == 1
        [again] = await new.queue.receive(1, 60)
        theirs = await new.ledger.begin_attempt(op_id, "delete", owner=again.receipt,
                                                busy_s=60, supersedes_open=True)
        # The stalled one's answer arrives after all: it is not written over the new
        # holder's attempt (no error either: the new holder decides).
        assert await stalled.ledger.settle([Settlement(
            op_id, OpState.DELETED, d, attempt_id=mine, status=204,
            outcome="deleted")]) == Settled([], frozenset({op_id}))
        op = await new.ledger.get_operation(op_id)
        assert op is not None
        assert op.state is OpState.IN_FLIGHT
        assert [a.outcome for a in await new.ledger.attempts(op_id)] == ["unknown", None]
        assert await new.ledger.settle([Settlement(
            op_id, OpState.DELETED, again, attempt_id=theirs, status=204,
            outcome="deleted")]) == Settled([])
        op = await new.ledger.get_operation(op_id)
        assert op is not None
        assert op.state is OpState.DELETED
        assert [a.outcome for a in await new.ledger.attempts(op_id)] == ["unknown", "deleted"]
        assert [e.operation_id for e in await new.ledger.events_after(0, 10)] == [op_id]
