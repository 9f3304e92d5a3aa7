"""The consumer's batch path (docs/batch.md): each worker's operation joins a batch
(:class:`~supervisor.batch.chunker.Chunker`); a batch takes its budget (one token, or
one per id under a per-item cost), writes every attempt and the batch row, is sent, and
each operation settles on its own item's verdict in one commit
(:mod:`supervisor.batch.verdicts`). A job submitted is left to the job poller
(:mod:`supervisor.batch.jobs`) and its messages acked.

Crash safety is the single path's, per item: every attempt is written before the
request leaves and names its batch. A delivery whose operation's open attempt belongs
to a batch that may have been sent finds that batch again
(:mod:`supervisor.consumer.batch_recovery`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from supervisor import metrics
from supervisor.batch.chunker import Chunker
from supervisor.batch.client import BatchAnswer, BatchClient
from supervisor.batch.verdicts import (
    Ruling,
    lost_hold,
    refused_whole,
    rule,
    rule_probe,
    rule_result,
)
from supervisor.batchsettings import BatchConfig
from supervisor.budget.base import Admission, Feedback, Grant, Outcome, RateBudget
from supervisor.budget.pair import TwoLimits
from supervisor.config import Config
from supervisor.consumer.batch_items import AGAIN, Again, Item, claims
from supervisor.consumer.batch_recovery import BatchRecovery, Resolution
from supervisor.consumer.decide import Action, Do, Rules, busy
from supervisor.consumer.executor import LOST_RETRY_S, Phase, Phases
from supervisor.consumer.settler import Settler
from supervisor.errors import AttemptOpen, IllegalTransition, OperationBusy
from supervisor.ledger.base import Ledger
from supervisor.ledger.ids import new_batch_id
from supervisor.model import Batch, Delivery, Disposition, Operation, Settlement
from supervisor.outcomes import backoff, feedback
from supervisor.ownership import Ownership
from supervisor.partner import Answer, PartnerClient, Verdict, paced_probe
from supervisor.queue.courier import Courier
from supervisor.states import SETTLED, OpState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sent:
    batch: Batch
    items: list[Item]
    answer: BatchAnswer
    # A whole batch's 429: whether the limit that refused it counts ids.
    ids_refused: bool = False


class BatchSender(BatchRecovery):
    def __init__(self, config: Config, ledger: Ledger, budget: RateBudget,
                 partner: PartnerClient, courier: Courier, settler: Settler, rules: Rules,
                 phases: Phases, owned: Ownership) -> None:
        self.config = config
        self.batch: BatchConfig = config.batch
        self.ledger = ledger
        self.budget = budget
        self.client = BatchClient(partner, config.batch)
        self.partner = partner
        self.courier = courier
        self.settler = settler
        self.rules = rules
        self._phases = phases
        self.owned = owned
        self._busy_s = owned.busy_s
        self.chunker: Chunker[Item] = Chunker(config.batch, self._launch,
                                              lambda it: it.op.recipient_id,
                                              linger=config.batch.shape != "job")
        # Batches waiting for a job slot: while one waits, nothing more is formed.
        self._job_waiters = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._resolving: dict[str, Resolution] = {}
        # Woken when a job is submitted, so the poller reads it without waiting a round.
        self.job_submitted = asyncio.Event()
        # Set by the poller when a job closes: a batch waiting for a job slot looks again.
        self.job_closed = asyncio.Event()
        self._job_lock = asyncio.Lock()

    # -- the worker's side -------------------------------------------------------------

    async def attempt(self, task: asyncio.Task[None], delivery: Delivery,
                      op: Operation) -> Action | None:
        """Work one delivery through a batch; an Action when something else is called for
        (the pool performs it), None when its outcome is written and its message moved."""
        while True:
            self._phases[task] = Phase.WAITING
            await self.budget.ready()
            item = Item(op, delivery, task, asyncio.get_running_loop().create_future())
            self.chunker.add(item)
            assert item.done is not None
            result = await item.done
            if not isinstance(result, Again):
                return result
            fresh = await self.ledger.get_operation(op.id)
            if fresh is None or fresh.state in SETTLED:
                return Action(Do.DROP, reason="settled")
            op = fresh

    # -- forming and sending -----------------------------------------------------------

    def _launch(self, items: list[Item]) -> None:
        task = asyncio.create_task(self._form(items), name="batch")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _form(self, items: list[Item]) -> None:
        try:
            items = [it for it in items if it.done is None or not it.done.done()]
            if items:
                await self._form_and_send(items)
        except BaseException as exc:
            if isinstance(exc, Exception):
                log.warning("a batch of %d could not be completed: %r; its items go back "
                            "to their workers", len(items), exc)
            for it in items:
                if it.done is not None and not it.done.done():
                    if isinstance(exc, asyncio.CancelledError):
                        it.done.cancel()
                    else:
                        it.done.set_exception(exc)
            if not isinstance(exc, Exception):
                raise

    async def _form_and_send(self, items: list[Item]) -> None:
        """Write the attempts and the batch, then wait for the token and send at once:
        nothing is written between the token and the request, so the requests leave
        at the pace the budget grants them (a write's delay there bunched two batches
        into one of the partner's bursts)."""
        if self.batch.shape == "job":
            # One batch at a time waits for a job slot, its token, and reserves the slot
            # right before it leaves: batches formed together would otherwise all see a
            # free slot and all but one be refused; and a slot reserved long before its
            # request left would be looked up by the poller as a submission in doubt.
            # The job slot before the budget's: the poller needs one to see a job end.
            self._job_waiters += 1
            try:
                async with self._job_lock:
                    await self._job_slot()
                    granted = await self._granted(items)
                    if granted is None:
                        return
                    batch, members, grant = granted
                    if not await self.ledger.reserve_job(batch.id,
                                                         self.batch.max_jobs_in_flight):
                        self.budget.release(grant, Feedback(Outcome.OTHER))
                        await self._settle(batch, [(it, refused_whole(batch.id, Answer(
                            Verdict.TRANSIENT, None, ""), "found the partner's job limit "
                            "reached")) for it in members])
                        return
            finally:
                self._job_waiters -= 1
        else:
            granted = await self._granted(items)
            if granted is None:
                return
            batch, members, grant = granted
        for it in members:
            if it.task is not None:
                self._phases[it.task] = Phase.SENDING
        await self._send(batch, members, grant_taken=grant)

    async def _granted(self, items: list[Item]) -> tuple[Batch, list[Item], Grant] | None:
        """A concurrency slot, the attempts and the batch row, then the token: the batch,
        what it carries and its grant; None when nothing is to be sent."""
        admission = await self.budget.admit()
        try:
            opened = await self._guarded_open(admission, items)
            if opened is None:
                return None
            batch, members = opened
            grant = await self.budget.grant(admission, self._cost(len(members)))
        finally:
            self.budget.withdraw(admission)  # nothing once grant has spent it
        if grant is None:
            # A hold began before the token came: nothing left, the attempts close
            # unsent and everyone waits the hold out.
            await self._settle(batch, [(it, refused_whole(batch.id, Answer(
                Verdict.TRANSIENT, None, ""), "was not sent: a hold began first"))
                for it in members])
            return None
        lost = await self._lost_holding(members, grant)
        if lost:
            # Never a subset under the batch's ID: a resend under its key must carry the
            # same ids. The others go in the next batch, with attempts of their own.
            log.warning("batch %s not sent: %d of its %d ids' holds were lost before the "
                        "token came", batch.id, len(lost), len(members),
                        extra={"action": "attempt_not_sent"})
            await self._settle(batch, [(it, lost_hold(batch.id, LOST_RETRY_S)) if it.op.id in lost
                                       else (it, refused_whole(batch.id, Answer(
                                           Verdict.TRANSIENT, None, ""), "was not sent: another "
                                           "member's hold was lost")) for it in members])
            await self.ledger.update_batch(batch.id, "closed",
                                           detail="never sent: a member's hold was lost")
            return None
        return batch, members, grant

    async def _lost_holding(self, members: list[Item], grant: Grant) -> set[str]:
        """:meth:`_lost` with a token in hand: handed back unused if any hold was lost
        (or the check failed), and the attempts lost counted as never sent."""
        try:
            lost = await self._lost(members)
        except BaseException:
            self.budget.release(grant, Feedback(Outcome.OTHER))
            raise
        if lost:
            self.budget.release(grant, Feedback(Outcome.OTHER))
            metrics.ATTEMPTS_NOT_SENT.inc(len(lost))
        return lost

    async def _lost(self, members: list[Item]) -> set[str]:
        """The check right before the request leaves (supervisor/ownership.py): the
        members whose attempt is no longer their delivery's (or their sender's)."""
        held = claims(members)
        if not self.ledger.peers_may_take_over and all(
                it.held_until > time.time() + self.owned.cover_s for it in members):
            return set()  # one process: no hold with time left can have been lost
        return {c[0] for c in held} - await self.owned.still_owned(held)

    async def _guarded_open(self, admission: Admission,
                            items: list[Item]) -> tuple[Batch, list[Item]] | None:
        """:meth:`_open`, giving the admission's slot back if it raises."""
        try:
            return await self._open(items)
        except BaseException:
            self.budget.withdraw(admission)
            raise

    async def _open(self, items: list[Item]) -> tuple[Batch, list[Item]] | None:
        """Every item's attempt and the batch row: the batch, and the items it carries
        (the others are told what to do instead). None: nothing to send."""
        begun = await self._begin_all(items)
        members = [it for it, b in zip(items, begun, strict=True) if b is None]
        for it, b in zip(items, begun, strict=True):
            if b is not None:
                it.resolve(b)
        if not members:
            return None
        # Per-item and accepted batches are "sent" from here: a crash before the
        # request leaves is recovered as if it had (sent again under its key; held
        # for a probe without keys). A job's is "formed" until its slot is reserved:
        # a job formed and never submitted is known not to have been.
        state = "formed" if self.batch.shape == "job" else "sent"
        batch = Batch(new_batch_id(), self.batch.shape, len(members), state, time.time())
        await self.ledger.record_batch(batch, [(it.attempt_id or 0, pos)
                                               for pos, it in enumerate(members)])
        return batch, members

    async def _job_slot(self) -> None:
        """Wait while the partner's jobs in flight are at the cap (shared by replicas:
        the reservation after the batch is written is the decision; this only spares
        writing batches that would be refused)."""
        while len(await self.ledger.open_jobs()) >= self.batch.max_jobs_in_flight:
            self.job_closed.clear()
            # Another replica's job may close unseen: read again at the longest poll.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.batch.poll_max_seconds):
                    await self.job_closed.wait()

    async def _begin_all(self, items: list[Item]) -> list[Action | None]:
        """Write every item's attempt: one write under keys; without, one each (a
        refusal for an open attempt must be told from another worker's hold)."""
        if not self.config.partner.idempotency_keys:
            return list(await asyncio.gather(*(self._begin(it) for it in items)))
        starts = []
        for it in items:
            assert it.delivery is not None
            starts.append((it.op.id, it.delivery.receipt))
        hold_s = self._hold_s(len(items))
        for it in items:
            it.held_until = time.time() + hold_s
        found = await self.ledger.begin_attempts(starts, "delete", hold_s)
        out: list[Action | None] = []
        for it, got in zip(items, found, strict=True):
            if isinstance(got, int):
                it.attempt_id = got
                out.append(None)
            elif isinstance(got, OperationBusy):
                out.append(busy(self.rules, got.until - time.time()))
            elif isinstance(got, IllegalTransition):
                out.append(Action(Do.DROP, reason="settled", duplicate=True))
            else:
                raise got
        return out

    def _hold_s(self, k: int) -> float:
        """How long a batch's attempts hold their operations: its request's own bound
        (and slack), plus the wait for its tokens behind every other batch in the air
        (a per-item cost takes k tokens each), so that no other delivery takes an
        operation over while its batch waits to leave."""
        rate = max(self.budget.snapshot().rate, self.config.limits.floor_per_second)
        # The requests' budget: k tokens where it counts ids, else one (also under two
        # limits, whose ids' budget is waited on beside it).
        per_batch = (k if self.batch.cost == "items" else 1) / rate
        if isinstance(self.budget, TwoLimits):
            per_batch = max(per_batch, k / max(self.budget.items.snapshot().rate, 1e-3))
        return self._busy_s + self.config.limits.concurrency * per_batch

    def _cost(self, k: int) -> int:
        """What a batch of ``k`` asks of the budget: one token where the limit counts
        requests; k where it counts ids (under "both", one request and k ids)."""
        return 1 if self.batch.cost == "requests" else k

    async def _begin(self, it: Item) -> Action | None:
        assert it.delivery is not None
        try:
            hold_s = self._hold_s(1)
            it.held_until = time.time() + hold_s
            it.attempt_id = await self.ledger.begin_attempt(
                it.op.id, "delete", owner=it.delivery.receipt, busy_s=hold_s,
                supersedes_open=self.config.partner.idempotency_keys)
            return None
        except OperationBusy as exc:
            return busy(self.rules, exc.until - time.time())
        except AttemptOpen:
            return Action(Do.SETTLE, OpState.AMBIGUOUS,
                          "an earlier attempt has no recorded outcome; not resent")
        except IllegalTransition:
            return Action(Do.DROP, reason="settled", duplicate=True)

    async def _send(self, batch: Batch, items: list[Item],
                    grant_taken: Grant | None = None) -> None:
        ids = [it.op.recipient_id for it in items]
        cost = self._cost(len(items))
        tries = 0
        answer: BatchAnswer | None = None
        while True:
            grant = grant_taken if grant_taken is not None else await self.budget.acquire(cost)
            grant_taken = None
            if tries and await self._taken_over(batch, items, grant, answer):
                return
            answer = await self.client.send(ids, batch.id)
            tries += 1
            whole = answer.whole
            # An item throttled on its own (Graph's inner 429) implicates the limit that
            # counts items: the budget's only when it counts items. Under a per-request
            # cost the request was within its limit; the item is just sent again.
            throttled_items = self.batch.cost != "requests" and answer.items is not None \
                and any(s == 429 for s in answer.items.values())
            fb = feedback(whole)
            if throttled_items and fb.outcome is Outcome.OK:
                fb = Feedback(Outcome.THROTTLED, whole.elapsed_s, whole.retry_after_s,
                              whole.policies, scope="items")
            # Which limit refused a whole batch: K shrinks only for the ids'.
            ids_refused = whole.status == 429 and (self.batch.cost == "items" or (
                isinstance(self.budget, TwoLimits)
                and self.budget.implicated(cost) in ("items", "both")))
            self.budget.release(grant, fb)
            metrics.BATCH_REQUESTS.labels(self.batch.shape, _label(whole)).inc()
            metrics.PARTNER_RESPONSES.labels(str(whole.status) if whole.status
                                             else "error").inc()
            metrics.PARTNER_DURATION.observe(whole.elapsed_s)
            if whole.verdict is Verdict.AMBIGUOUS and self.config.partner.idempotency_keys \
                    and tries < self.config.partner.max_attempts and self.batch.shape != "job":
                # It may have acted: the same batch again under the same key, never a
                # new batch (a new key could not be deduplicated). Its holds are renewed
                # through the backoff and the wait for the next token (a pause may
                # outlast any hold), so that no one takes it over meanwhile; one taken
                # all the same (this replica declared dead) ends the wait.
                async with self.owned.holding(claims(items)) as held:
                    grant_taken = await self.owned.acquire_held(
                        held, cost, backoff(self.config.partner, tries))
                if grant_taken is None:
                    await self._left_to_takers(batch, items, held.lost, answer)
                    return
                continue
            await self._conclude(_Sent(batch, items, answer, ids_refused))
            return

    async def _taken_over(self, batch: Batch, items: list[Item], grant: Grant,
                          answer: BatchAnswer | None) -> bool:
        """Before a batch whose answer was lost goes again: True when a member's hold was
        lost meanwhile (a long run of timeouts outlasts a hold; a peer found the batch
        and took it), and then nothing is sent."""
        lost = await self._lost_holding(items, grant)
        if not lost:
            return False
        assert answer is not None, "a batch goes again only after an answer"
        await self._left_to_takers(batch, items, lost, answer)
        return True

    async def _left_to_takers(self, batch: Batch, items: list[Item], lost: set[str],
                              answer: BatchAnswer) -> None:
        """The members still held settle on the last answer; the others are their
        taker's, whose attempt this is now."""
        log.warning("batch %s not sent again: %d of its %d holds were lost while it waited "
                    "to; whoever took them decides those", batch.id, len(lost), len(items),
                    extra={"action": "attempt_not_sent"})
        kept = [it for it in items if it.op.id not in lost]
        await self._settle(batch, [(it, rule(self.config.partner, _for_item(
            batch.id, answer.whole), it.op.attempts + 1)) for it in kept])
        for it in items:
            if it.op.id in lost:
                it.resolve(AGAIN)

    # -- what the answer makes of each item --------------------------------------------

    async def _conclude(self, sent: _Sent) -> None:
        batch, items, answer = sent.batch, sent.items, sent.answer
        whole, n = answer.whole, len(items)
        if whole.status == 429 or (whole.status in (400, 413, 422) and n > 1):
            await self._refused(batch, items, whole, sent.ids_refused)
            return
        if self.batch.shape == "job" and whole.verdict is Verdict.AMBIGUOUS:
            # A submission whose answer was lost: the poller looks the job up by our tag
            # (or probes); a blind resubmission could run the job twice.
            await self._handed_to_poller(batch, items, None, whole.detail)
            return
        if whole.verdict is not Verdict.DELETED:  # not a 2xx: every item shares it
            rulings = [rule(self.config.partner, _for_item(batch.id, whole),
                            it.op.attempts + 1) for it in items]
            if whole.verdict is Verdict.ABSENT:
                # A 404 or 410 to the batch is the endpoint's, not the ids': nothing was
                # deleted, and none of them is known to be absent.
                log.error("batch endpoint answered %s: is batch.path right? nothing was "
                          "deleted", whole.detail, extra={"action": "batch_endpoint_missing"})
                rulings = [rule(self.config.partner, Answer(
                    Verdict.TERMINAL, whole.status, f"batch {batch.id}: the batch endpoint "
                    f"answered {whole.detail}; nothing deleted"), it.op.attempts + 1)
                    for it in items]
        elif self.batch.shape == "job" and answer.problem is not None:
            # A job submitted with no reference we can read: the poller finds it by our
            # tag (or probes), nothing is resent meanwhile.
            await self._handed_to_poller(batch, items, None, answer.problem)
            return
        elif answer.problem is not None or self.batch.shape == "per_item":
            if answer.strays or answer.problem:
                log.warning("batch %s: %s%d results for ids not sent, ignored", batch.id,
                            f"{answer.problem}; " if answer.problem else "", answer.strays,
                            extra={"action": "batch_answer_problem"})
            rulings = [rule_result(self.config.partner, batch.id, answer.items,
                                   it.op.recipient_id, whole, it.op.attempts + 1,
                                   answer.codes) for it in items]
        elif self.batch.shape == "job":
            await self._handed_to_poller(batch, items, answer.job_ref, None)
            return
        else:
            rulings = await self._confirm(batch, items)
        self.chunker.answered()
        await self._settle(batch, list(zip(items, rulings, strict=True)))
        await self.ledger.update_batch(batch.id, "closed", detail=whole.detail)

    async def _refused(self, batch: Batch, items: list[Item], whole: Answer,
                       ids_refused: bool) -> None:
        """Refused whole, nothing done: a 429 (the budget learnt it), a batch too large
        (halved), or one bad id failing the rest (split until it fails alone)."""
        if whole.status == 429:
            self.chunker.throttled(ids=ids_refused)
            why = "was refused with 429"
        elif whole.status == 413:
            self.chunker.refused_too_large(len(items))
            why = "was refused as too large (413)"
        else:
            why = f"was refused whole ({whole.detail}); split in halves"
        await self._settle(batch, [(it, refused_whole(batch.id, whole, why)) for it in items],
                           resolve=whole.status in (429, 413))
        await self.ledger.update_batch(batch.id, "closed", detail=why)
        if whole.status not in (429, 413):
            # Items recovered on the ledger alone (no delivery here) go round with
            # their own deliveries.
            held = [it for it in items if it.delivery is not None]
            half = len(held) // 2
            for part in (held[:half], held[half:]):
                fresh = [Item(await self._op(it.op.id), it.delivery, it.task, it.done)
                         for it in part]
                if fresh:
                    self._launch(fresh)

    async def _confirm(self, batch: Batch, items: list[Item]) -> list[Ruling]:
        """Accepted whole: each item's probe says what happened to it."""
        p = self.config.partner
        if self.batch.settle_accepted_unprobed_risking_silent_misses:
            return [Ruling(OpState.DELETED,
                           f"batch {batch.id} accepted whole; not probed "
                           "(settle_accepted_unprobed_risking_silent_misses)",
                           Answer(Verdict.DELETED, None, "accepted, unprobed"))
                    for _ in items]

        async def probe(it: Item) -> Ruling:
            presence, detail = await paced_probe(self.budget, self.partner, it.op.recipient_id)
            return rule_probe(p, batch.id, presence, detail, it.op.attempts + 1,
                              resend_if_present=True)

        # The probes may take long (a delay, then one token each): the holds are renewed
        # until they end, so no one takes the items over while the answer is read.
        async with self.owned.holding(claims(items)):
            if self.batch.probe_delay_seconds > 0:
                await asyncio.sleep(self.batch.probe_delay_seconds)
            return list(await asyncio.gather(*(probe(it) for it in items)))

    async def _handed_to_poller(self, batch: Batch, items: list[Item], job_ref: str | None,
                                problem: str | None) -> None:
        await self.ledger.update_batch(batch.id, "submitted" if job_ref else "submitting",
                                       job_ref=job_ref, submitted=True, detail=problem)
        log.info("batch %s of %d submitted as job %s%s", batch.id, len(items),
                 job_ref or "(reference unknown: looked up by our tag)",
                 f" ({problem})" if problem else "", extra={"action": "batch_job_submitted"})
        self.job_submitted.set()
        for it in items:
            if it.delivery is not None:
                self.settler.moved.add(it.delivery.receipt)
                await self.courier.drop(it.delivery, "in_job")
            it.resolve(None)

    async def _settle(self, batch: Batch, rulings: Sequence[tuple[Item, Ruling]],
                      resolve: bool = True) -> None:
        settlements = []
        for it, r in rulings:
            settlements.append(Settlement(
                operation_id=it.op.id, target=r.target, delivery=it.delivery,
                # A member settled on the ledger alone moves no message: its own
                # delivery (if any) decides again on what was written.
                disposition=r.disposition if it.delivery is not None else Disposition.KEEP,
                delay_s=r.delay_s, reason=r.reason, attempt_id=it.attempt_id,
                status=r.answer.status, outcome=r.answer.verdict.value,
                detail=r.answer.detail, refund_attempt=r.refund, batch_id=batch.id,
                owner=claim[2] if (claim := it.claim) is not None else None))
        refused = await self.settler.settle_many(settlements)
        for it, r in rulings:
            if it.op.id in refused:
                # Another owner decides it (its batch taken again): its worker is done
                # here, its message left to its lease (an item split into a new batch
                # instead finds its operation held when it begins).
                if resolve:
                    it.resolve(None)
                continue
            metrics.BATCH_ITEMS.labels(r.answer.verdict.value).inc()
            if resolve:
                it.resolve(AGAIN if r.again else None)

    async def pump_jobs(self) -> None:
        """A job partner's partial batches: while a job slot is free and no batch waits
        for one, the oldest leaves (a batch waits for a slot anyway; formed at once it
        would carry only what came in a linger). Never returns."""
        while True:
            await asyncio.sleep(self.batch.linger_seconds)  # a cadence, not a wait for state
            if self._job_waiters or not self.chunker.pending:
                continue
            if len(await self.ledger.open_jobs()) < self.batch.max_jobs_in_flight:
                self.chunker.flush_oldest()

    async def stop(self) -> None:
        """Shutdown: nothing more is formed; batches in the air are the pool's grace."""
        self.chunker.drop_all()
        pending = list(self._tasks) + [r.task for r in self._resolving.values()]
        for task in pending:
            task.cancel("shutdown")
        if pending:
            await asyncio.wait(pending)


def _for_item(batch_id: str, whole: Answer) -> Answer:
    return Answer(whole.verdict, whole.status, f"batch {batch_id}: {whole.detail}",
                  whole.retry_after_s, whole.elapsed_s)


def _label(whole: Answer) -> str:
    return str(whole.status) if whole.status is not None else whole.verdict.value
