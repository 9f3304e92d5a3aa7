"""A batch found again after its sender stopped (docs/batch.md): a delivery whose
operation's open attempt a batch carried. The batch decides for every operation it
carried, not that delivery's rule for a lone attempt: a job is left to the poller, a
batch never sent closes its attempts unsent, and one that may have been sent is sent
again whole under its key (the partner replays its answer) or, without keys, every
open item is held for a probe and never resent.

A batch is sent again by one sender at a time, across replicas: the deliveries of its
members arrive anywhere at once, and a partner may run a key's request twice while the
first is still in flight. The sender takes every open member's hold in one commit
(:meth:`~supervisor.ledger.base.BatchRecords.take_batch`) and checks it still holds
them when its token comes, as a fresh batch does; a peer's delivery of another member
finds them held and waits."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.batch.verdicts import Ruling, refused_whole
from supervisor.budget.base import Grant, RateBudget
from supervisor.config import Config
from supervisor.consumer.batch_items import AGAIN, Again, Item, Result, claims
from supervisor.consumer.decide import Action, Rules, decide
from supervisor.consumer.settler import Settler
from supervisor.ledger.base import Ledger
from supervisor.model import Batch, Delivery, Operation, Received
from supervisor.ownership import Ownership
from supervisor.partner import Answer, Verdict
from supervisor.queue.courier import Courier
from supervisor.states import OpState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Resolution:
    """A batch this process resolves, once however many of its copies arrive here: the
    work, and once it is taken to be sent again, the operations it carries (a delivery
    of one of them joins the work instead of waiting the hold out)."""

    task: asyncio.Task[None]
    taken: frozenset[str] = frozenset()


class BatchRecovery:
    """Mixed into :class:`supervisor.consumer.batches.BatchSender`, which supplies these."""

    config: Config
    ledger: Ledger
    budget: RateBudget
    courier: Courier
    settler: Settler
    rules: Rules
    owned: Ownership
    _resolving: dict[str, Resolution]

    async def _send(self, batch: Batch, items: list[Item],
                    grant_taken: Grant | None = None) -> None:
        raise NotImplementedError

    async def _settle(self, batch: Batch, rulings: Sequence[tuple[Item, Ruling]],
                      resolve: bool = True) -> None:
        raise NotImplementedError

    def _hold_s(self, k: int) -> float:
        raise NotImplementedError

    def _cost(self, k: int) -> int:
        raise NotImplementedError

    async def _lost_holding(self, members: list[Item], grant: Grant) -> set[str]:
        raise NotImplementedError

    async def recover(self, delivery: Delivery, op: Operation) -> tuple[bool, Action | None]:
        """Before anything is decided for a delivery whose operation has an open attempt
        (its process died, or this is a copy): if a batch carried that attempt, the
        batch decides. (False, None): not a batch's attempt. (True, action): handled,
        and what this delivery calls for now (None: done)."""
        batch = await self.ledger.open_batch_of(op.id)
        if batch is None:
            return False, None
        found = await self._recover(delivery, batch)
        if not isinstance(found, Again):
            return True, found
        fresh = await self.ledger.get_operation(op.id)
        return True, decide(Received(fresh, 0), self.rules, time.time())

    async def _recover(self, delivery: Delivery, batch: Batch) -> Result:
        if batch.state == "formed":
            return await self._unsent(batch)
        if batch.shape == "job" or batch.state in ("submitting", "submitted"):
            # The job poller finds it (by its reference, or by our tag): not ours.
            self.settler.moved.add(delivery.receipt)
            await self.courier.drop(delivery, "in_job")
            return None
        # Once per batch in this process, however many of its copies arrive here.
        found = self._resolving.get(batch.id)
        if found is None:
            how = self._resend if self.config.partner.idempotency_keys else self._hold
            work = asyncio.create_task(how(batch), name=f"batch-recover-{batch.id}")
            found = self._resolving[batch.id] = Resolution(work)
            work.add_done_callback(lambda _: self._resolving.pop(batch.id, None))
        await asyncio.shield(found.task)
        return AGAIN

    async def _unsent(self, batch: Batch) -> Result:
        """A batch written and never sent (its state says so): close its open attempts
        unsent, nothing done at the partner."""
        members = await self.ledger.batch_members(batch.id)
        ruling = refused_whole(batch.id, Answer(Verdict.TRANSIENT, None, ""),
                               "was never sent (the process stopped first)")
        await self._settle(batch, [(Item(await self._op(m.operation_id), None,
                                  attempt_id=m.attempt_id), ruling)
                            for m in members if m.outcome is None])
        await self.ledger.update_batch(batch.id, "closed", detail="never sent")
        return AGAIN

    async def _op(self, operation_id: str) -> Operation:
        op = await self.ledger.get_operation(operation_id)
        assert op is not None, "a batch member's operation exists"
        return op

    async def _hold(self, batch: Batch) -> None:
        members = [m for m in await self.ledger.batch_members(batch.id) if m.outcome is None]
        ops = await self.ledger.get_operations([m.operation_id for m in members])
        answer = Answer(Verdict.AMBIGUOUS, None, f"batch {batch.id} may have acted and has "
                        "no recorded outcome")
        ruling = Ruling(OpState.AMBIGUOUS, f"{answer.detail}; not resent", answer)
        await self._settle(batch, [(Item(ops[m.operation_id], None, attempt_id=m.attempt_id),
                                    ruling) for m in members if m.operation_id in ops])

    async def _resend(self, batch: Batch) -> None:
        """The batch again, whole, under its key, if this sender can take it."""
        owner = f"{batch.id}/again/{secrets.token_hex(6)}"
        hold_s = self._hold_s(batch.size)
        members = await self.ledger.take_batch(batch.id, owner, hold_s)
        if members is None:
            log.info("batch %s: not sent again here: it is closed, or another sender "
                     "holds it", batch.id, extra={"action": "batch_resend_skipped"})
            return
        # Their copies arriving here now find them held: they join this resolution.
        self._resolving[batch.id].taken = frozenset(m.operation_id for m in members)
        ops = await self.ledger.get_operations([m.operation_id for m in members])
        held_until = time.time() + hold_s
        # Every id it carried, settled ones too: a key stands for the same request.
        items = [Item(ops[m.operation_id], None, attempt_id=m.attempt_id,
                      held_until=held_until, owner=owner if m.outcome is None else None)
                 for m in members]
        # The wait for the token may be long (a pause): the holds are renewed through it,
        # and it ends early if one of them is taken meanwhile.
        async with self.owned.holding(claims(items)) as held:
            grant = await self.owned.acquire_held(held, self._cost(len(items)))
        lost = held.lost if grant is None else await self._lost_holding(items, grant)
        if lost:
            # Taken over while it waited for its token (this replica declared dead): the
            # taker decides; it is never sent twice.
            log.warning("batch %s not sent again: %d of its holds were lost before the "
                        "token came", batch.id, len(lost), extra={"action": "attempt_not_sent"})
            return
        log.info("batch %s: sent again under its key after its outcome was lost", batch.id,
                 extra={"action": "batch_resend"})
        await self._send(batch, items, grant_taken=grant)

    def resolving(self, operation_id: str) -> bool:
        """Whether this process is sending again the batch that carried the operation's
        open attempt: a delivery of it then joins that, instead of waiting its hold out."""
        return any(operation_id in r.taken for r in self._resolving.values())
