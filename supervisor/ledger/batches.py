"""The ledger's batch records (:class:`supervisor.ledger.base.BatchRecords`), written
once over either backend's statements, like the rest of the core."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from supervisor.errors import IllegalTransition, OperationBusy
from supervisor.ledger.driver import Row, Statements, Tx
from supervisor.model import Batch, BatchMember
from supervisor.states import OpState

T = TypeVar("T")

# The states a job counts against the partner's cap in.
JOB_STATES = ("submitting", "submitted")


def _batch(r: Row) -> Batch:
    return Batch(id=r[0], shape=r[1], size=r[2], state=r[3], created_at=r[4], job_ref=r[5],
                 submitted_at=r[6], polled_at=r[7], closed_at=r[8], results_expire_at=r[9],
                 detail=r[10])


class BatchBook:
    """Mixed into :class:`supervisor.ledger.core.LedgerCore`, which supplies these."""

    _sql: Statements

    async def _write(self, fn: Callable[[Any], Awaitable[T]], savepoint: bool = True) -> T:
        raise NotImplementedError

    async def _read(self, query: str, *args: Any, listing: bool = False) -> list[Row]:
        raise NotImplementedError

    def _now(self) -> float:
        raise NotImplementedError

    async def _admit(self, tx: Any) -> None:
        raise NotImplementedError

    async def _transition(self, tx: Any, operation_id: str, target: OpState,
                          reason: str | None, count: int, now: float,
                          owner: str | None = None, busy_s: float | None = None) -> int:
        raise NotImplementedError

    async def _close_batches(self, tx: Tx, now: float, batch_ids: Iterable[str] = (),
                             of_operations: Sequence[str] = ()) -> None:
        """Close the batches (named, or those the operations' attempts went out in) whose
        last open attempt this transaction closed. Each batch's lock first: two
        transactions closing a batch's last two attempts at once (PostgreSQL, READ
        COMMITTED) would each see the other's still open and neither close it; in turn,
        the later one's statement sees the earlier's commit."""
        ids = set(batch_ids)
        if of_operations:
            ids.update(r[0] for r in await tx.fetch(self._sql.SELECT_OPEN_BATCHES_OF,
                                                    list(of_operations)))
        if not ids:
            return
        for batch_id in sorted(ids):  # one order everywhere: no deadlock between two
            await tx.lock(f"batch:{batch_id}")
        await tx.execute(self._sql.CLOSE_FINISHED_BATCHES, now, sorted(ids))

    async def record_batch(self, batch: Batch, members: Sequence[tuple[int, int]]) -> None:
        sql = self._sql

        async def write(tx: Tx) -> None:
            await tx.execute(sql.INSERT_BATCH, batch.id, batch.shape, batch.size, batch.state,
                             self._now())
            await tx.executemany(sql.LINK_ATTEMPT, [(batch.id, pos, attempt_id)
                                                   for attempt_id, pos in members])

        await self._write(write, savepoint=False)

    async def update_batch(self, batch_id: str, state: str, *, job_ref: str | None = None,
                           submitted: bool = False, polled: bool = False,
                           results_expire_at: float | None = None,
                           detail: str | None = None) -> None:
        sql = self._sql

        async def write(tx: Tx) -> None:
            now = self._now()
            await tx.execute(sql.UPDATE_BATCH, batch_id, state, job_ref,
                             now if submitted else None, now if polled else None,
                             now if state == "closed" else None, results_expire_at, detail)

        await self._write(write, savepoint=False)

    async def reserve_job(self, batch_id: str, cap: int) -> bool:
        sql = self._sql

        async def write(tx: Tx) -> bool:
            # Serialised with every other replica's reservation: the count and the write
            # are one decision.
            await tx.lock("batch_jobs")
            row = await tx.fetchrow(sql.COUNT_JOBS, batch_id)
            if row is not None and int(row[0]) >= cap:
                return False
            # Submitted from now: a lookup by its tag waits for its request's bound.
            await tx.execute(sql.UPDATE_BATCH, batch_id, "submitting", None, self._now(), None,
                             None, None, None)
            return True

        return await self._write(write, savepoint=False)

    async def get_batch(self, batch_id: str) -> Batch | None:
        found = await self._read(self._sql.SELECT_BATCH, batch_id)
        return _batch(found[0]) if found else None

    async def batch_members(self, batch_id: str) -> list[BatchMember]:
        return [BatchMember(r[0], r[1], r[2], r[3], r[4])
                for r in await self._read(self._sql.SELECT_BATCH_MEMBERS, batch_id)]

    async def open_batch_of(self, operation_id: str) -> Batch | None:
        found = await self._read(self._sql.SELECT_OPEN_BATCH_OF, operation_id)
        return _batch(found[0]) if found else None

    async def open_jobs(self) -> list[Batch]:
        return [_batch(r) for r in await self._read(self._sql.SELECT_OPEN_JOBS)]

    async def take_batch(self, batch_id: str, owner: str,
                         busy_s: float) -> list[BatchMember] | None:
        sql = self._sql

        async def write(tx: Tx) -> list[BatchMember]:
            await self._admit(tx)
            # No batch lock: two takers move its members in one order (by position), so
            # the later one waits on the first row and then finds it held; the lock, taken
            # before the rows, would invert the order a settlement takes them in.
            found = await tx.fetchrow(sql.SELECT_BATCH, batch_id)
            if found is None or found[3] == "closed":
                raise _NotTaken(batch_id)
            members = [BatchMember(r[0], r[1], r[2], r[3], r[4])
                       for r in await tx.fetch(sql.SELECT_BATCH_MEMBERS, batch_id)]
            now = self._now()
            for m in members:
                if m.outcome is None:
                    # The guarded move in flight again: refused while another owner's
                    # hold has time left. Not a new attempt: the same one, sent again.
                    await self._transition(tx, m.operation_id, OpState.IN_FLIGHT, None,
                                           count=0, now=now, owner=owner, busy_s=busy_s)
            return members

        try:
            # With a savepoint: a member refused after others were held undoes their holds.
            return await self._write(write)
        except (_NotTaken, OperationBusy, IllegalTransition):
            return None


class _NotTaken(Exception):
    """The batch is closed, or not there: nothing to take."""
