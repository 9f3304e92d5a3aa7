"""Moves ambiguous operations forward on evidence, never on hope.

An operation is ambiguous when a request may have acted but no answer says so. The
reconciler waits ``probe_settle_seconds`` (a slow partner may still be acting), then asks
the partner whether the recipient exists: absent is evidence of deletion; present is
evidence the attempt did not take effect, so the operation is queued again. An
inconclusive probe is recorded too, and the operation waits for a later probe, put off
longer after each inconclusive one (capped: a probe spends partner budget and writes an
attempt row), or for an operator (:meth:`resolve`);
``cleanup_reconcile_inconclusive_operations`` counts those waiting so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from supervisor import metrics
from supervisor.budget.base import RateBudget
from supervisor.config import PartnerConfig
from supervisor.ledger.base import Ledger
from supervisor.model import Message, Operation
from supervisor.partner import PartnerClient, Presence, paced_probe
from supervisor.queue.base import Queue
from supervisor.queue.courier import Courier
from supervisor.states import OpState

log = logging.getLogger(__name__)

BATCH = 100

# What an operator may decide for an ambiguous operation.
RESOLUTIONS: dict[str, OpState] = {
    "deleted": OpState.DELETED,
    "already_absent": OpState.ALREADY_ABSENT,
    "failed": OpState.FAILED,
    "retry": OpState.QUEUED,
}


def next_probe_in(op: Operation, first_s: float, max_s: float) -> float:
    """How long an inconclusive probe puts the next one off: ``first_s`` after the first,
    then twice the last wait, up to ``max_s``. The last wait is the operation's own
    record (its due time past the last probe, which set both), so it survives restarts
    and moves with the reconcile role between replicas."""
    last = (op.due_at or 0.0) - op.updated_at
    return first_s if last <= 0 else min(max_s, max(first_s, 2 * last))


class Reconciler:
    def __init__(self, config: PartnerConfig, ledger: Ledger, queue: Queue,
                 budget: RateBudget, partner: PartnerClient) -> None:
        self.config = config
        self.ledger = ledger
        self.courier = Courier(ledger, queue)
        self.budget = budget
        self.partner = partner
        self.wakeup = asyncio.Event()

    async def run(self) -> None:
        """Probe due ambiguous operations every ``probe_interval_seconds``; never returns."""
        while True:
            due = await self.ledger.ambiguous_due(time.time() - self.config.probe_settle_seconds,
                                                  BATCH)
            for op in due:
                await self.probe(op)
            if len(due) < BATCH:
                self.wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.probe_interval_seconds):
                        await self.wakeup.wait()

    async def probe(self, op: Operation) -> Presence:
        presence, detail = await paced_probe(self.budget, self.partner, op.recipient_id)
        if presence is Presence.ABSENT:
            await self.ledger.record_evidence(
                op.id, "probe", OpState.DELETED,
                "evidence: probe found the recipient gone after an ambiguous attempt", detail)
            metrics.count_settled(OpState.DELETED.value)
        elif presence is Presence.PRESENT:
            await self._requeue(op, "probe", "evidence: probe found the recipient present; "
                                "the ambiguous attempt did not take effect", detail)
        else:
            wait = next_probe_in(op, self.config.probe_settle_seconds,
                                 self.config.probe_backoff_max_seconds)
            await self.ledger.record_evidence(op.id, "probe", OpState.AMBIGUOUS, op.reason or
                                              "ambiguous", f"inconclusive: {detail}; next "
                                              f"probe in {wait:g} s", probe_after_s=wait)
        log.info("probe of %s: %s (%s)", op.id, presence.value, detail,
                 extra={"operation_id": op.id, "run_id": op.run_id, "action": "probe"})
        return presence

    async def resolve(self, op: Operation, decision: str, by: str, why: str) -> OpState:
        """An operator's decision for an ambiguous operation, recorded with who and why.

        Raises KeyError for an unknown decision and IllegalTransition when the operation
        is not ambiguous.
        """
        target = RESOLUTIONS[decision]
        detail = f"operator {by}: {why}"
        reason = f"resolved by operator {by}: {why}"
        if target is OpState.QUEUED:
            await self._requeue(op, "operator", reason, detail)
        else:
            await self.ledger.record_evidence(op.id, "operator", target, reason, detail)
            metrics.count_settled(target.value)
        log.info("operation %s resolved as %s by %s", op.id, decision, by,
                 extra={"operation_id": op.id, "run_id": op.run_id, "action": "resolve"})
        return target

    async def _requeue(self, op: Operation, kind: str, reason: str, detail: str) -> None:
        must_publish = await self.ledger.record_evidence(op.id, kind, OpState.QUEUED, reason,
                                                         detail)
        if must_publish:
            # A crash right here leaves a queued operation without a message: the
            # redriver finds and publishes it.
            await self.courier.publish([Message(op.run_id, op.id, op.recipient_id)])
