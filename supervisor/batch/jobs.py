"""Jobs that finish later (docs/batch.md, shape ``job``): read every submitted job's
status with backoff (each read costs one request of the budget), and copy a finished
job's per-item results into the ledger before they expire; each operation settles on
its own item's result. Driven by the ledger alone, so a restart (or another replica)
picks up where a crash left off.

A job whose results are gone (404: expired) or whose submission is in doubt and cannot
be looked up by our tag has its items probed; one still present is held ambiguous, never
resubmitted blindly (the job may yet run). A job unfinished past
``batch.job_deadline_seconds`` pages (CleanupBatchJobOverdue) and is still polled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from supervisor import metrics
from supervisor.batch.client import BatchClient
from supervisor.batch.schedule import next_poll, seen_lifetime
from supervisor.batch.verdicts import Ruling, rule_probe, rule_result
from supervisor.budget.base import Feedback, Outcome, RateBudget
from supervisor.config import Config
from supervisor.ledger.base import Ledger
from supervisor.model import Batch, BatchMember, Disposition, Message, Operation, Settlement
from supervisor.outcomes import feedback
from supervisor.partner import PartnerClient, paced_probe
from supervisor.queue.courier import Courier
from supervisor.states import SETTLED, OpState

log = logging.getLogger(__name__)


class JobPoller:
    def __init__(self, config: Config, ledger: Ledger, budget: RateBudget,
                 partner: PartnerClient, courier: Courier, wakeup: asyncio.Event,
                 closed: asyncio.Event) -> None:
        self.config = config
        self.batch = config.batch
        self.ledger = ledger
        self.budget = budget
        self.partner = partner
        self.client = BatchClient(partner, config.batch)
        self.courier = courier
        self.wakeup = wakeup
        self.closed = closed
        # The shortest life of a finished job's results seen (None: none seen yet). Kept
        # in memory only: a restart relearns it from the first finished job it reads,
        # meanwhile an expiry the running jobs announce still schedules their reads, and
        # persisting it would take a ledger column for what one finished job restores.
        # Each replica learns its own from the jobs it reads, which is no less safe. The
        # shortest, not the latest: a partner keeping only its last N jobs shortens the
        # life of results as more jobs arrive, and a read too often costs one request
        # where one too late costs a probe per item.
        self.lifetime: float | None = None

    def due(self, job: Batch) -> float:
        """When ``job`` is read next (supervisor.batch.schedule.next_poll): the interval
        doubles with its age up to ``poll_max_seconds``, but never exceeds half its
        results' learnt lifetime, and comes before an expiry the job announced."""
        return next_poll(job.submitted_at or job.created_at, job.polled_at,
                         initial=self.batch.poll_initial_seconds,
                         maximum=self.batch.poll_max_seconds, lifetime=self.lifetime,
                         expires_at=job.results_expire_at)

    def learn(self, job: Batch, expires_at: float | None, seen_at: float) -> None:
        """Learn the results' lifetime from ``job``, read finished at ``seen_at``.

        Not from a job that announced its expiry while it ran: that expiry may have timed
        this read just before it, and the life left then says when we chose to read, not
        how long results live (every later job would be read each
        ``poll_initial_seconds`` for nothing). Such a job needs no learnt lifetime: its
        own announcement schedules its reads."""
        if expires_at is None or job.results_expire_at is not None:
            return
        seen = seen_lifetime(expires_at, seen_at)
        if self.lifetime is None or seen < self.lifetime:
            self.lifetime = seen
            log.info("batch job results live at least %.1fs: a job is read at most %.1fs "
                     "after the last read", seen, max(self.batch.poll_initial_seconds,
                                        min(self.batch.poll_max_seconds, seen / 2)),
                     extra={"action": "batch_job_lifetime"})

    async def run(self) -> None:
        """Never returns."""
        while True:
            jobs = await self.ledger.open_jobs()
            now = time.time()
            metrics.BATCH_JOBS_IN_FLIGHT.set(len(jobs))
            deadline = self.batch.job_deadline_seconds
            metrics.BATCH_JOBS_OVERDUE.set(sum(
                1 for j in jobs if now - (j.submitted_at or j.created_at) > deadline))
            wake_at = now + self.batch.poll_max_seconds
            if len(jobs) < self.batch.max_jobs_in_flight:
                self.closed.set()
            for job in jobs:
                at = self.due(job)
                if at <= now:
                    await self.poll(job)
                    at = time.time() + self.batch.poll_initial_seconds
                wake_at = min(wake_at, at)
            self.wakeup.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.05, wake_at - time.time())):
                    await self.wakeup.wait()

    async def poll(self, job: Batch) -> None:
        if job.job_ref is None:
            await self._find(job)
            return
        grant = await self.budget.acquire()
        state = await self.client.poll(job.job_ref)
        fb = feedback(state.whole)
        self.budget.release(grant, fb if fb.outcome is Outcome.THROTTLED
                            else Feedback(Outcome.OTHER))
        if state.gone:
            metrics.BATCH_JOB_POLLS.labels("expired").inc()
            log.warning("batch job %s (%s): its results are gone; its items are probed",
                        job.job_ref, job.id, extra={"action": "batch_job_expired"})
            await self._probe_all(job, "its results expired before they were read")
        elif not state.done:
            metrics.BATCH_JOB_POLLS.labels("running" if state.whole.status else "error").inc()
            progress = "" if state.progress is None else f" {state.progress:.0%}"
            await self.ledger.update_batch(job.id, "submitted", polled=True,
                                           results_expire_at=state.expires_at,
                                           detail=f"{state.status or state.whole.detail}"
                                                  f"{progress}")
        else:
            metrics.BATCH_JOB_POLLS.labels("done").inc()
            self.learn(job, state.expires_at, time.time())
            members = await self._open_members(job)
            ops = await self._ops(members)
            if state.problem:
                log.warning("batch job %s (%s): %s", job.job_ref, job.id, state.problem,
                            extra={"action": "batch_answer_problem"})
            rulings = [(m, rule_result(self.config.partner, job.id, state.items,
                                       m.recipient_id, state.whole, ops[m.operation_id].attempts,
                                       state.codes))
                       for m in members if m.operation_id in ops]
            await self._settle(job, rulings, ops)
            await self.ledger.update_batch(job.id, "closed", polled=True,
                                           detail=f"job {state.status}")
            log.info("batch job %s (%s) %s: %d items copied into the ledger", job.job_ref,
                     job.id, state.status, len(rulings), extra={"action": "batch_job_done"})

    async def _find(self, job: Batch) -> None:
        """A submission whose answer was lost (or a crash before its reference was
        written): once its request cannot still be in the air, look it up by our tag."""
        if time.time() - (job.submitted_at or job.created_at) \
                < self.config.partner.request_bound_seconds:
            return
        grant = await self.budget.acquire()
        found = await self.client.lookup(job.id)
        self.budget.release(grant, Feedback(Outcome.OTHER))
        if found.found:
            await self.ledger.update_batch(job.id, "submitted", job_ref=found.job_ref,
                                           polled=True, detail="found by our tag")
            return
        if found.known:
            # No job carries our tag: it never arrived, or it ran and the partner has
            # forgotten it (results kept an hour, only the last 100 jobs). Either way no
            # job will act on these ids any more: each is probed, one gone is settled,
            # one still there is sent again.
            await self._probe_all(job, "no job carries our tag", resend_if_present=True)
            return
        await self._probe_all(job, f"its submission is in doubt ({found.detail})")

    async def _probe_all(self, job: Batch, why: str, resend_if_present: bool = False) -> None:
        members = await self._open_members(job)
        ops = await self._ops(members)
        rulings = []
        for m in members:
            if m.operation_id not in ops:
                continue
            presence, detail = await paced_probe(self.budget, self.partner, m.recipient_id)
            rulings.append((m, rule_probe(self.config.partner, job.id, presence,
                                          f"{why}; {detail}", ops[m.operation_id].attempts,
                                          resend_if_present=resend_if_present)))
        await self._settle(job, rulings, ops)
        await self.ledger.update_batch(job.id, "closed", detail=why)

    async def _open_members(self, job: Batch) -> list[BatchMember]:
        return [m for m in await self.ledger.batch_members(job.id) if m.outcome is None]

    async def _ops(self, members: list[BatchMember]) -> dict[str, Operation]:
        found = await self.ledger.get_operations([m.operation_id for m in members])
        return {k: v for k, v in found.items() if v.state not in SETTLED}

    async def _settle(self, job: Batch, rulings: list[tuple[BatchMember, Ruling]],
                      ops: dict[str, Operation]) -> None:
        """Each item's outcome, then a message for each one to be sent again (the job's
        messages were acked when it was submitted)."""
        if not rulings:
            return
        done = await self.ledger.settle([
            Settlement(operation_id=m.operation_id, target=r.target, delivery=None,
                       disposition=Disposition.KEEP, reason=r.reason,
                       attempt_id=m.attempt_id, status=r.answer.status,
                       outcome=r.answer.verdict.value, detail=r.answer.detail,
                       refund_attempt=r.refund, batch_id=job.id)
            for m, r in rulings])
        again = []
        for m, r in rulings:
            if m.operation_id in done.refused:
                continue  # another attempt decides it: nothing counted, nothing sent
            metrics.BATCH_ITEMS.labels(r.answer.verdict.value).inc()
            if r.target in SETTLED:
                metrics.count_settled(r.target.value)
            elif r.target is OpState.RETRY_WAIT:
                op = ops[m.operation_id]
                again.append((Message(op.run_id, op.id, op.recipient_id), r.delay_s))
        for message, delay in again:
            # A crash before this publish leaves a retry without a message: redrive
            # finds it (it is not in flight, and its retry is due).
            await self.courier.publish([message], delay_s=delay)
