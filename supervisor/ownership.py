"""An attempt is owned from the moment it is written until it is settled.

The consumer writes an attempt once it holds a concurrency slot and no hold is in force
(:meth:`~supervisor.budget.base.RateBudget.admit`); what is left is the wait for the
token, which may still be long (a low rate, many workers ahead). Meanwhile the attempt's
in-flight guard is renewed every half slack, so it never runs out and a second delivery
of the operation finds it busy; and right before the request leaves the ledger is asked
whether the attempt is still this delivery's (open, its hold long enough for the request,
and on PostgreSQL this replica alive for as long). If it is not, the request is never
sent: whoever superseded the attempt decides the operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Sequence

from supervisor import metrics
from supervisor.budget.base import Admission, Feedback, Grant, Outcome, RateBudget
from supervisor.errors import StorageError
from supervisor.ledger.base import Ledger

log = logging.getLogger(__name__)

# An attempt's hold beyond its request's own timeouts.
BUSY_SLACK_S = 5.0


class Ownership:
    """The token wait of one worker's written attempt, and the check after it."""

    def __init__(self, ledger: Ledger, budget: RateBudget, cover_s: float,
                 slack_s: float = BUSY_SLACK_S) -> None:
        self.ledger = ledger
        self.budget = budget
        # What a request takes at most by its own timeouts: its hold must outlast that.
        self.cover_s = cover_s
        self.slack_s = slack_s
        self.busy_s = cover_s + slack_s
        # A hold is renewed every half slack: a renewal may come that late and still last.
        self.renew_s = slack_s / 2

    async def token(self, admission: Admission, owner: str, op_id: str,
                    attempt_id: int) -> tuple[Grant | None, str | None]:
        """Wait for the token under ``admission``, keeping the attempt held, then check
        it is still ``owner``'s. (grant, None): send now. (None, None): a hold began,
        nothing granted. (None, why): the attempt is no longer ``owner``'s (or this
        replica's): its request must never be sent. Cancellation takes nothing."""
        waiting = asyncio.ensure_future(self.budget.grant(admission))
        lost: str | None = None
        try:
            while True:
                done, _ = await asyncio.wait([waiting], timeout=self.renew_s)
                if done:
                    break
                if not await self._keep(op_id, attempt_id, owner):
                    lost = "its hold was lost while it waited for a token"
                    break
        except BaseException:
            await self._abandon(waiting)
            raise
        if lost is not None:
            await self._abandon(waiting)
            return self._not_sent(op_id, lost)
        grant = waiting.result()
        if grant is None:
            return None, None
        try:
            owned = await self.ledger.owns_attempt(op_id, attempt_id, owner, self.cover_s) \
                or (await self.ledger.keep_attempt(op_id, attempt_id, owner, self.busy_s)
                    and await self.ledger.owns_attempt(op_id, attempt_id, owner, self.cover_s))
        except BaseException:
            self.budget.release(grant, Feedback(Outcome.OTHER))
            raise
        if not owned:
            self.budget.release(grant, Feedback(Outcome.OTHER))
            return self._not_sent(op_id, "it was no longer this delivery's when its token came")
        return grant, None

    async def still_owned(self, claims: Sequence[tuple[str, int, str]]) -> set[str]:
        """The same check for a batch's members (operation, attempt, owner), in one read:
        the operations whose attempt is still its owner's for the request's bound. A hold
        that only ran short (the batch's token came later than foreseen) is extended
        first, where it has not run out; the others are no longer theirs."""
        owned = await self.ledger.owns_attempts(claims, self.cover_s)
        short = [c for c in claims if c[0] not in owned]
        if not short:
            return owned
        kept = await asyncio.gather(*(self.ledger.keep_attempt(op_id, attempt, owner,
                                                               self.busy_s)
                                      for op_id, attempt, owner in short))
        return owned | await self.ledger.owns_attempts(
            [c for c, k in zip(short, kept, strict=True) if k], self.cover_s)

    @contextlib.asynccontextmanager
    async def holding(self, claims: Sequence[tuple[str, int, str]]) -> AsyncIterator[Held]:
        """While the body runs (a backoff and the wait for the next token, the probes that
        read a batch's answer), each claim's hold is renewed every half slack, as a
        written attempt's is while it waits for its first token: it never runs out under
        a sender still working on it, and a hold another owner took is never taken back
        (the renewal is the owner's only). A claim found taken is given up, and the
        body's wait for a token may end there (:meth:`acquire_held`)."""
        held = Held()

        async def renew() -> None:
            # At once first: the check before sending left a hold as short as a request's
            # bound, and the request may have used all of it.
            mine = list(claims)
            while mine:
                try:
                    kept = await asyncio.gather(*(self._keep(op_id, attempt, owner)
                                                  for op_id, attempt, owner in mine))
                except Exception:
                    # Not the storage trouble _keep rides out: a fault of this process.
                    # Renewing stops, and the check before sending decides; raised from
                    # the exit below it would drop whatever the body holds (a token).
                    log.exception("renewing the holds of %d attempts failed; renewal stops",
                                  len(mine), extra={"action": "holds_renewal_failed"})
                    return
                held.give_up(c[0] for c, k in zip(mine, kept, strict=True) if not k)
                mine = [c for c, k in zip(mine, kept, strict=True) if k]
                await asyncio.sleep(self.renew_s)

        task = asyncio.create_task(renew(), name="holds-renewed") if claims else None
        try:
            yield held
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def acquire_held(self, held: Held, cost: int,
                           after_s: float = 0.0) -> Grant | None:
        """A token for ``cost`` after ``after_s`` of backoff, or None as soon as one of
        ``held``'s claims is lost: a batch that can no longer go does not sit out a
        pause (up to the budget's longest) for a token it would hand back. A renewal
        refused because this replica's heartbeat is late counts as lost, as in
        :meth:`token`: a peer may be declaring it dead. Cancellation takes nothing."""
        async def backoff_then_token() -> Grant | None:
            await asyncio.sleep(after_s)
            return await self.budget.acquire(cost)

        waiting = asyncio.ensure_future(backoff_then_token())
        lost = asyncio.ensure_future(held.any_lost.wait())
        try:
            await asyncio.wait([waiting, lost], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await self._abandon(waiting)
            raise
        finally:
            lost.cancel()
        if waiting.done() and not held.lost:
            return waiting.result()
        # Lost, the token perhaps come in the same instant: it goes back unused.
        await self._abandon(waiting)
        metrics.ATTEMPTS_NOT_SENT.inc(len(held.lost))  # the caller says which and why
        return None

    @staticmethod
    def _not_sent(op_id: str, why: str) -> tuple[None, str]:
        metrics.ATTEMPTS_NOT_SENT.inc()
        log.warning("operation %s: attempt not sent: %s", op_id, why,
                    extra={"operation_id": op_id, "action": "attempt_not_sent"})
        return None, why

    async def _keep(self, op_id: str, attempt_id: int, owner: str) -> bool:
        try:
            return await self.ledger.keep_attempt(op_id, attempt_id, owner, self.busy_s)
        except StorageError:
            return True  # cannot tell now: the check before sending decides

    async def _abandon(self, waiting: asyncio.Future[Grant | None]) -> None:
        """Stop waiting for a token; one granted meanwhile is handed back unused.

        The hand-back is the wait's own done-callback, not a step after this await: a
        second cancellation (a shutdown's on top of a worker's) may end the await, and
        a token dropped there would keep its concurrency slot for the process's life."""
        waiting.add_done_callback(self._hand_back)
        waiting.cancel()
        await asyncio.wait([waiting])

    def _hand_back(self, waiting: asyncio.Future[Grant | None]) -> None:
        if not waiting.cancelled() and waiting.exception() is None:
            grant = waiting.result()
            if grant is not None:
                self.budget.release(grant, Feedback(Outcome.OTHER))


class Held:
    """What :meth:`Ownership.holding` found of its claims: the operations another owner
    has taken meanwhile, whose requests must never be sent by this one."""

    def __init__(self) -> None:
        self.lost: set[str] = set()
        self.any_lost = asyncio.Event()

    def give_up(self, operation_ids: Iterable[str]) -> None:
        self.lost.update(operation_ids)
        if self.lost:
            self.any_lost.set()
