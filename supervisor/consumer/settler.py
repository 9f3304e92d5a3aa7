"""Writing an outcome, then moving its message: the ledger's settlement and what the
transport still needs after it (:class:`~supervisor.queue.courier.Courier`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from supervisor import metrics
from supervisor.ledger.base import Ledger
from supervisor.model import Delivery, Disposition, Operation, Settled, Settlement
from supervisor.partner import Answer
from supervisor.queue.courier import Courier
from supervisor.states import SETTLED, OpState

log = logging.getLogger(__name__)


class Settler:
    def __init__(self, ledger: Ledger, courier: Courier, on_settled: Callable[[], None]) -> None:
        self.ledger = ledger
        self.courier = courier
        self._on_settled = on_settled
        self.settled = 0
        # Deliveries whose message was acked or published again: nothing to hand back.
        self.moved: set[str] = set()

    async def settle(self, delivery: Delivery, op: Operation, target: OpState,
                     reason: str | None, attempt_id: int | None = None,
                     answer: Answer | None = None, *,
                     disposition: Disposition = Disposition.ACK, delay_s: float = 0.0,
                     refund: bool = False) -> None:
        """One delivery's outcome (supervisor/consumer/executor.py), as :meth:`settle_many`.
        It names no owner: a lone attempt is closed, never carried on, when another
        delivery takes its operation, and that is what refuses a late outcome."""
        refused = await self.settle_many([Settlement(
            operation_id=op.id, target=target, delivery=delivery, disposition=disposition,
            delay_s=delay_s, reason=reason, attempt_id=attempt_id,
            status=answer.status if answer else None,
            outcome=answer.verdict.value if answer else None,
            detail=answer.detail if answer else None, refund_attempt=refund)])
        if not refused and log.isEnabledFor(logging.DEBUG):
            log.debug("operation %s -> %s (%s)", op.id, target.value,
                      answer.detail if answer else reason,
                      extra={"operation_id": op.id, "run_id": op.run_id, "action": "settle"})

    async def settle_many(self, settlements: Sequence[Settlement]) -> frozenset[str]:
        """Outcomes, each its own settlement, then what their messages still need.

        One refused (another attempt or owner decides it) or failed must not undo the
        others' outcomes, which would be resent, nor leave them uncounted and their
        messages unmoved; SQLite joins them in one group commit all the same. A refused
        one is not counted and its message not moved: it is left to its lease. Returns
        the operations whose outcome was refused; raises the first failure, after the
        rest are followed up.

        No commit is torn by a shutdown cancelling the caller: they run in a task of their
        own, awaited to the end either way. What the transport still needs after them may
        be cut short (a lost ack is redelivered and acked on sight).
        """
        commit = asyncio.ensure_future(asyncio.gather(
            *(self.ledger.settle([s]) for s in settlements), return_exceptions=True))
        try:
            results: list[Settled | BaseException] = await asyncio.shield(commit)
        except asyncio.CancelledError:
            await asyncio.wait([commit])
            for s, r in zip(settlements, commit.result(), strict=True):
                refused = isinstance(r, Settled) and s.operation_id in r.refused
                if s.delivery is not None and s.disposition is Disposition.ACK \
                        and not refused:
                    # Settled (or the commit failed: nothing written), its ack not sent:
                    # it comes back and is acked on sight, or decided again; a copy
                    # handed back now would only be one more.
                    self.moved.add(s.delivery.receipt)
            raise
        done = [r for r in results if isinstance(r, Settled)]
        written = [s for s, r in zip(settlements, results, strict=True)
                   if isinstance(r, Settled) and s.operation_id not in r.refused]
        for s in written:
            if s.delivery is not None and s.disposition is not Disposition.KEEP:
                self.moved.add(s.delivery.receipt)
        await self.courier.follow_up([s for r in done for s in r.leftovers])
        for s in written:
            if s.target in SETTLED:
                metrics.count_settled(s.target.value)
                self.settled += 1
                self._on_settled()
        failed = [r for r in results if isinstance(r, BaseException)]
        for exc in failed[1:]:  # the first is raised, and reported by the caller
            log.warning("an outcome was not written: %s", exc)
        if failed:
            raise failed[0]
        return frozenset().union(*(r.refused for r in done))

    async def defer(self, delivery: Delivery, delay_s: float) -> None:
        """Publish the message again for ``delay_s`` from now and ack this copy; a
        shutdown does not cut it short, and nothing is handed back after it."""
        self.moved.add(delivery.receipt)
        move = asyncio.ensure_future(self.courier.defer(delivery, delay_s))
        try:
            await asyncio.shield(move)
        except asyncio.CancelledError:
            await asyncio.wait([move])
            raise

    async def hand_back(self, delivery: Delivery) -> None:
        """Shutdown: the message back to the transport now, not when its lease runs out,
        unless it was acked or published again already."""
        if delivery.receipt not in self.moved:
            await asyncio.shield(self.courier.hand_back(delivery))

