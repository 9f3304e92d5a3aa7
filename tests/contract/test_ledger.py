"""The Ledger and EventOutbox protocols' contract: every ledger backend passes this one class.

Backends: the SQLite ledger with the embedded queue on one real file, and the PostgreSQL
ledger with its queue table on one :class:`PgDatabase` (a schema of its own per test), both
owning the queue (an outcome and its ack commit together). The ``-transport`` variants are
the same ledgers with the queue elsewhere (a managed transport): a test about that form
takes the ``transport`` fixture, and hands the ledger deliveries as such a transport would.

Results are read only through the protocols (the ledger's, the outbox's and the queue's
methods), never from a backend's tables: what one backend passes, the other must too.
What only one backend has (SQLite's group commit, a file reopened or migrated) is in
tests/integration; PostgreSQL's replicas are in tests/integration/test_pg_queue.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from supervisor.errors import (
    AttemptOpen,
    IllegalTransition,
    OperationBusy,
    ScanConflict,
    StorageError,
)
from supervisor.ledger.base import LedgerStore
from supervisor.ledger.settings import LedgerConfig
from supervisor.model import (
    Backlog,
    Delivery,
    Disposition,
    Message,
    Operation,
    Published,
    Run,
    Settled,
    Settlement,
)
from supervisor.postgres import sql as pg_sql
from supervisor.postgres.database import PgDatabase
from supervisor.postgres.ledger import PostgresLedger
from supervisor.postgres.queue import PostgresQueue
from supervisor.postgres.replicas import AdvisoryRoles, Membership
from supervisor.queue.base import Queue
from supervisor.queue.courier import Courier
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue
from supervisor.states import OpState, RunState

INLINE = {"kind": "inline"}
TICK = "weekly@2024-01-01T02:00:00+00:00"


@dataclass
class Backend:
    name: str
    ledger: LedgerStore
    # The queue in the ledger's own database; None in the transport form (the queue is
    # elsewhere and the test plays the transport).
    embedded: Queue | None

    @property
    def queue(self) -> Queue:
        assert self.embedded is not None, "a test of the embedded form"
        return self.embedded


@asynccontextmanager
async def open_backend(name: str, tmp_path: Path, pg: Any) -> AsyncIterator[Backend]:
    owns_queue = not name.endswith("-transport")
    if name.startswith("sqlite"):
        db = Database(tmp_path / "data" / "cleanup.sqlite3")
        await db.open()
        try:
            yield Backend(name, SqliteLedger(db, owns_queue=owns_queue),
                          SqliteQueue(db) if owns_queue else None)
        finally:
            await db.close()
        return
    pgdb = PgDatabase(pg.dsn, pg.schema, "contract-replica")
    await pgdb.open(pg_sql.MIGRATIONS)
    roles = AdvisoryRoles(pg.dsn, pg.schema, 1.0)
    membership = Membership(pgdb, LedgerConfig(), roles)
    try:
        # No attempt starts on a replica that is not registered and fresh: join first.
        # The fence is wide here (a slow test must not trip it); test_pg_queue.py has it.
        await membership.join()
        yield Backend(name, PostgresLedger(pgdb, owns_queue=owns_queue, fence_s=60.0,
                                           dead_after_s=600.0),
                      PostgresQueue(pgdb) if owns_queue else None)
    finally:
        await membership.close()
        await roles.close()
        await pgdb.close()


def _target(request: pytest.FixtureRequest) -> tuple[str, Any]:
    # PostgreSQL's fixture only where it is used: a machine without one still runs SQLite.
    name = str(request.param)
    return name, request.getfixturevalue("pg") if name.startswith("postgres") else None


@pytest.fixture(params=["sqlite", "postgres"])
def embedded_target(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return _target(request)


@pytest.fixture(params=["sqlite-transport", "postgres-transport"])
def transport_target(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return _target(request)


@pytest.fixture
async def backend(embedded_target: tuple[str, Any], tmp_path: Path) -> AsyncIterator[Backend]:
    """The ledger owning its queue (the outcome and the ack commit together)."""
    async with open_backend(embedded_target[0], tmp_path, embedded_target[1]) as b:
        yield b


@pytest.fixture
async def transport(transport_target: tuple[str, Any],
                    tmp_path: Path) -> AsyncIterator[Backend]:
    """The ledger with the queue elsewhere: settle hands back what the transport must do."""
    async with open_backend(transport_target[0], tmp_path, transport_target[1]) as b:
        yield b


# -- helpers ---------------------------------------------------------------------------------


async def open_run(ledger: LedgerStore, tick: str = TICK, **kw: Any) -> Run:
    kw.setdefault("skip_if_unfinished", False)
    result = await ledger.open_run(tick, kw.pop("schedule", "weekly"), None, INLINE, **kw)
    assert result.run is not None
    return result.run


async def discovered_run(b: Backend, ids: list[str], tick: str = TICK) -> Run:
    """A run whose operations are discovered, published and queued: ready to consume."""
    run = await open_run(b.ledger, tick)
    await b.ledger.record_page(run.id, ids, None, 0)
    await Courier(b.ledger, b.queue).publish(await b.ledger.unpublished(1000), outbox=True)
    return run


async def take(queue: Queue, lease_s: float = 60.0) -> Delivery:
    deliveries = await queue.receive(1, lease_s)
    assert len(deliveries) == 1
    return deliveries[0]


async def transported_run(ledger: LedgerStore, ids: list[str]) -> tuple[Run, list[Delivery]]:
    """The transport form: a run whose operations a transport published (message IDs of
    its own) and has just delivered, one delivery each, counted by the ledger."""
    run = await open_run(ledger)
    await ledger.record_page(run.id, ids, None, 0)
    messages = await ledger.unpublished(1000)
    await ledger.record_published([Published(m.operation_id, f"m-{m.operation_id}", time.time())
                                   for m in messages], outbox=True)
    deliveries = [Delivery(m, f"m-{m.operation_id}", f"receipt-{m.operation_id}")
                  for m in messages]
    return run, deliveries


async def all_operations(ledger: LedgerStore, run_id: str,
                         state: OpState | None = None) -> list[Operation]:
    return await ledger.list_operations(run_id, state, None, 100_000)


async def operation(ledger: LedgerStore, op_id: str) -> Operation:
    op = await ledger.get_operation(op_id)
    assert op is not None
    return op


async def attempt_and_settle(ledger: LedgerStore, op_id: str, target: OpState) -> None:
    """One attempt and its outcome, as a consumer worker records them."""
    attempt = await ledger.begin_attempt(op_id, "delete")
    await ledger.settle([Settlement(op_id, target, None, attempt_id=attempt,
                                    outcome=target.value)])


async def stats_of(queue: Queue) -> tuple[int, int, int]:
    s = await queue.stats()
    return s.depth, s.parked, s.leased


class TestLedgerContract:
    # -- runs ------------------------------------------------------------------------------

    async def test_a_tick_delivered_twice_opens_one_run(self, backend: Backend) -> None:
        ledger = backend.ledger
        first = await ledger.open_run("weekly@slot-1", "weekly", 1.0e9, INLINE, True)
        second = await ledger.open_run("weekly@slot-1", "weekly", 1.0e9, INLINE, True)
        assert first.created
        assert not second.created
        assert first.run is not None
        assert second.run is not None
        assert second.run.id == first.run.id
        assert first.run.state is RunState.SCANNING
        assert first.run.scheduled_for == 1.0e9
        assert first.run.source == INLINE
        assert len(await ledger.list_runs(10)) == 1

    async def test_concurrent_opens_of_one_tick_open_one_run(self, backend: Backend) -> None:
        ledger = backend.ledger
        results = await asyncio.gather(*(
            ledger.open_run("weekly@slot-1", "weekly", None, INLINE, False) for _ in range(2)))
        assert sorted(r.created for r in results) == [False, True]
        assert len({r.run.id for r in results if r.run is not None}) == 1
        assert len(await ledger.list_runs(10)) == 1
        # Concurrent ticks of other slots while that run is unfinished: none opens.
        others = await asyncio.gather(*(
            ledger.open_run(f"weekly@slot-{i}", "weekly", None, INLINE, True)
            for i in range(2, 5)))
        assert all(not r.created and r.run is None for r in others)
        assert {r.skipped_for.id for r in others if r.skipped_for is not None} == {
            r.run.id for r in results if r.run is not None}
        # And with none unfinished, of several slots at once exactly one opens.
        [run] = await ledger.list_runs(1)
        await ledger.record_page(run.id, [], None, 0)
        assert await ledger.finish_runs() == [run.id]
        racing = await asyncio.gather(*(
            ledger.open_run(f"weekly@slot-{i}", "weekly", None, INLINE, True)
            for i in range(5, 8)))
        assert sum(r.created for r in racing) == 1
        assert len(await ledger.list_runs(10)) == 2

    async def test_reuse_within_matches_a_recent_run_of_the_same_schedule(
            self, backend: Backend) -> None:
        ledger = backend.ledger
        first = await open_run(ledger, "weekly@a")
        again = await ledger.open_run("weekly@b", "weekly", None, INLINE, False,
                                      reuse_within_s=600)
        assert not again.created
        assert again.run is not None
        assert again.run.id == first.id
        other = await ledger.open_run("daily@b", "daily", None, INLINE, False,
                                      reuse_within_s=600)
        assert other.created  # another schedule is not a retry of this one
        fresh = await ledger.open_run("weekly@c", "weekly", None, INLINE, False)
        assert fresh.created  # no reuse window: a different tick key is a different run

    async def test_overlap_skip_while_a_run_is_unfinished(self, backend: Backend) -> None:
        ledger = backend.ledger
        busy = await open_run(ledger, "weekly@1")
        skipped = await ledger.open_run("weekly@2", "weekly", None, INLINE,
                                        skip_if_unfinished=True)
        assert skipped.run is None
        assert not skipped.created
        assert skipped.skipped_for is not None
        assert skipped.skipped_for.id == busy.id
        # The same tick again is a duplicate, not an overlap: it returns its run.
        dup = await ledger.open_run("weekly@1", "weekly", None, INLINE, skip_if_unfinished=True)
        assert dup.run is not None
        assert dup.run.id == busy.id
        allowed = await ledger.open_run("weekly@3", "weekly", None, INLINE,
                                        skip_if_unfinished=False)
        assert allowed.created
        assert len(await ledger.list_runs(10)) == 2

    async def test_a_finished_run_does_not_block_the_next_tick(self, backend: Backend) -> None:
        ledger = backend.ledger
        run = await open_run(ledger, "weekly@1")
        await ledger.record_page(run.id, [], None, 0)
        assert await ledger.finish_runs() == [run.id]
        [finished] = await ledger.events_after(0, 10)
        assert (finished.kind, finished.run_id, finished.counts) == ("run.finished", run.id, {})
        nxt = await ledger.open_run("weekly@2", "weekly", None, INLINE, skip_if_unfinished=True)
        assert nxt.created

    async def test_list_runs_newest_first_with_before(self, backend: Backend) -> None:
        ledger = backend.ledger
        ids = [(await open_run(ledger, f"weekly@{i}")).id for i in range(3)]
        assert [r.id for r in await ledger.list_runs(10)] == ids[::-1]
        assert [r.id for r in await ledger.list_runs(10, before=ids[2])] == [ids[1], ids[0]]
        assert [r.id for r in await ledger.list_runs(1)] == [ids[2]]
        assert await ledger.list_runs(10, before=ids[0]) == []
        got = await ledger.get_run(ids[1])
        assert got is not None
        assert (got.id, got.tick_key, got.state) == (ids[1], "weekly@1", RunState.SCANNING)
        assert await ledger.get_run("run_nope") is None
        assert [r.id for r in await ledger.runs_to_scan()] == ids  # oldest first

    async def test_list_reads_carry_the_source_kind_not_its_ids(self, backend: Backend) -> None:
        """An inline run's source holds up to 10,000 IDs: only the scan reads them."""
        ledger = backend.ledger
        source = {"kind": "inline", "ids": [f"r-{i}" for i in range(1000)]}
        opened = await ledger.open_run("weekly@1", "weekly", None, source, False)
        assert opened.run is not None
        assert opened.run.source == source
        run_id = opened.run.id
        full = await ledger.get_run(run_id)
        assert full is not None
        assert full.source == source
        [scan] = await ledger.runs_to_scan()
        assert scan.source == source
        [listed] = await ledger.list_runs(10)
        assert listed.source == {"kind": "inline"}
        assert listed == dataclasses.replace(full, source={"kind": "inline"})
        assert await ledger.get_runs([run_id, "run_nope"]) == {run_id: listed}
        assert await ledger.get_runs([]) == {}
        assert await ledger.schedule_runs("weekly") == [listed]
        stats = await ledger.stats()
        assert stats.current_run == listed
        skipped = await ledger.open_run("weekly@2", "weekly", None, source, True)
        assert skipped.skipped_for == listed

    async def test_schedule_runs_are_its_newest_and_its_unfinished(self, backend: Backend) -> None:
        ledger = backend.ledger
        assert await ledger.schedule_runs("weekly") == []

        async def finished(tick: str, schedule: str = "weekly") -> str:
            run = await open_run(ledger, tick, schedule=schedule)
            await ledger.record_page(run.id, [], None, 0)
            assert await ledger.finish_runs() == [run.id]
            return run.id

        old = [await finished(f"weekly@{i}") for i in range(3)]
        # Only the newest of the finished ones: the digest's current run.
        assert [r.id for r in await ledger.schedule_runs("weekly")] == [old[-1]]
        draining = await open_run(ledger, "weekly@d")
        await ledger.record_page(draining.id, ["a"], None, 0)
        newest = await open_run(ledger, "weekly@n")
        other = await finished("daily@1", schedule="daily")
        # Unfinished ones of the schedule, oldest first, then the newest; a finished one
        # that is not the newest and another schedule's run are not among them.
        assert [r.id for r in await ledger.schedule_runs("weekly")] == [draining.id, newest.id]
        assert [r.id for r in await ledger.schedule_runs("daily")] == [other]
        assert await ledger.schedule_runs("hourly") == []

    # -- discovery -------------------------------------------------------------------------

    async def test_record_page_is_idempotent_and_ids_are_stable(self, backend: Backend) -> None:
        ledger = backend.ledger
        run = await open_run(ledger)
        first = await ledger.record_page(run.id, ["a", "b", "c"], "3", 1)
        assert (first.new_operations, first.run_state) == (3, RunState.SCANNING)
        assigned = [(op.recipient_id, op.id) for op in await all_operations(ledger, run.id)]
        # A resumed scan reads some candidates again (a source whose pages overlap, a page
        # read again after a crash): they keep their operations, only "d" is new.
        again = await ledger.record_page(run.id, ["b", "c", "d"], "6", 0, resumed_from="3")
        assert again.new_operations == 1
        rows = await all_operations(ledger, run.id)
        # The IDs assigned at discovery survive the re-read.
        assert [(op.recipient_id, op.id) for op in rows][:3] == assigned
        assert [op.recipient_id for op in rows] == ["a", "b", "c", "d"]
        assert all(op.state is OpState.DISCOVERED and op.attempts == 0 for op in rows)
        assert all(op.run_id == run.id and not op.unfinished_attempt for op in rows)
        stored = await ledger.get_run(run.id)
        assert stored is not None
        assert (stored.discovered, stored.scan_cursor, stored.scan_pages,
                stored.skipped_candidates) == (4, "6", 2, 1)
        # A candidate twice in one page is one operation too.
        dup = await ledger.record_page(run.id, ["e", "e", "a"], "9", 0, resumed_from="6")
        assert dup.new_operations == 1
        assert [op.recipient_id for op in await all_operations(ledger, run.id)] == [
            "a", "b", "c", "d", "e"]

    async def test_a_page_from_a_stale_cursor_is_refused_and_writes_nothing(
            self, backend: Backend) -> None:
        ledger = backend.ledger
        run = await open_run(ledger)
        await ledger.record_page(run.id, ["a"], "1", 0)
        await ledger.record_page(run.id, ["b"], "2", 0, resumed_from="1")
        before = await ledger.get_run(run.id)
        ops_before = await all_operations(ledger, run.id)
        unpublished_before = await ledger.unpublished(100)
        # A scanner that lost the scan to another (which moved the run on to "2") records
        # the page it read from "1"; and one starting afresh records the first page again.
        with pytest.raises(ScanConflict) as info:
            await ledger.record_page(run.id, ["c", "x"], "2b", 3, resumed_from="1")
        assert info.value.run_id == run.id
        with pytest.raises(ScanConflict):
            await ledger.record_page(run.id, ["y"], None, 0, resumed_from=None)
        assert ledger.healthy
        # Nothing of either page was written: no operation, no cursor, no count, no drain.
        assert await ledger.get_run(run.id) == before
        assert await all_operations(ledger, run.id) == ops_before
        assert await ledger.unpublished(100) == unpublished_before
        assert [r.id for r in await ledger.runs_to_scan()] == [run.id]
        # The scanner holding the current cursor goes on.
        last = await ledger.record_page(run.id, ["c"], None, 0, resumed_from="2")
        assert (last.new_operations, last.run_state) == (1, RunState.DRAINING)
        assert [op.recipient_id for op in await all_operations(ledger, run.id)] == [
            "a", "b", "c"]

    async def test_paging_by_operation_id_returns_every_operation_once_in_discovery_order(
            self, backend: Backend) -> None:
        ledger = backend.ledger
        # Recipient names in no sorted order: the ID, not the name, gives the order.
        names = [f"r-{(i * 7919) % 1000:04d}" for i in range(300)]
        run = await open_run(ledger, "weekly@1")
        cursor: str | None = None
        for n, i in enumerate(range(0, 300, 100)):
            nxt = str(n + 1) if i + 100 < 300 else None
            await ledger.record_page(run.id, names[i:i + 100], nxt, 0, resumed_from=cursor)
            cursor = nxt
        paged: list[Operation] = []
        after: str | None = None
        while page := await ledger.list_operations(run.id, None, after, 7):
            assert len(page) <= 7
            paged += page
            after = page[-1].id
        assert [op.recipient_id for op in paged] == names
        ids = [op.id for op in paged]
        assert len(set(ids)) == len(ids)
        assert ids == sorted(ids)  # the cursor is the ID: time-ordered, unique
        assert all(i.startswith("op_") for i in ids)
        assert await ledger.list_operations(run.id, None, ids[-1], 7) == []
        assert [op.id for op in await ledger.list_operations(run.id, None, ids[99], 3)] == \
            ids[100:103]

        # By state: every third is in flight, in one run and across two.
        await Courier(ledger, backend.queue).publish(await ledger.unpublished(1000))
        other = await open_run(ledger, "weekly@2")
        await ledger.record_page(other.id, ["z-1", "z-2", "z-3"], None, 0)
        later = [op.id for op in await all_operations(ledger, other.id)]
        assert min(later) > max(ids)  # a later run's discovery sorts after
        flying = ids[::3] + later[::2]
        for op_id in flying:
            await ledger.begin_attempt(op_id, "delete")
        by_run: list[str] = []
        after = None
        while page := await ledger.list_operations(run.id, OpState.IN_FLIGHT, after, 4):
            by_run += [op.id for op in page]
            after = page[-1].id
        assert by_run == ids[::3]
        everywhere: list[str] = []
        after = None
        while page := await ledger.operations_in_state(OpState.IN_FLIGHT, after, 4):
            assert all(op.state is OpState.IN_FLIGHT for op in page)
            everywhere += [op.id for op in page]
            after = page[-1].id
        assert everywhere == flying
        queued = await ledger.operations_in_state(OpState.QUEUED, None, 1000)
        assert [op.id for op in queued] == [i for i in ids if i not in flying]

    async def test_the_last_page_starts_the_drain_and_later_pages_are_refused(
            self, backend: Backend) -> None:
        ledger = backend.ledger
        run = await open_run(ledger)
        await ledger.record_page(run.id, ["a"], "1", 0)
        last = await ledger.record_page(run.id, ["b"], None, 0, resumed_from="1")
        assert last.run_state is RunState.DRAINING
        stored = await ledger.get_run(run.id)
        assert stored is not None
        assert stored.state is RunState.DRAINING
        assert stored.scan_finished_at is not None
        assert await ledger.runs_to_scan() == []
        for resumed_from in (None, "1"):
            with pytest.raises(ValueError, match="not scanning"):
                await ledger.record_page(run.id, ["c"], None, 0, resumed_from=resumed_from)
        # Refused as a whole: no operation for "c" was left behind.
        assert [op.recipient_id for op in await all_operations(ledger, run.id)] == ["a", "b"]
        assert ledger.healthy

    async def test_same_recipient_in_two_runs_is_two_operations(self, backend: Backend) -> None:
        ledger = backend.ledger
        one = await open_run(ledger, "weekly@1")
        two = await open_run(ledger, "weekly@2")
        await ledger.record_page(one.id, ["a"], None, 0)
        await ledger.record_page(two.id, ["a"], None, 0)
        assert await ledger.run_counts(one.id) == {OpState.DISCOVERED: 1}
        assert await ledger.run_counts(two.id) == {OpState.DISCOVERED: 1}
        [op1], [op2] = await all_operations(ledger, one.id), await all_operations(ledger, two.id)
        assert op1.id != op2.id

    async def test_scan_failure_and_abandon(self, backend: Backend) -> None:
        ledger = backend.ledger
        run = await open_run(ledger)
        await ledger.record_scan_failure(run.id, "boom", give_up=False)
        stored = await ledger.get_run(run.id)
        assert stored is not None
        assert (stored.scan_failures, stored.last_error, stored.state) == (
            1, "boom", RunState.SCANNING)
        await ledger.record_scan_failure(run.id, "x" * 5000, give_up=True)
        stored = await ledger.get_run(run.id)
        assert stored is not None
        assert stored.state is RunState.DRAINING
        assert stored.scan_failures == 2
        assert stored.scan_finished_at is not None
        assert stored.last_error is not None
        assert stored.last_error.startswith("scan abandoned")
        assert len(stored.last_error) <= 1000
        assert await ledger.runs_to_scan() == []

    async def test_outbox_unpublished_then_queued(self, backend: Backend) -> None:
        ledger = backend.ledger
        run = await open_run(ledger)
        await ledger.record_page(run.id, ["a", "b"], None, 0)
        batch = await ledger.unpublished(10)
        assert [(m.run_id, m.recipient_id) for m in batch] == [(run.id, "a"), (run.id, "b")]
        assert [m.operation_id for m in batch] == [
            op.id for op in await all_operations(ledger, run.id)]
        assert len(await ledger.unpublished(1)) == 1
        await Courier(ledger, backend.queue).publish(batch, outbox=True)
        assert await ledger.unpublished(10) == []
        assert await ledger.run_counts(run.id) == {OpState.QUEUED: 2}
        assert await stats_of(backend.queue) == (2, 0, 0)
        got = await backend.queue.receive(10, 60)
        assert {d.message for d in got} == set(batch)

    async def test_the_outbox_record_keeps_what_a_consumer_did_first(
            self, transport: Backend) -> None:
        """A transport may deliver a message before the outbox has recorded its publish:
        the consumer's bookkeeping stands, the late record changes nothing."""
        ledger = transport.ledger
        run = await open_run(ledger)
        await ledger.record_page(run.id, ["a"], None, 0)
        [m] = await ledger.unpublished(10)
        delivery = Delivery(m, "m-1", "receipt-1")
        [got] = await ledger.note_received([delivery], 60)
        assert got.receives == 1
        assert got.operation is not None
        assert got.operation.state is OpState.DISCOVERED
        await ledger.begin_attempt(m.operation_id, "delete", owner="receipt-1", busy_s=30)
        await ledger.record_published([Published(m.operation_id, "m-1", time.time())],
                                      outbox=True)
        op = await operation(ledger, m.operation_id)
        assert (op.state, op.attempts) == (OpState.IN_FLIGHT, 1)
        assert await ledger.unpublished(10) == []

    # -- attempts and settlement -----------------------------------------------------------

    async def test_settle_ack_removes_the_message_with_the_outcome(self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        run = await discovered_run(backend, ["a"])
        delivery = await take(queue)
        op_id = delivery.message.operation_id
        [received] = await ledger.note_received([delivery], 60)
        assert received.receives == 1
        attempt = await ledger.begin_attempt(op_id, "delete", owner=delivery.receipt, busy_s=30)
        op = await operation(ledger, op_id)
        assert (op.state, op.attempts, op.unfinished_attempt) == (OpState.IN_FLIGHT, 1, True)
        leftover = await ledger.settle([Settlement(
            op_id, OpState.DELETED, delivery, Disposition.ACK, attempt_id=attempt, status=204,
            outcome="deleted", detail="HTTP 204")])
        assert leftover.leftovers == []  # the queue is in this database: none for a transport
        assert leftover.refused == frozenset()
        assert await stats_of(queue) == (0, 0, 0)  # acked in the settlement's commit
        assert await queue.receive(10, 60) == []
        op = await operation(ledger, op_id)
        assert (op.state, op.unfinished_attempt) == (OpState.DELETED, False)
        [a] = await ledger.attempts(op_id)
        assert (a.operation_id, a.n, a.kind, a.status, a.outcome, a.detail) == (
            op_id, 1, "delete", 204, "deleted", "HTTP 204")
        assert a.finished_at is not None
        assert a.finished_at >= a.started_at
        assert await ledger.run_counts(run.id) == {OpState.DELETED: 1}

    async def test_settle_returns_what_the_transport_must_still_do(
            self, transport: Backend) -> None:
        ledger = transport.ledger
        _, (da, db_, dc, dd) = await transported_run(ledger, ["a", "b", "c", "d"])
        await ledger.note_received([da, db_, dc, dd], 60)
        attempts = [await ledger.begin_attempt(d.message.operation_id, "delete",
                                               owner=d.receipt, busy_s=30)
                    for d in (da, db_, dc, dd)]
        settlements = [
            Settlement(da.message.operation_id, OpState.DELETED, da, Disposition.ACK,
                       attempt_id=attempts[0], status=204, outcome="deleted"),
            Settlement(db_.message.operation_id, OpState.RETRY_WAIT, db_, Disposition.RETRY,
                       delay_s=60, attempt_id=attempts[1], status=503, outcome="transient"),
            Settlement(dc.message.operation_id, OpState.RETRY_WAIT, dc, Disposition.KEEP,
                       attempt_id=attempts[2], status=429, outcome="throttled",
                       refund_attempt=True),
            Settlement(dd.message.operation_id, OpState.FAILED, None, attempt_id=attempts[3],
                       status=400, outcome="failed", reason="HTTP 400"),
        ]
        left = await ledger.settle(settlements)
        # The ack and the retry are the transport's, after this commit; a kept lease and a
        # settlement without a delivery are nothing to it.
        assert left == Settled(settlements[:2])
        states = {op.recipient_id: (op.state, op.attempts)
                  for op in (await ledger.get_operations(
                      [d.message.operation_id for d in (da, db_, dc, dd)])).values()}
        assert states == {"a": (OpState.DELETED, 1), "b": (OpState.RETRY_WAIT, 1),
                          "c": (OpState.RETRY_WAIT, 0), "d": (OpState.FAILED, 1)}
        assert await ledger.get_operations(["op_nope"]) == {}

    async def test_settle_retry_parks_the_message_and_keep_leaves_it(
            self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        await discovered_run(backend, ["a", "b"])
        d1, d2 = await queue.receive(2, 60)
        a1 = await ledger.begin_attempt(d1.message.operation_id, "delete")
        a2 = await ledger.begin_attempt(d2.message.operation_id, "delete")
        left = await ledger.settle([
            Settlement(d1.message.operation_id, OpState.RETRY_WAIT, d1, Disposition.RETRY,
                       delay_s=60, attempt_id=a1, status=503, outcome="transient",
                       detail="HTTP 503"),
            Settlement(d2.message.operation_id, OpState.RETRY_WAIT, d2, Disposition.KEEP,
                       attempt_id=a2, status=429, outcome="throttled", detail="HTTP 429",
                       refund_attempt=True),
        ])
        assert left.leftovers == []
        assert await stats_of(queue) == (0, 1, 1)
        op1 = await operation(ledger, d1.message.operation_id)
        assert (op1.state, op1.attempts) == (OpState.RETRY_WAIT, 1)
        assert op1.due_at is not None
        assert op1.due_at > time.time() + 50
        op2 = await operation(ledger, d2.message.operation_id)
        assert (op2.state, op2.attempts) == (OpState.RETRY_WAIT, 0)  # a throttle is refunded
        # The parked retry cannot be acked with the lease it no longer holds.
        await queue.ack([d1])
        assert await stats_of(queue) == (0, 1, 1)

    async def test_an_illegal_transition_raises_and_changes_nothing(
            self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        await discovered_run(backend, ["a", "b"])
        da, db_ = await queue.receive(2, 60)
        before = await operation(ledger, da.message.operation_id)
        with pytest.raises(IllegalTransition) as info:  # queued -> deleted
            await ledger.settle([Settlement(da.message.operation_id, OpState.DELETED, da,
                                            Disposition.ACK)])
        assert (info.value.current, info.value.target) == (OpState.QUEUED, OpState.DELETED)
        assert info.value.operation_id == da.message.operation_id
        assert ledger.healthy
        assert await operation(ledger, da.message.operation_id) == before
        assert await stats_of(queue) == (0, 0, 2)  # its message was not acked
        assert await ledger.events_after(0, 10) == []
        # The ledger goes on: a legal write after it commits.
        await ledger.begin_attempt(db_.message.operation_id, "delete")
        assert (await operation(ledger, db_.message.operation_id)).state is OpState.IN_FLIGHT

    async def test_an_illegal_settlement_in_a_group_undoes_the_whole_group(
            self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        await discovered_run(backend, ["a", "b"])
        da, db_ = await queue.receive(2, 60)
        attempt = await ledger.begin_attempt(da.message.operation_id, "delete")
        with pytest.raises(IllegalTransition):
            await ledger.settle([
                Settlement(da.message.operation_id, OpState.DELETED, da, attempt_id=attempt,
                           status=204, outcome="deleted", detail="HTTP 204"),
                Settlement(db_.message.operation_id, OpState.DELETED, db_),  # still queued
            ])
        op = await operation(ledger, da.message.operation_id)
        assert op.state is OpState.IN_FLIGHT
        assert op.unfinished_attempt
        [a] = await ledger.attempts(da.message.operation_id)
        assert a.outcome is None
        assert await stats_of(queue) == (0, 0, 2)
        assert await ledger.events_after(0, 10) == []

    async def test_concurrent_settlements_fail_only_the_illegal_one(
            self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        run = await discovered_run(backend, ["a", "b", "c"])
        da, db_, dc = await queue.receive(3, 60)
        for d in (da, db_, dc):
            await ledger.begin_attempt(d.message.operation_id, "delete")
        # b is settled once already: settling it again (deleted -> deleted) is illegal.
        await ledger.settle([Settlement(db_.message.operation_id, OpState.DELETED, db_)])
        results = await asyncio.gather(*(ledger.settle([Settlement(
            d.message.operation_id, OpState.DELETED, d, Disposition.ACK)])
            for d in (da, db_, dc)), return_exceptions=True)
        assert results[0] == Settled([])
        assert results[2] == Settled([])
        assert isinstance(results[1], IllegalTransition)
        assert ledger.healthy
        assert await ledger.run_counts(run.id) == {OpState.DELETED: 3}
        assert await stats_of(queue) == (0, 0, 0)
        events = await ledger.events_after(0, 10)
        assert sorted(e.recipient_id or "" for e in events) == ["a", "b", "c"]  # b once

    async def test_terminal_states_refuse_every_move(self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        await discovered_run(backend, ["a"])
        d = await take(queue)
        op_id = d.message.operation_id
        await ledger.begin_attempt(op_id, "delete")
        await ledger.settle([Settlement(op_id, OpState.ALREADY_ABSENT, d)])
        for target in OpState:
            with pytest.raises(IllegalTransition):
                await ledger.settle([Settlement(op_id, target, None)])
        with pytest.raises(IllegalTransition):
            await ledger.begin_attempt(op_id, "delete")
        with pytest.raises(IllegalTransition):
            await ledger.record_evidence(op_id, "operator", OpState.QUEUED, "retry", "by hand")
        assert (await operation(ledger, op_id)).state is OpState.ALREADY_ABSENT
        assert len(await ledger.attempts(op_id)) == 1
        assert ledger.healthy

    async def test_an_unknown_operation_is_a_key_error(self, backend: Backend) -> None:
        ledger = backend.ledger
        with pytest.raises(KeyError):
            await ledger.begin_attempt("op_nope", "delete")
        with pytest.raises(KeyError):
            await ledger.settle([Settlement("op_nope", OpState.DELETED, None)])
        with pytest.raises(KeyError):
            await ledger.record_evidence("op_nope", "probe", OpState.DELETED, "gone", "404")
        assert await ledger.get_operation("op_nope") is None
        assert await ledger.attempts("op_nope") == []
        assert ledger.healthy

    async def test_attempts_are_written_before_they_are_sent_and_superseded(
            self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        await discovered_run(backend, ["a"])
        d = await take(queue)
        op_id = d.message.operation_id
        first = await ledger.begin_attempt(op_id, "delete")
        [open_one] = await ledger.attempts(op_id)
        assert (open_one.id, open_one.n, open_one.outcome, open_one.finished_at) == (
            first, 1, None, None)
        # A redelivery after a crash finds the attempt open and resends with the same key.
        second = await ledger.begin_attempt(op_id, "delete", supersedes_open=True)
        assert second != first
        a1, a2 = await ledger.attempts(op_id)
        assert (a1.id, a1.n, a1.outcome) == (first, 1, "unknown")
        assert a1.finished_at is not None
        assert a1.detail is not None
        assert "no outcome recorded" in a1.detail
        assert (a2.id, a2.n, a2.outcome, a2.finished_at) == (second, 2, None, None)
        op = await operation(ledger, op_id)
        assert op.attempts == 2
        assert op.unfinished_attempt
        # Without superseding (no idempotency keys), an open attempt is refused and nothing
        # is written: its outcome is unknown, and a resend after it would be blind.
        with pytest.raises(AttemptOpen):
            await ledger.begin_attempt(op_id, "delete", supersedes_open=False)
        assert [(a.id, a.outcome) for a in await ledger.attempts(op_id)][1:] == [(second, None)]
        after = await operation(ledger, op_id)
        assert (after.state, after.attempts) == (op.state, op.attempts)

    async def test_a_settlement_of_a_superseded_attempt_is_discarded(
            self, backend: Backend) -> None:
        """Attempt A is superseded by B (a second delivery after A's guard ran out); A's
        late answer, whatever it is, changes nothing: the operation is B's. Even once B
        has settled it, A's 5xx is no illegal move (DELETED -> RETRY_WAIT), just dropped."""
        ledger, queue = backend.ledger, backend.queue
        run = await discovered_run(backend, ["a", "b"])
        d1, d2 = await queue.receive(2, 60)
        ops = [d1.message.operation_id, d2.message.operation_id]
        for d, op_id in zip((d1, d2), ops, strict=True):
            a = await ledger.begin_attempt(op_id, "delete")
            b = await ledger.begin_attempt(op_id, "delete", supersedes_open=True)
            late = Settlement(op_id, OpState.DELETED, d, Disposition.ACK, attempt_id=a,
                              status=204, outcome="deleted", detail="HTTP 204 (A)")
            await ledger.settle([late])
            op = await operation(ledger, op_id)
            assert (op.state, op.attempts, op.unfinished_attempt) == (
                OpState.IN_FLIGHT, 2, True)
            assert [(x.id, x.outcome) for x in await ledger.attempts(op_id)] == [
                (a, "unknown"), (b, None)]
            await ledger.settle([Settlement(op_id, OpState.DELETED, d, Disposition.ACK,
                                            attempt_id=b, status=204, outcome="deleted",
                                            detail="HTTP 204 (B)")])
            # A's second answer (a retried 5xx, say) after B settled: discarded too,
            # alone and in a group with a settlement that does apply.
            retry = Settlement(op_id, OpState.RETRY_WAIT, d, Disposition.RETRY, delay_s=5,
                               attempt_id=a, status=503, outcome="transient")
            await ledger.settle([retry])
        await ledger.settle([retry, Settlement(ops[0], OpState.RETRY_WAIT, d1,
                                               Disposition.RETRY, attempt_id=a,
                                               outcome="transient")])
        for op_id in ops:
            op = await operation(ledger, op_id)
            assert (op.state, op.attempts, op.unfinished_attempt) == (OpState.DELETED, 2, False)
            assert [(x.outcome, x.detail) for x in await ledger.attempts(op_id)][1] == (
                "deleted", "HTTP 204 (B)")
        assert await ledger.run_counts(run.id) == {OpState.DELETED: 2}
        assert ledger.healthy
        # One settled event per operation: B's, not A's.
        events = await ledger.events_after(0, 100)
        assert sorted(e.operation_id for e in events if e.kind == "operation.settled") == \
            sorted(ops)

    async def test_an_attempt_is_owned_until_superseded_settled_or_its_hold_runs_out(
            self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        await discovered_run(backend, ["a", "b"])
        d1, d2 = await queue.receive(2, 60)
        op_id = d1.message.operation_id
        a = await ledger.begin_attempt(op_id, "delete", owner="lease-1", busy_s=30)
        assert await ledger.owns_attempt(op_id, a, "lease-1", 10)
        assert not await ledger.owns_attempt(op_id, a, "lease-2", 10)  # not its owner
        assert not await ledger.owns_attempt(op_id, a, "lease-1", 60)  # not held that long
        assert not await ledger.keep_attempt(op_id, a, "lease-2", 120)
        assert await ledger.keep_attempt(op_id, a, "lease-1", 120)
        assert await ledger.owns_attempt(op_id, a, "lease-1", 60)
        # Kept: another delivery still finds it busy.
        with pytest.raises(OperationBusy) as info:
            await ledger.begin_attempt(op_id, "delete", owner="lease-2", busy_s=30)
        assert info.value.until > time.time() + 100
        # The holder's own next attempt supersedes it: the first one is nobody's now.
        b = await ledger.begin_attempt(op_id, "delete", owner="lease-1", busy_s=30,
                                       supersedes_open=True)
        assert not await ledger.owns_attempt(op_id, a, "lease-1", 0)
        assert not await ledger.keep_attempt(op_id, a, "lease-1", 30)
        assert await ledger.owns_attempt(op_id, b, "lease-1", 0)
        await ledger.settle([Settlement(op_id, OpState.DELETED, d1, attempt_id=b,
                                        outcome="deleted")])
        assert not await ledger.owns_attempt(op_id, b, "lease-1", 0)
        assert not await ledger.keep_attempt(op_id, b, "lease-1", 30)
        # A hold that ran out is not kept, even for its owner: another may have passed it.
        other = d2.message.operation_id
        c = await ledger.begin_attempt(other, "delete", owner="lease-3", busy_s=0.01)
        await asyncio.sleep(0.05)  # the hold is a deadline on a clock: let it pass
        assert not await ledger.owns_attempt(other, c, "lease-3", 0)
        assert not await ledger.keep_attempt(other, c, "lease-3", 30)
        assert ledger.healthy

    async def test_a_batchs_members_are_owned_each_as_one_attempt_would_be(
            self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        await discovered_run(backend, ["a", "b", "c", "d"])
        ds = await queue.receive(4, 60)
        ops = [d.message.operation_id for d in ds]
        held = [await ledger.begin_attempt(op, "delete", owner=f"lease-{i}", busy_s=30)
                for i, op in enumerate(ops[:3])]
        claims = [(op, a, f"lease-{i}") for i, (op, a) in enumerate(zip(ops[:3], held, strict=True))]
        assert await ledger.owns_attempts(claims, 10) == set(ops[:3])
        assert await ledger.owns_attempts(claims, 60) == set()  # none held that long
        assert await ledger.owns_attempts([], 10) == set()
        # One claimed by the wrong owner, one superseded, one settled: none of them.
        wrong = (ops[0], held[0], "lease-9")
        await ledger.begin_attempt(ops[1], "delete", owner="lease-1", busy_s=30,
                                   supersedes_open=True)
        await ledger.settle([Settlement(ops[2], OpState.DELETED, ds[2], attempt_id=held[2],
                                        outcome="deleted")])
        assert await ledger.owns_attempts([wrong, *claims[1:]], 0) == set()
        assert await ledger.owns_attempts(claims, 0) == {ops[0]}
        assert ledger.healthy

    async def test_an_operation_in_flight_elsewhere_is_busy(self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        await discovered_run(backend, ["a"])
        d = await take(queue)
        op_id = d.message.operation_id
        await ledger.begin_attempt(op_id, "delete", owner="lease-1", busy_s=30)
        with pytest.raises(OperationBusy) as info:
            await ledger.begin_attempt(op_id, "delete", owner="lease-2", busy_s=30)
        assert info.value.operation_id == op_id
        assert info.value.until > time.time() + 20
        assert ledger.healthy
        # The holder itself may go again (a throttled retry of its own attempt).
        await ledger.begin_attempt(op_id, "delete", owner="lease-1", busy_s=30)
        op = await operation(ledger, op_id)
        assert op.attempts == 2

    async def test_a_hold_that_ran_out_can_be_taken_over(self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        await discovered_run(backend, ["a"])
        d = await take(queue)
        op_id = d.message.operation_id
        await ledger.begin_attempt(op_id, "delete", owner="lease-1", busy_s=0.01)
        await asyncio.sleep(0.05)  # the hold is a wall-clock deadline: let it pass
        await ledger.begin_attempt(op_id, "delete", owner="lease-2", busy_s=30)
        # The new holder holds it now; the old one does not.
        with pytest.raises(OperationBusy):
            await ledger.begin_attempt(op_id, "delete", owner="lease-1", busy_s=30)

    # -- evidence, ambiguity and redrive ---------------------------------------------------

    async def _ambiguous(self, b: Backend) -> tuple[Run, str]:
        run = await discovered_run(b, ["a"])
        d = await take(b.queue)
        op_id = d.message.operation_id
        attempt = await b.ledger.begin_attempt(op_id, "delete")
        await b.ledger.settle([Settlement(op_id, OpState.AMBIGUOUS, d, reason="reset after send",
                                          attempt_id=attempt, outcome="ambiguous",
                                          detail="no answer: ServerDisconnectedError")])
        return run, op_id

    async def test_ambiguous_does_not_hold_the_run_open(self, backend: Backend) -> None:
        ledger = backend.ledger
        run, op_id = await self._ambiguous(backend)
        assert await ledger.finish_runs() == [run.id]
        due = await ledger.ambiguous_due(time.time() + 1, 10)
        assert [(op.id, op.state, op.reason) for op in due] == [
            (op_id, OpState.AMBIGUOUS, "reset after send")]
        assert await ledger.ambiguous_due(0.0, 10) == []  # not settled long enough yet
        assert [op.id for op in await ledger.operations_in_state(OpState.AMBIGUOUS, None,
                                                                 10)] == [op_id]
        assert (await ledger.stats()).ambiguous == 1

    async def test_an_inconclusive_probe_puts_the_next_one_off(self, backend: Backend) -> None:
        ledger = backend.ledger
        _, op_id = await self._ambiguous(backend)
        assert (await ledger.stats()).inconclusive == 0
        await ledger.record_evidence(op_id, "probe", OpState.AMBIGUOUS, "ambiguous",
                                     "inconclusive: probe HTTP 500", probe_after_s=600.0)
        op = await operation(ledger, op_id)
        assert op.due_at == pytest.approx(op.updated_at + 600.0)
        assert await ledger.ambiguous_due(time.time() + 3600, 10) == []  # put off
        assert ((await ledger.stats()).ambiguous, (await ledger.stats()).inconclusive) == (1, 1)
        await ledger.record_evidence(op_id, "probe", OpState.AMBIGUOUS, "ambiguous",
                                     "inconclusive: probe HTTP 500", probe_after_s=0.0)
        assert [o.id for o in await ledger.ambiguous_due(time.time() + 1, 10)] == [op_id]
        await ledger.record_evidence(op_id, "operator", OpState.DELETED, "by hand", "ops: ok")
        assert (await ledger.stats()).inconclusive == 0

    async def test_attempts_are_paged_in_the_order_written(self, backend: Backend) -> None:
        ledger = backend.ledger
        _, op_id = await self._ambiguous(backend)
        for i in range(5):
            await ledger.record_evidence(op_id, "probe", OpState.AMBIGUOUS, "ambiguous",
                                         f"inconclusive {i}")
        everything = await ledger.attempts(op_id)
        assert [a.detail for a in everything][1:] == [f"inconclusive {i}" for i in range(5)]
        assert await ledger.attempts(op_id, 0, 2) == everything[:2]
        assert await ledger.attempts(op_id, 2, 2) == everything[2:4]
        assert await ledger.attempts(op_id, 4, 10) == everything[4:]
        assert await ledger.attempts(op_id, 6, 10) == []

    async def test_a_run_is_read_with_its_counts_as_they_stood_together(
            self, backend: Backend) -> None:
        """What the API answers a run with: done with nothing left to act on, then, once a
        probe queued its operation again, draining with that operation queued."""
        ledger = backend.ledger
        run, op_id = await self._ambiguous(backend)
        assert await ledger.finish_runs() == [run.id]
        found = await ledger.run_with_counts(run.id)
        assert found is not None
        done, counts = found
        assert (done.id, done.state, counts) == (run.id, RunState.DONE, {OpState.AMBIGUOUS: 1})
        assert done.source == {"kind": run.source["kind"]}  # the kind, as list reads give
        await ledger.record_evidence(op_id, "probe", OpState.QUEUED, "present again",
                                     "probe HTTP 200", status=200)
        found = await ledger.run_with_counts(run.id)
        assert found is not None
        again, counts = found
        assert (again.state, counts) == (RunState.DRAINING, {OpState.QUEUED: 1})
        assert counts == await ledger.run_counts(run.id)
        assert await ledger.run_with_counts("run_nope") is None

    async def test_evidence_moves_an_ambiguous_operation(self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        run, op_id = await self._ambiguous(backend)
        assert await ledger.finish_runs() == [run.id]
        must_publish = await ledger.record_evidence(op_id, "probe", OpState.AMBIGUOUS,
                                                    "ambiguous", "inconclusive: probe HTTP 500")
        assert must_publish is False
        requeued = await ledger.record_evidence(op_id, "probe", OpState.QUEUED, "present again",
                                                "probe HTTP 200", status=200)
        assert requeued is False  # the queue is in this database: the message is there
        [d] = await queue.receive(10, 60)
        assert d.message.operation_id == op_id
        op = await operation(ledger, op_id)
        assert (op.state, op.reason) == (OpState.QUEUED, "present again")
        # Work again: the run it had finished drains until it is done once more.
        reopened = await ledger.get_run(run.id)
        assert reopened is not None
        assert (reopened.state, reopened.finished_at) == (RunState.DRAINING, None)
        assert await ledger.finish_runs() == []
        attempts = await ledger.attempts(op_id)
        assert [(a.kind, a.outcome) for a in attempts] == [
            ("delete", "ambiguous"), ("probe", "ambiguous"), ("probe", "queued")]
        assert (attempts[2].status, attempts[2].detail) == (200, "probe HTTP 200")
        with pytest.raises(IllegalTransition):
            await ledger.record_evidence(op_id, "operator", OpState.DELETED, "x", "y")

    async def test_evidence_that_queues_again_leaves_the_publish_to_the_transport(
            self, transport: Backend) -> None:
        ledger = transport.ledger
        run, [d] = await transported_run(ledger, ["a"])
        op_id = d.message.operation_id
        await ledger.note_received([d], 60)
        attempt = await ledger.begin_attempt(op_id, "delete", owner=d.receipt, busy_s=30)
        s = Settlement(op_id, OpState.AMBIGUOUS, d, attempt_id=attempt, outcome="ambiguous")
        assert await ledger.settle([s]) == Settled([s])  # the transport acks it
        assert await ledger.finish_runs() == [run.id]
        assert await ledger.record_evidence(op_id, "probe", OpState.QUEUED, "present again",
                                            "probe HTTP 200", status=200) is True
        # No message is live until the transport publishes one: redrive's cue meanwhile.
        [due] = await ledger.overdue(None, time.time() + 1, 10)
        assert due == d.message
        assert await ledger.finish_runs() == []
        await ledger.record_published([Published(op_id, "m-2", time.time())])
        assert await ledger.overdue(None, time.time() + 1, 10) == []

    async def test_finish_runs_waits_for_every_unfinished_operation(
            self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        run = await discovered_run(backend, ["a", "b"])
        da, db_ = await queue.receive(2, 60)
        await ledger.begin_attempt(da.message.operation_id, "delete")
        await ledger.settle([Settlement(da.message.operation_id, OpState.DELETED, da)])
        assert await ledger.finish_runs() == []
        await ledger.begin_attempt(db_.message.operation_id, "delete")
        assert await ledger.finish_runs() == []  # in flight
        await ledger.settle([Settlement(db_.message.operation_id, OpState.FAILED, db_,
                                        reason="partner answered HTTP 400")])
        assert await ledger.finish_runs() == [run.id]
        assert await ledger.finish_runs() == []
        done = await ledger.get_run(run.id)
        assert done is not None
        assert done.state is RunState.DONE
        assert done.finished_at is not None
        failed = await operation(ledger, db_.message.operation_id)
        assert failed.reason == "partner answered HTTP 400"

    async def test_a_scanning_run_is_never_finished(self, backend: Backend) -> None:
        await open_run(backend.ledger)
        assert await backend.ledger.finish_runs() == []

    async def test_overdue_is_decided_from_ledger_age_alone(self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        await discovered_run(backend, ["a", "b", "c"])
        held = await take(queue)
        await ledger.note_received([held], 60)  # a consumer holds it: not overdue
        now = time.time()
        overdue = {m.operation_id for m in await ledger.overdue(now + 1, now, 10)}
        assert held.message.operation_id not in overdue
        assert len(overdue) == 2  # the others: nothing has delivered them since they were due
        assert len(await ledger.overdue(now + 1, now, 1)) == 1  # at most ``limit``
        assert await ledger.overdue(now - 60, now - 60, 10) == []  # within the grace
        assert await ledger.overdue(None, now, 10) == []  # the age rule off: none unposted

    async def test_a_retry_without_a_live_message_is_overdue_when_due(
            self, transport: Backend) -> None:
        """Without transactional ack the settle leaves no live message for a retry; the
        courier publishes one, unless the wait is too long for the transport: then redrive
        publishes it when it is due, and not before."""
        ledger = transport.ledger
        _, [delivery] = await transported_run(ledger, ["a"])
        m = delivery.message
        [got] = await ledger.note_received([delivery], 60)
        assert got.receives == 1
        attempt = await ledger.begin_attempt(m.operation_id, "delete", owner="receipt-1",
                                             busy_s=30)
        [left] = (await ledger.settle([Settlement(
            m.operation_id, OpState.RETRY_WAIT, delivery, Disposition.RETRY, delay_s=0.3,
            attempt_id=attempt, status=503, outcome="transient", detail="HTTP 503")])).leftovers
        assert left.delivery == delivery  # the transport must still ack it: after commit
        now = time.time()
        assert await ledger.overdue(0, now, 10) == []  # not due yet
        [due] = await ledger.overdue(None, now + 1, 10)
        assert due == m
        # The old message, delivered again before any repost, becomes the live one again;
        # its receive count started again with the outcome.
        [again] = await ledger.note_received([delivery], 60)
        assert again.receives == 1
        assert await ledger.overdue(None, now + 1, 10) == []  # a message is live
        # A later repost makes another message the live one and starts the poison count
        # again (a deliberate move is no failed delivery); a copy still counts as received.
        await ledger.record_published([Published(m.operation_id, "m-2", time.time())])
        [copy] = await ledger.note_received([delivery], 60)
        assert copy.receives == 1
        [twice] = await ledger.note_received([delivery], 60)
        assert twice.receives == 2
        # A delivery of no operation the ledger knows.
        stray = Delivery(Message(m.run_id, "op_nope", "x"), "m-x", "receipt-x")
        [unknown] = await ledger.note_received([stray], 60)
        assert (unknown.operation, unknown.receives) == (None, 0)

    async def test_per_message_a_message_delivered_again_counts_once(
            self, transport: Backend) -> None:
        """Infrai push redelivers a message by itself (after its visibility timeout): one
        message, one receive. Another message of the operation counts, and is then the
        live one; an outcome starts the count again. What holds the operation comes back
        with the count: an attempt's guard, a retry not yet due."""
        ledger = transport.ledger
        _, [delivery] = await transported_run(ledger, ["a"])
        m = delivery.message
        again = [Delivery(m, delivery.message_id, f"receipt-{i}") for i in range(5)]
        for d in [delivery, *again]:
            [got] = await ledger.note_received([d], 60, per_message=True)
            assert (got.receives, got.held_s) == (1, 0.0)
        other = Delivery(m, "m-other", "receipt-other")
        [got] = await ledger.note_received([other], 60, per_message=True)
        assert got.receives == 2
        [got] = await ledger.note_received([other], 60, per_message=True)
        assert got.receives == 2
        [got] = await ledger.note_received([delivery], 60, per_message=True)
        assert got.receives == 3  # the other was counted last
        # Without per_message every delivery counts (a pulled message's poison rule).
        [got] = await ledger.note_received([delivery], 60)
        assert got.receives == 4
        attempt = await ledger.begin_attempt(m.operation_id, "delete", owner="receipt-1",
                                             busy_s=30)
        [got] = await ledger.note_received([again[0]], 60, per_message=True)
        assert got.receives == 4
        assert 25 < got.held_s <= 30  # the attempt's in-flight guard
        await ledger.settle([Settlement(
            m.operation_id, OpState.RETRY_WAIT, delivery, Disposition.RETRY, delay_s=50,
            attempt_id=attempt, status=503, outcome="transient", detail="HTTP 503")])
        [got] = await ledger.note_received([delivery], 60, per_message=True)
        assert got.receives == 1  # counted again from the outcome
        assert 45 < got.held_s <= 50  # the retry is not due

    async def test_stats(self, backend: Backend) -> None:
        ledger, queue = backend.ledger, backend.queue
        empty = await ledger.stats()
        assert empty.current_run is None
        assert empty.ambiguous == 0
        assert dict(empty.current_run_by_state) == {}
        await discovered_run(backend, ["x"], tick="weekly@0")
        run = await discovered_run(backend, ["a", "b"], tick="weekly@1")
        stats = await ledger.stats()
        assert stats.current_run is not None
        assert stats.current_run.id == run.id  # the newest
        assert stats.ambiguous == 0
        assert stats.current_run_by_state == {OpState.QUEUED: 2}
        d = next(d for d in await queue.receive(3, 60) if d.message.run_id == run.id)
        await ledger.begin_attempt(d.message.operation_id, "delete")
        await ledger.settle([Settlement(d.message.operation_id, OpState.AMBIGUOUS, d,
                                        reason="timeout")])
        stats = await ledger.stats()
        assert stats.ambiguous == 1
        assert stats.current_run_by_state == {OpState.QUEUED: 1, OpState.AMBIGUOUS: 1}

    async def test_queue_stats_as_the_ledger_sees_the_queue(self, transport: Backend) -> None:
        ledger = transport.ledger
        s = await ledger.queue_stats()
        assert (s.depth, s.oldest_claimable_age_s) == (0, 0)
        began = time.time()
        _, (d0, d1, _) = await transported_run(ledger, ["a", "b", "c"])
        s = await ledger.queue_stats()
        assert (s.depth, s.parked, s.leased) == (3, 0, 0)
        # Claimable since this test published it (1 s for the clocks' resolution).
        assert s.oldest_claimable_age_s <= time.time() - began + 1.0
        await ledger.note_received([d0], 60)  # a consumer holds it
        s = await ledger.queue_stats()
        assert (s.depth, s.parked, s.leased) == (2, 0, 1)
        attempt = await ledger.begin_attempt(d0.message.operation_id, "delete")
        await ledger.settle([Settlement(d0.message.operation_id, OpState.RETRY_WAIT, d0,
                                        Disposition.RETRY, delay_s=60, attempt_id=attempt)])
        s = await ledger.queue_stats()
        assert (s.depth, s.parked, s.leased) == (2, 1, 0)  # waiting for its retry
        await ledger.begin_attempt(d1.message.operation_id, "delete")  # in flight: held
        s = await ledger.queue_stats()
        assert (s.depth, s.parked, s.leased) == (1, 1, 1)
        await ledger.settle([Settlement(d1.message.operation_id, OpState.DELETED, d1)])
        s = await ledger.queue_stats()
        assert (s.depth, s.parked, s.leased) == (1, 1, 0)  # a settled one is no work
        assert s.oldest_claimable_age_s <= time.time() - began + 1.0

    async def test_operator_actions_are_recorded_with_who_why_and_when(
            self, backend: Backend) -> None:
        ledger = backend.ledger
        assert await ledger.operator_actions("budget.resume", 10) == []
        before = time.time()
        first = await ledger.record_operator_action(
            "budget.resume", "ana", "partner confirmed the reset", {"paused_until": 1.8e12})
        second = await ledger.record_operator_action(
            "budget.resume", "bo", "again", {"forget_limit": True})
        await ledger.record_operator_action("other", "cy", "not listed", {})
        got = await ledger.operator_actions("budget.resume", 10)
        assert got == [second, first]  # newest first, only the kind asked for
        assert (first.by, first.reason, first.detail) == (
            "ana", "partner confirmed the reset", {"paused_until": 1.8e12})
        assert before <= first.at <= second.at <= time.time()
        assert await ledger.operator_actions("budget.resume", 1) == [second]

    async def test_a_closed_ledger_refuses_with_a_storage_error(self, backend: Backend) -> None:
        ledger = backend.ledger
        run = await open_run(ledger)
        await ledger.close()
        await ledger.close()  # safe twice
        with pytest.raises(StorageError):
            await ledger.get_run(run.id)
        with pytest.raises(StorageError):
            await ledger.record_page(run.id, ["a"], None, 0)

    # -- the events outbox -----------------------------------------------------------------

    async def test_each_settlement_and_finished_run_writes_one_event(
            self, backend: Backend) -> None:
        ledger = backend.ledger
        run = await open_run(ledger)
        await ledger.record_page(run.id, [f"r-{i}" for i in range(8)], None, 0)
        ops = [op.id for op in await all_operations(ledger, run.id)]
        assert await ledger.events_after(0, 10) == []
        await attempt_and_settle(ledger, ops[0], OpState.DELETED)
        [event] = await ledger.events_after(0, 10)
        assert (event.kind, event.run_id, event.operation_id, event.recipient_id,
                event.outcome, event.counts) == (
            "operation.settled", run.id, ops[0], "r-0", "deleted", None)
        assert event.id.startswith("ev_")
        assert event.seq > 0
        assert event.at > 0
        # Several at once, and a retry: no event for a retry.
        attempts = [await ledger.begin_attempt(op, "delete") for op in ops[1:4]]
        await ledger.settle([
            Settlement(ops[1], OpState.ALREADY_ABSENT, None, attempt_id=attempts[0]),
            Settlement(ops[2], OpState.FAILED, None, attempt_id=attempts[1], reason="HTTP 400"),
            Settlement(ops[3], OpState.RETRY_WAIT, None, attempt_id=attempts[2]),
        ])
        # Ambiguous without an attempt of its own (a redelivery after a crash): its open
        # attempt's outcome is unknown for good.
        await ledger.begin_attempt(ops[4], "delete")
        await ledger.settle([Settlement(ops[4], OpState.AMBIGUOUS, None)])
        [unknown] = await ledger.attempts(ops[4])
        assert unknown.outcome == "unknown"
        # An illegal settlement writes no event.
        with pytest.raises(IllegalTransition):
            await ledger.settle([Settlement(ops[6], OpState.DELETED, None)])
        await attempt_and_settle(ledger, ops[5], OpState.DELETED)
        # Evidence: an inconclusive probe writes no event; a resolution does.
        await ledger.record_evidence(ops[4], "probe", OpState.AMBIGUOUS, "inconclusive", "503")
        await ledger.record_evidence(ops[4], "probe", OpState.DELETED, "probe: gone",
                                     "HTTP 404")
        outcomes = [(e.operation_id, e.outcome) for e in await ledger.events_after(0, 100)]
        assert outcomes == [(ops[0], "deleted"), (ops[1], "already_absent"),
                            (ops[2], "failed"), (ops[4], "ambiguous"), (ops[5], "deleted"),
                            (ops[4], "deleted")]
        # The run finishes once nothing is left to act on: one run.finished event, counted.
        await attempt_and_settle(ledger, ops[3], OpState.DELETED)
        await attempt_and_settle(ledger, ops[6], OpState.DELETED)
        assert await ledger.finish_runs() == []
        await attempt_and_settle(ledger, ops[7], OpState.FAILED)
        assert await ledger.finish_runs() == [run.id]
        assert await ledger.finish_runs() == []
        every = await ledger.events_after(0, 100)
        last = every[-1]
        assert (last.kind, last.run_id, last.operation_id, last.recipient_id, last.outcome) == (
            "run.finished", run.id, None, None, None)
        assert last.counts == {"deleted": 5, "already_absent": 1, "failed": 2}
        assert len(every) == 10
        seqs = [e.seq for e in every]
        assert seqs == sorted(set(seqs))  # outbox order, each seq once
        assert len({e.id for e in every}) == len(every)

    async def test_events_after_reads_past_a_cursor_in_order(self, backend: Backend) -> None:
        ledger = backend.ledger
        run = await open_run(ledger)
        await ledger.record_page(run.id, [f"r-{i}" for i in range(6)], None, 0)
        ops = [op.id for op in await all_operations(ledger, run.id)]
        for op in ops:
            await attempt_and_settle(ledger, op, OpState.DELETED)
        every = await ledger.events_after(0, 100)
        assert [e.operation_id for e in every] == ops
        seqs = [e.seq for e in every]
        assert [e.seq for e in await ledger.events_after(0, 2)] == seqs[:2]
        assert await ledger.events_after(seqs[2], 3) == every[3:6]
        assert await ledger.events_after(seqs[-1], 10) == []
        # Read page by page past each page's last seq: every event once, in order.
        paged = []
        cursor = 0
        while page := await ledger.events_after(cursor, 4):
            paged += page
            cursor = page[-1].seq
        assert paged == every

    async def test_cursors_never_move_back_backlog_and_pruning_in_bounded_batches(
            self, backend: Backend) -> None:
        ledger = backend.ledger
        run = await open_run(ledger)
        await ledger.record_page(run.id, [f"r-{i}" for i in range(10)], None, 0)
        for op in await all_operations(ledger, run.id):
            await attempt_and_settle(ledger, op.id, OpState.DELETED)
        events = await ledger.events_after(0, 100)
        s = [e.seq for e in events]
        assert len(s) == 10
        assert await ledger.event_cursor("a") == 0
        assert await ledger.event_backlog(0) == Backlog(10, events[0].at)
        await ledger.save_event_cursor("a", s[5])
        await ledger.save_event_cursor("b", s[2])
        await ledger.save_event_cursor("b", s[1])  # a cursor never moves back
        assert (await ledger.event_cursor("a"), await ledger.event_cursor("b")) == (s[5], s[2])
        assert await ledger.event_backlog(s[5]) == Backlog(4, events[6].at)
        later = time.time() + 1
        # Only what every named sink took; a sink without a cursor holds everything back.
        assert await ledger.prune_events(["a", "b", "new"], later, 100) == 0
        # Nothing younger than the retention horizon.
        assert await ledger.prune_events(["a", "b"], time.time() - 3600, 100) == 0
        assert await ledger.prune_events(["a", "b"], later, 2) == 2
        assert await ledger.prune_events(["a", "b"], later, 2) == 1
        assert await ledger.prune_events(["a", "b"], later, 2) == 0
        assert await ledger.events_after(0, 100) == events[3:]
        assert await ledger.event_backlog(s[5]) == Backlog(4, events[6].at)
        # No sink configured: everything past retention goes; a new event never reuses a seq.
        assert await ledger.prune_events([], later, 100) == 7
        assert await ledger.events_after(0, 100) == []
        assert await ledger.event_backlog(s[5]) == Backlog(0, None)
        assert await ledger.finish_runs() == [run.id]
        [finished] = await ledger.events_after(0, 100)
        assert finished.seq > s[-1]
        assert await ledger.event_backlog(s[5]) == Backlog(1, finished.at)
        assert await ledger.event_backlog(finished.seq) == Backlog(0, None)
        assert (await ledger.event_cursor("a"), await ledger.event_cursor("b")) == (s[5], s[2])
