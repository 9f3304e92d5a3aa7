"""The settler (supervisor/consumer/settler.py) on a real SQLite ledger and its queue: an
outcome the ledger refuses (another attempt or owner decides the operation) is not
counted, and its message is neither acked nor marked moved: it is left to its lease and
decided again, when it comes back, on what the deciding owner wrote."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from supervisor.consumer.settler import Settler
from supervisor.errors import IllegalTransition
from supervisor.ledger.base import LedgerStore
from supervisor.model import Batch, Delivery, Disposition, Settlement
from supervisor.queue.base import Queue
from supervisor.queue.courier import Courier
from supervisor.states import OpState
from tests.contract.test_ledger import Backend, discovered_run, open_backend, stats_of


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[Backend]:
    async with open_backend("sqlite", tmp_path, None) as b:
        yield b


def _deleted() -> float:
    return REGISTRY.get_sample_value("cleanup_operations_total", {"outcome": "deleted"}) or 0.0


async def _three_received(
        backend: Backend) -> tuple[LedgerStore, Queue, list[Delivery], Settler, list[int]]:
    """Three operations received, and a settler that notes each one settled."""
    ledger, queue = backend.ledger, backend.queue
    await discovered_run(backend, ["r-1", "r-2", "r-3"])
    seen: list[int] = []
    return (ledger, queue, await queue.receive(3, 60),
            Settler(ledger, Courier(ledger, queue), lambda: seen.append(1)), seen)


async def test_a_refused_outcome_is_not_counted_nor_its_message_moved(
        backend: Backend) -> None:
    ledger, queue, ds, settler, seen = await _three_received(backend)
    # r-1, r-2: a batch whose holds ran out, taken again by another sender.
    begun = await ledger.begin_attempts([(d.message.operation_id, d.receipt)
                                         for d in ds[:2]], "delete", 0.01)
    attempts = [a for a in begun if isinstance(a, int)]
    assert len(attempts) == 2
    await ledger.record_batch(Batch("b-1", "per_item", 2, "sent", 0.0),
                              [(a, pos) for pos, a in enumerate(attempts)])
    # r-3: a lone attempt, its hold run out too, that another delivery supersedes.
    mine = await ledger.begin_attempt(ds[2].message.operation_id, "delete",
                                      owner=ds[2].receipt, busy_s=0.01)
    await asyncio.sleep(0.05)  # a hold is a deadline on a clock: let it pass
    assert await ledger.take_batch("b-1", "taker", 30.0) is not None
    other = Delivery(ds[2].message, "m-other", "receipt-other")
    await ledger.begin_attempt(ds[2].message.operation_id, "delete", owner=other.receipt,
                               busy_s=30, supersedes_open=True)
    before = _deleted()

    def late(d: Delivery, attempt: int) -> Settlement:
        return Settlement(d.message.operation_id, OpState.DELETED, d, Disposition.ACK,
                          attempt_id=attempt, status=200, outcome="deleted",
                          batch_id="b-1", owner=d.receipt)

    refused = await settler.settle_many([late(d, a)
                                         for d, a in zip(ds[:2], attempts, strict=True)])
    assert refused == {d.message.operation_id for d in ds[:2]}
    op = await ledger.get_operation(ds[2].message.operation_id)
    assert op is not None
    await settler.settle(ds[2], op, OpState.DELETED, None, mine)
    assert (settler.settled, seen, _deleted() - before) == (0, [], 0)
    assert settler.moved == set()  # a shutdown now hands them back
    assert await stats_of(queue) == (0, 0, 3)  # none acked: each waits out its lease
    # The taker's outcomes are written and counted.
    assert await settler.settle_many([Settlement(
        d.message.operation_id, OpState.DELETED, None, Disposition.KEEP, attempt_id=a,
        status=200, outcome="deleted", batch_id="b-1", owner="taker")
        for d, a in zip(ds[:2], attempts, strict=True)]) == frozenset()
    assert (settler.settled, len(seen), _deleted() - before) == (2, 2, 2)


async def test_one_outcome_failing_leaves_the_others_counted_and_moved(
        backend: Backend) -> None:
    ledger, queue, ds, settler, seen = await _three_received(backend)
    attempts = [await ledger.begin_attempt(d.message.operation_id, "delete",
                                           owner=d.receipt, busy_s=30) for d in ds]
    # r-2 was settled meanwhile (by a probe, say): settling it again is illegal.
    await ledger.record_evidence(ds[1].message.operation_id, "probe", OpState.ALREADY_ABSENT,
                                 "absent", "probe HTTP 404", status=404)
    with pytest.raises(IllegalTransition):
        await settler.settle_many([Settlement(
            d.message.operation_id, OpState.DELETED, d, Disposition.ACK, attempt_id=a,
            status=200, outcome="deleted", owner=d.receipt)
            for d, a in zip(ds, attempts, strict=True)])
    # The two written are counted, their messages acked in their commits and marked
    # moved; the failed one's is not.
    assert (settler.settled, len(seen)) == (2, 2)
    assert settler.moved == {ds[0].receipt, ds[2].receipt}
    assert await stats_of(queue) == (0, 0, 1)
