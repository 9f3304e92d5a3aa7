"""One attempt at the partner under the rate budget: wait out a hold (within the lease),
take a concurrency slot, write the attempt, wait for its token while holding it
(:mod:`supervisor.ownership`), send, and settle what the answer makes of the operation
(:mod:`supervisor.outcomes`). A 429 or a token that never came is not an attempt: the
loop goes round again."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from supervisor import metrics
from supervisor.budget.base import Grant, RateBudget
from supervisor.config import Config
from supervisor.consumer.decide import ATTEMPT_OPEN, SETTLED_MEANWHILE, Action, Rules, busy
from supervisor.consumer.settler import Settler
from supervisor.errors import AttemptOpen, IllegalTransition, OperationBusy
from supervisor.ledger.base import Ledger
from supervisor.model import Delivery, Disposition, Operation
from supervisor.outcomes import decide as outcome_of
from supervisor.outcomes import feedback
from supervisor.ownership import Ownership
from supervisor.partner import Answer, PartnerClient, Verdict
from supervisor.queue.courier import Courier
from supervisor.states import SETTLED, OpState

log = logging.getLogger(__name__)

# An attempt that lost its hold before it was sent is tried again this much later.
LOST_RETRY_S = 1.0

_NOT_SENT = Answer(Verdict.TRANSIENT, None, "not sent: shutdown before the request left")


class Phase(enum.Enum):
    IDLE = "idle"  # waiting for a message
    WAITING = "waiting"  # holding a message, waiting for the limiter: nothing sent yet
    SENDING = "sending"  # a request may be in the air: let it finish within the grace


Phases = dict[asyncio.Task[None], Phase]


@dataclass(frozen=True, slots=True)
class _Opened:
    """An attempt written: its token (None: not sent), and why it is no longer ours."""

    attempt_id: int
    grant: Grant | None
    lost: str | None


class Executor:
    def __init__(self, config: Config, ledger: Ledger, budget: RateBudget,
                 partner: PartnerClient, courier: Courier, settler: Settler,
                 owned: Ownership, rules: Rules, phases: Phases, stopping: asyncio.Event,
                 held_since: Callable[[Delivery], float | None]) -> None:
        self.config = config
        self.ledger = ledger
        self.budget = budget
        self.partner = partner
        self.courier = courier
        self.settler = settler
        self.owned = owned
        self.rules = rules
        self._phases = phases
        self._stopping = stopping
        self._held_since = held_since

    async def attempt(self, task: asyncio.Task[None], delivery: Delivery,
                      op: Operation) -> Action | None:
        """Attempt ``op`` until an answer settles it (None), or return what to do with
        the delivery instead when the ledger will not have the attempt written."""
        while True:
            if self._stopping.is_set():
                # Throttled and told to stop: nothing is in the air, hand the message back.
                await asyncio.shield(self.courier.hand_back(delivery))
                return None
            self._phases[task] = Phase.WAITING
            # A pause or a spent quota, and then a concurrency slot, are waited out before
            # the attempt is written: no attempt is open while its worker waits for them.
            if not await self._ready_within_lease(delivery):
                # The message would become visible again while we wait: publish it again
                # for when the hold ends, and let this worker go.
                await self.settler.defer(delivery, self.budget.snapshot().held_for(time.time()))
                return None
            opened = await self._open(task, delivery, op)
            if not isinstance(opened, _Opened):
                return opened
            if opened.grant is None:
                if await self._not_sent(delivery, op, opened):
                    continue
                return None
            # From here on a request is in the air: a shutdown lets it finish within the
            # grace instead of leaving an open attempt.
            self._phases[task] = Phase.SENDING
            answer = await self.partner.delete(op.recipient_id, op.id)
            self.budget.release(opened.grant, feedback(answer))
            _record_answer(answer)
            if answer.verdict is Verdict.THROTTLED:
                # Not a failed attempt: everyone is paused, the message kept, tried again.
                await self.settler.settle(delivery, op, OpState.RETRY_WAIT, None,
                                          opened.attempt_id, answer,
                                          disposition=Disposition.KEEP, refund=True)
                continue
            # Every attempt not sent or throttled was refunded: this is the next one.
            await self._conclude(delivery, op, opened.attempt_id, answer, op.attempts + 1)
            return None

    async def _open(self, task: asyncio.Task[None], delivery: Delivery,
                    op: Operation) -> _Opened | Action | None:
        """Take a slot, write the attempt, wait for its token. An Action when the ledger
        refuses the attempt."""
        admission = await self.budget.admit()
        try:
            # Writing the attempt is not cut short by a shutdown (it may commit all the
            # same); the wait for the token after it is, and closes it unsent.
            self._phases[task] = Phase.SENDING
            begun = await self._begin(delivery, op)
            if not isinstance(begun, int):
                return begun
            self._phases[task] = Phase.WAITING
            try:
                grant, lost = await self.owned.token(admission, delivery.receipt, op.id, begun)
            except asyncio.CancelledError:
                # Shutdown before the request left: the attempt was written, never sent.
                # The worker hands the message back as it unwinds.
                await self.settler.settle(delivery, op, OpState.RETRY_WAIT, None, begun,
                                          _NOT_SENT, disposition=Disposition.KEEP,
                                          refund=True)
                raise
        finally:
            self.budget.withdraw(admission)  # nothing once the token wait spent it
        return _Opened(begun, grant, lost)

    async def _begin(self, delivery: Delivery, op: Operation) -> int | Action:
        """The attempt's ID, or what to do instead when the ledger refuses it."""
        try:
            # With keys, superseding whatever is open: an attempt whose hold ran out is
            # no one's, and a resend carries its key. Without, the ledger refuses if
            # another delivery began one while this one waited.
            return await self.ledger.begin_attempt(
                op.id, "delete", owner=delivery.receipt, busy_s=self.owned.busy_s,
                supersedes_open=self.config.partner.idempotency_keys)
        except OperationBusy as exc:
            # A second delivery of an operation another worker has in the air.
            return busy(self.rules, exc.until - time.time())
        except AttemptOpen:
            return ATTEMPT_OPEN
        except IllegalTransition:
            current = await self.ledger.get_operation(op.id)
            if current is None or current.state not in SETTLED:
                raise
            return SETTLED_MEANWHILE

    async def _not_sent(self, delivery: Delivery, op: Operation, opened: _Opened) -> bool:
        """Close an attempt whose request never left; True: try again now. A hold that
        began after it was written is waited out without one; an attempt no longer this
        delivery's (its hold lost, superseded) is left to whoever holds it (the ledger
        discards this outcome then) or tried again shortly."""
        lost = opened.lost
        why = lost or "a hold began before the request left"
        await self.settler.settle(delivery, op, OpState.RETRY_WAIT, None, opened.attempt_id,
                                  Answer(Verdict.TRANSIENT, None, f"not sent: {why}"),
                                  disposition=Disposition.RETRY if lost else Disposition.KEEP,
                                  delay_s=LOST_RETRY_S if lost else 0.0, refund=True)
        return lost is None

    async def _ready_within_lease(self, delivery: Delivery) -> bool:
        """Wait while the budget holds every worker (a pause, a spent quota). Without
        extend, only as long as the message's visibility timeout allows: False when the
        hold outlasts it (the message must then be published again for when it ends)."""
        if self.courier.capabilities.extend:
            await self.budget.ready()
            return True
        if self.budget.snapshot().held_for(time.time()) <= 0:
            return True  # nothing holds: no wait, whatever is left of the lease
        since = self._held_since(delivery)
        lease_s = self.config.queue.lease_seconds
        # Margin: the wait for a token and the request itself come after the hold.
        margin = min(lease_s / 3, self.owned.busy_s)
        left = (lease_s - (time.monotonic() - since) if since is not None else 0.0) - margin
        if left <= 0:
            return False
        try:
            async with asyncio.timeout(max(0.0, left)):
                await self.budget.ready()
        except TimeoutError:
            return False
        return True

    async def _conclude(self, delivery: Delivery, op: Operation, attempt_id: int,
                        answer: Answer, attempts: int) -> None:
        if answer.verdict is Verdict.TERMINAL and answer.status == 422:
            log.error("partner rejected Idempotency-Key %s as reused with another request",
                      op.id, extra={"action": "idempotency_key_conflict"})
        d = outcome_of(self.config.partner, answer, attempts)
        await self.settler.settle(delivery, op, d.target, d.reason, attempt_id, answer,
                                  disposition=d.disposition, delay_s=d.delay_s)


def _record_answer(answer: Answer) -> None:
    metrics.PARTNER_RESPONSES.labels(str(answer.status) if answer.status else "error").inc()
    metrics.PARTNER_DURATION.observe(answer.elapsed_s)
