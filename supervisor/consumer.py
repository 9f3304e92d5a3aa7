"""The pull consumer pool: receive, check the ledger, pace, call the partner, record, ack."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import time
from collections.abc import Callable

from supervisor import metrics
from supervisor.budget.base import RateBudget
from supervisor.config import Config
from supervisor.errors import (
    AttemptOpen,
    IllegalTransition,
    OperationBusy,
    QueueBlocked,
    QueueError,
    QueueRefused,
    StorageError,
)
from supervisor.ledger.base import Ledger
from supervisor.model import Delivery, Disposition, Operation, Received, Settlement
from supervisor.outcomes import decide, feedback
from supervisor.ownership import Ownership
from supervisor.partner import Answer, PartnerClient, Verdict
from supervisor.push import PushedQueue, PushOutcome
from supervisor.queue.base import Queue
from supervisor.queue.courier import Courier
from supervisor.states import SETTLED, OpState

log = logging.getLogger(__name__)

# A message due this much later than its delivery is deferred rather than worked early
# (a repost's predecessor delivered again after a crash).
EARLY_S = 1.0
# Empty receives from a billed transport back off to this; a publish of ours wakes at once.
IDLE_POLL_MAX_S = 30.0
BLOCKED_RETRY_S = (5.0, 60.0)
MANAGED_PREFETCH = 10
FRONTIER_SAMPLES = 4096
# An attempt that lost its hold before it was sent is tried again this much later.
LOST_RETRY_S = 1.0


_NOT_SENT = Answer(Verdict.TRANSIENT, None, "not sent: shutdown before the request left")


class Phase(enum.Enum):
    IDLE = "idle"  # waiting for a message
    WAITING = "waiting"  # holding a message, waiting for the limiter: nothing sent yet
    SENDING = "sending"  # a request may be in the air: let it finish within the grace


class ConsumerPool:
    """``limits.concurrency`` workers sharing one rate budget and one HTTP pool.

    :meth:`run` returns when :meth:`stop` has drained every worker. Stopping hands back at
    once every message whose request has not left, gives requests in the air until the
    grace period to finish, then cancels them and hands their messages back too.
    """

    def __init__(self, config: Config, ledger: Ledger, queue: Queue, budget: RateBudget,
                 partner: PartnerClient, on_settled: Callable[[], None]) -> None:
        self.config = config
        self.ledger = ledger
        self.queue = queue
        self.courier = Courier(ledger, queue)
        self.caps = queue.capabilities
        self.budget = budget
        self.partner = partner
        self._on_settled = on_settled
        self._stopping = asyncio.Event()
        self._phases: dict[asyncio.Task[None], Phase] = {}
        self.settled = 0
        # Messages received for idle workers (and prefetched), and every message held: for
        # lease extension, and so that a second delivery of one is recognised.
        self._inbox: asyncio.Queue[tuple[Delivery, Received | None]] = asyncio.Queue()
        self._idle = 0
        self._wanted = asyncio.Event()
        self._held: dict[str, tuple[Delivery, float]] = {}
        # (when, latest due time) of each claim, and when a receive last found nothing:
        # how far the consumers have got, for redrive.
        self._frontier: collections.deque[tuple[float, float]] = collections.deque()
        self._refusals: set[str] = set()
        # Deliveries whose message was acked or published again: nothing to hand back.
        self._moved: set[str] = set()
        self._empty_at = 0.0
        self._fetcher: asyncio.Task[None] | None = None
        self._extender: asyncio.Task[None] | None = None
        # An attempt holds its operation for its request's own bound plus slack, renewed
        # while it waits for its token (supervisor/ownership.py), so it never runs out.
        self._owned = Ownership(ledger, budget, cover_s=config.partner.request_bound_seconds)
        self._busy_s = self._owned.busy_s

    async def run(self) -> None:
        self._stopping.clear()
        # A restart after a crash starts from nothing: no dead worker counts as running.
        self._phases.clear()
        self._idle = 0
        metrics.WORKERS.set(self.config.limits.concurrency)
        try:
            async with asyncio.TaskGroup() as tg:
                self._fetcher = tg.create_task(self._fetch(), name="consumer-fetch")
                if self.caps.extend:
                    self._extender = tg.create_task(self._extend_leases(),
                                                    name="consumer-leases")
                for i in range(self.config.limits.concurrency):
                    task = tg.create_task(self._worker(), name=f"consumer-{i}")
                    self._phases[task] = Phase.IDLE
        finally:
            self._phases.clear()
            # Messages received that no worker took: back to the transport.
            while not self._inbox.empty():
                await asyncio.shield(self.courier.hand_back(self._inbox.get_nowait()[0]))
            self._held.clear()

    @property
    def running(self) -> bool:
        return bool(self._phases) and not self._stopping.is_set()

    async def stop(self, grace_s: float) -> dict[str, int]:
        """Drain the pool; return how many workers finished and how many were cut off."""
        self._stopping.set()
        workers = len(self._phases)
        for helper in (self._fetcher, self._extender):
            if helper is not None:
                helper.cancel("shutdown")
        for task, phase in self._phases.items():
            if phase is not Phase.SENDING:
                task.cancel("shutdown: nothing in the air")
        pending = [t for t in self._phases if not t.done()]
        cut = 0
        if pending:
            _, late = await asyncio.wait(pending, timeout=grace_s)
            for task in late:
                task.cancel("shutdown: grace period over")
                cut += 1
            if late:
                await asyncio.wait(late)
        # A claim the fetcher had in progress is handed back by the fetcher itself: let it
        # finish, or the caller's cancellation of run() would cut that hand-back short.
        if self._fetcher is not None:
            await asyncio.wait([self._fetcher])
        # Received but never picked up by a worker: hand back at once.
        while not self._inbox.empty():
            await asyncio.shield(self.courier.hand_back(self._inbox.get_nowait()[0]))
        return {"workers": workers, "cut_off": cut}

    async def handle_pushed(self, delivery: Delivery) -> PushOutcome:
        """One delivery Infrai pushed (supervisor/push.py), on a pool whose queue is a
        PushedQueue: a pulled message's bookkeeping, decision and attempt, answered
        instead of acked (2xx only once the outcome is committed). While the limiter
        holds, or no token is likely within ``max_wait_s``, nothing is counted or sent."""
        queue = self.queue
        assert isinstance(queue, PushedQueue), "handle_pushed needs a pool on a PushedQueue"
        if self._stopping.is_set():
            return PushOutcome(503, "shutting down", 1.0, "unavailable")
        snap = self.budget.snapshot()
        hold = snap.held_for(time.time())
        # Ahead of it: this pool's deliveries not yet sent, or every request holding a
        # slot of the budget (other pools' too), whichever is more.
        ahead = max(sum(1 for p in self._phases.values() if p is Phase.WAITING), snap.in_flight)
        wait = hold or ahead / max(snap.rate, 1e-9)
        if hold > 0 or wait > queue.max_wait_s:
            why = "the partner's limit holds every request" if hold else \
                f"no token within {queue.max_wait_s:g} s"
            return PushOutcome(429, why, wait, "held")
        task = asyncio.current_task()
        assert task is not None
        self._phases[task] = Phase.WAITING
        try:
            with queue.track(delivery) as record:
                # Infrai delivers a message again after its visibility timeout (our answer
                # lost, or late): one message, one receive, however often it comes.
                [received] = await self.ledger.note_received([delivery], queue.lease_s,
                                                             per_message=True)
                self._sample([received])
                await self._handle(task, delivery, received)
        except (StorageError, QueueError) as exc:
            log.log(logging.WARNING if self.ledger.healthy else logging.DEBUG,
                    "could not record pushed operation %s: %s", delivery.message.operation_id, exc)
            return PushOutcome(503, "outcome not recorded (ledger fault)", 5.0, "unavailable")
        finally:
            self._phases.pop(task, None)
            # The answer is the hand-back: nothing is left to track for this delivery.
            self._moved.discard(delivery.receipt)
        if record.retry_after_s is not None:
            held = self.budget.snapshot().held_for(time.time()) > 0
            return PushOutcome(429 if held else 503, "retry wait: deliver again later",
                               record.retry_after_s, "retry")
        if not record.acked:  # another delivery of the operation has its attempt
            return PushOutcome(503, "the operation is in flight", self._busy_s, "busy")
        return PushOutcome(200, "acked: the outcome is committed")

    async def _fetch(self) -> None:
        """Receive as many messages as there are idle workers (plus ``queue.prefetch``, so
        a transport's round trip does not cost pace), in one call; never more, so no
        message waits under lease in our hands while another consumer could work it."""
        q = self.config.queue
        poll_s = q.poll_interval_seconds
        blocked = 0
        if not self.caps.pull:
            await self._stopping.wait()  # pushed: nothing to receive, ever
            return
        prefetch = q.prefetch if q.prefetch is not None else \
            (0 if self.caps.transactional_ack else MANAGED_PREFETCH)
        while True:
            waiting = self._inbox.qsize()
            wanted = self._idle + prefetch - waiting
            # Refill once half the prefetched messages are taken: one call for several
            # messages, not one call per worker that frees up.
            if wanted <= 0 or waiting > prefetch // 2:
                self._wanted.clear()
                await self._wanted.wait()
                continue
            if not self.caps.extend:
                # Messages taken now would outlive their visibility timeout waiting for
                # the hold to end, and each would be published again: take none until then.
                await self.budget.ready()
            try:
                deliveries = await self._receive(min(wanted, q.receive_batch), q.lease_seconds)
            except QueueBlocked:
                # The transport said once why ("queue refuses us"); retry slowly.
                blocked += 1
                await self._pause(min(BLOCKED_RETRY_S[1], BLOCKED_RETRY_S[0] * blocked))
                continue
            except (StorageError, QueueError) as exc:
                # The ledger reports a failed commit once; each failed claim only at DEBUG.
                # A refusal nothing else reports (an unknown queue, a bad request) is said
                # once per kind, so a consumer that takes nothing is never silent.
                if isinstance(exc, QueueRefused) and exc.code not in self._refusals:
                    self._refusals.add(exc.code)
                    log.warning("the queue refuses to hand out messages: %s", exc,
                                extra={"action": "queue_refused"})
                log.debug("could not claim messages: %s", exc)
                await self._backoff_storage()
                continue
            blocked = 0
            if not deliveries:
                self._empty_at = time.time()
                await self.queue.wait(poll_s)
                if not self.caps.stats:  # a billed transport: empty polls back off
                    poll_s = min(IDLE_POLL_MAX_S, poll_s * 2)
                continue
            poll_s = q.poll_interval_seconds
            await self._admit(deliveries)

    async def _admit(self, deliveries: list[Delivery]) -> None:
        now = time.monotonic()
        fresh = []
        for d in deliveries:
            if d.message.operation_id in self._held:
                # Its visibility timeout ran out while a worker here holds it: that worker
                # acks it when done. Leave this copy to its lease; never a second attempt.
                metrics.QUEUE_DUPLICATES.inc()
                continue
            self._held[d.message.operation_id] = (d, now)
            fresh.append(d)
        # One write for the whole claim, not one per message. Whatever happens to it (a
        # fault, shutdown), the messages reach the inbox: a worker reads its own
        # operation, and stop() hands back what no worker took.
        received: list[Received] | None = None
        try:
            received = await self.ledger.note_received(fresh, self.config.queue.lease_seconds)
        except StorageError:
            pass
        finally:
            for i, d in enumerate(fresh):
                self._inbox.put_nowait((d, received[i] if received else None))
        self._sample(received or [])

    def _sample(self, received: list[Received]) -> None:
        """How far the consumers have got: the latest due time among what just arrived."""
        dues = [r.operation.due_at for r in received if r.operation and r.operation.due_at]
        if dues:
            self._frontier.append((time.time(), max(dues)))
            while len(self._frontier) > FRONTIER_SAMPLES:
                self._frontier.popleft()

    def redrive_horizon(self, grace_s: float) -> float | None:
        """What redrive may call passed by: messages due before the horizon that nothing
        has touched since have been overtaken, so they were lost. The due time of what
        was being received ``grace_s`` ago; or now less the grace when nothing has been
        there to receive for that long. None while the budget holds every worker (nothing
        is delivered, nothing is overtaken) or no sample is old enough."""
        now = time.time()
        if not self.running or self.budget.snapshot().held_for(now) > 0:
            return None
        cutoff = now - grace_s
        last = self._frontier[-1][0] if self._frontier else 0.0
        if self._empty_at > last and last < cutoff and self._empty_at >= cutoff:
            return cutoff  # starved: everything still waiting was lost
        older = [due for at, due in self._frontier if at <= cutoff]
        return max(older) if older else None

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()

    async def _receive(self, n: int, lease_s: float) -> list[Delivery]:
        claim = asyncio.ensure_future(self.queue.receive(n, lease_s))
        try:
            return await asyncio.shield(claim)
        except asyncio.CancelledError:
            # Shutdown while claiming: the claim completes all the same, so hand back what
            # it took instead of leaving it leased until the lease runs out.
            with contextlib.suppress(StorageError, QueueError):
                for delivery in await claim:
                    await self.courier.hand_back(delivery)
            raise

    async def _extend_leases(self) -> None:
        """Extend the lease of every message held for more than a third of it: a worker
        waiting on the limiter or a Retry-After keeps its message, and nobody else gets it."""
        lease_s = self.config.queue.lease_seconds
        while True:
            await asyncio.sleep(lease_s / 3)  # a period, not a synchronisation
            due = time.monotonic() - lease_s / 3
            for op_id, (delivery, since) in list(self._held.items()):
                if since > due:
                    continue
                try:
                    kept = await self.queue.extend(delivery, lease_s)
                except (StorageError, QueueError):
                    continue
                if op_id in self._held:
                    self._held[op_id] = (delivery, time.monotonic())
                if not kept:
                    log.warning("lease on %s lost", op_id, extra={"operation_id": op_id})

    async def _worker(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        while not self._stopping.is_set():
            self._phases[task] = Phase.IDLE
            self._idle += 1
            self._wanted.set()
            try:
                delivery, received = await self._inbox.get()
            finally:
                self._idle -= 1
            metrics.WORKERS_BUSY.inc()
            try:
                await self._handle(task, delivery, received)
            except asyncio.CancelledError:
                # Shutdown: hand the message back now, not when its lease runs out (unless
                # it was acked or published again already). If the request had left, its
                # attempt stays open and the redelivery treats it as ambiguous.
                if delivery.receipt not in self._moved:
                    await asyncio.shield(self.courier.hand_back(delivery))
                raise
            except (StorageError, QueueError) as exc:
                # Nothing was acked: the lease expires and the message comes back. A
                # failed commit was reported once by the ledger ("ledger cannot commit"),
                # not once per write: only a fault the ledger has not reported is a warning.
                log.log(logging.WARNING if self.ledger.healthy else logging.DEBUG,
                        "could not record operation %s: %s",
                        delivery.message.operation_id, exc)
                await self._backoff_storage()
            finally:
                self._held.pop(delivery.message.operation_id, None)
                self._moved.discard(delivery.receipt)
                metrics.WORKERS_BUSY.dec()
        self._phases[task] = Phase.IDLE

    async def _backoff_storage(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await self._stopping.wait()

    async def _handle(self, task: asyncio.Task[None], delivery: Delivery,
                      received: Received | None) -> None:
        msg = delivery.message
        if received is None:  # the bookkeeping write failed: read, and count nothing
            received = Received(await self.ledger.get_operation(msg.operation_id), 0)
        op = received.operation
        if op is None:
            log.warning("message for unknown operation %s dropped", msg.operation_id)
            await self.courier.drop(delivery, "unknown_operation")
            return
        if op.state in SETTLED:
            # Redelivered after its outcome committed (the ack was lost or never sent).
            await self.courier.drop(delivery, "settled")
            return
        if op.state is OpState.IN_FLIGHT and received.held_s > 0:
            # Another worker's attempt holds it, its guard alive (a copy, a redelivery
            # after the visibility timeout, a replay): that attempt is not ours to end,
            # nor to double. Come back when its guard is over.
            metrics.QUEUE_DUPLICATES.inc()
            if self.caps.nack:
                await self.courier.retry_later(delivery, received.held_s)
            return
        if op.unfinished_attempt and not self.config.partner.idempotency_keys:
            # The last request may have acted and the partner cannot dedupe a resend:
            # never resend blindly. Hold it for reconciliation.
            await self._settle(delivery, op, OpState.AMBIGUOUS,
                               f"attempt {op.attempts} has no recorded outcome; not resent")
            return
        if received.receives > self.config.queue.max_receives and received.held_s <= 0:
            # Poison: delivered over and over, and nobody holds it (an attempt in the air or
            # a retry not yet due is progress, however many copies arrive meanwhile).
            target = OpState.AMBIGUOUS if op.unfinished_attempt else OpState.FAILED
            await self._settle(delivery, op, target,
                               f"received {received.receives} times without an outcome")
            return
        early = (op.due_at or 0.0) - time.time()
        if early > EARLY_S and not op.unfinished_attempt:
            # Its retry is not due: a repost's predecessor, delivered again because its
            # ack was lost. Wait as the retry asked.
            await self._defer(delivery, early)
            return
        await self._attempt(task, delivery, op)

    async def _defer(self, delivery: Delivery, delay_s: float) -> None:
        """Publish the message again for ``delay_s`` from now and ack this copy; a
        shutdown does not cut it short, and nothing is handed back after it."""
        self._moved.add(delivery.receipt)
        move = asyncio.ensure_future(self.courier.defer(delivery, delay_s))
        try:
            await asyncio.shield(move)
        except asyncio.CancelledError:
            await asyncio.wait([move])
            raise

    async def _ready_within_lease(self, delivery: Delivery) -> bool:
        """Wait while the budget holds every worker (a pause, a spent quota). Without
        extend, only as long as the message's visibility timeout allows: False when the
        hold outlasts it (the message must then be published again for when it ends)."""
        if self.caps.extend:
            await self.budget.ready()
            return True
        if self.budget.snapshot().held_for(time.time()) <= 0:
            return True  # nothing holds: no wait, whatever is left of the lease
        held = self._held.get(delivery.message.operation_id)
        lease_s = self.config.queue.lease_seconds
        # Margin: the wait for a token and the request itself come after the hold.
        margin = min(lease_s / 3, self._busy_s)
        left = (lease_s - (time.monotonic() - held[1]) if held else 0.0) - margin
        if left <= 0:
            return False
        try:
            async with asyncio.timeout(max(0.0, left)):
                await self.budget.ready()
        except TimeoutError:
            return False
        return True

    async def _attempt(self, task: asyncio.Task[None], delivery: Delivery, op: Operation) -> None:
        attempts = op.attempts
        while True:
            if self._stopping.is_set():
                # Throttled and told to stop: nothing is in the air, hand the message back.
                await asyncio.shield(self.courier.hand_back(delivery))
                return
            self._phases[task] = Phase.WAITING
            # A pause or a spent quota, and then a concurrency slot, are waited out before
            # the attempt is written: no attempt is open while its worker waits for them.
            if not await self._ready_within_lease(delivery):
                # The message would become visible again while we wait: publish it again
                # for when the hold ends, and let this worker go.
                await self._defer(delivery, self.budget.snapshot().held_for(time.time()))
                return
            admission = await self.budget.admit()
            try:
                # Writing the attempt is not cut short by a shutdown (it may commit all
                # the same); the wait for the token after it is, and closes it unsent.
                self._phases[task] = Phase.SENDING
                try:
                    # With keys, superseding whatever is open: an attempt whose hold ran
                    # out is no one's, and a resend carries its key. Without, the ledger
                    # refuses if another delivery began one while this one waited.
                    attempt_id = await self.ledger.begin_attempt(
                        op.id, "delete", owner=delivery.receipt, busy_s=self._busy_s,
                        supersedes_open=self.config.partner.idempotency_keys)
                except OperationBusy as exc:
                    # A second delivery of an operation another worker has in the air:
                    # come back when that attempt is over, or, without nack, when this
                    # copy's lease ends (the holder acks it).
                    metrics.QUEUE_DUPLICATES.inc()
                    if self.caps.nack:
                        await self.courier.retry_later(delivery,
                                                       max(0.0, exc.until - time.time()))
                    return
                except AttemptOpen:
                    # Its holder is gone (its hold ran out) and its outcome unknown: never
                    # resend blindly; hold it for reconciliation, as _handle would have.
                    await self._settle(delivery, op, OpState.AMBIGUOUS,
                                       "an earlier attempt has no recorded outcome; not resent")
                    return
                except IllegalTransition:
                    # Another delivery settled it while this one waited for its slot.
                    current = await self.ledger.get_operation(op.id)
                    if current is None or current.state not in SETTLED:
                        raise
                    metrics.QUEUE_DUPLICATES.inc()
                    await self.courier.drop(delivery, "settled")
                    return
                attempts += 1
                self._phases[task] = Phase.WAITING
                try:
                    grant, lost = await self._owned.token(admission, delivery.receipt, op.id,
                                                          attempt_id)
                except asyncio.CancelledError:
                    # Shutdown before the request left: the attempt was written, never
                    # sent. The worker hands the message back as it unwinds.
                    await self._settle(delivery, op, OpState.RETRY_WAIT, None, attempt_id,
                                       _NOT_SENT, disposition=Disposition.KEEP, refund=True)
                    raise
            finally:
                self.budget.withdraw(admission)  # nothing once the token wait spent it
            if grant is None:
                # Nothing was sent: close the attempt unsent. A hold that began after it
                # was written is waited out without one; an attempt no longer this
                # delivery's (its hold lost, superseded) is left to whoever holds it
                # (the ledger discards this outcome then) or tried again shortly.
                why = lost or "a hold began before the request left"
                await self._settle(delivery, op, OpState.RETRY_WAIT, None, attempt_id,
                                   Answer(Verdict.TRANSIENT, None, f"not sent: {why}"),
                                   disposition=Disposition.RETRY if lost else Disposition.KEEP,
                                   delay_s=LOST_RETRY_S if lost else 0.0, refund=True)
                if lost:
                    return
                attempts -= 1
                continue
            # From here on a request is in the air: a shutdown lets it finish within the
            # grace instead of leaving an open attempt.
            self._phases[task] = Phase.SENDING
            answer = await self.partner.delete(op.recipient_id, op.id)
            self.budget.release(grant, feedback(answer))
            self._record_answer(answer)
            if answer.verdict is Verdict.THROTTLED:
                # Not a failed attempt: everyone is paused, the message kept, tried again.
                await self._settle(delivery, op, OpState.RETRY_WAIT, None, attempt_id, answer,
                                   disposition=Disposition.KEEP, refund=True)
                attempts -= 1
                continue
            await self._conclude(delivery, op, attempt_id, answer, attempts)
            return

    async def _conclude(self, delivery: Delivery, op: Operation, attempt_id: int, answer: Answer,
                        attempts: int) -> None:
        if answer.verdict is Verdict.TERMINAL and answer.status == 422:
            log.error("partner rejected Idempotency-Key %s as reused with another request",
                      op.id, extra={"action": "idempotency_key_conflict"})
        d = decide(self.config.partner, answer, attempts)
        await self._settle(delivery, op, d.target, d.reason, attempt_id, answer,
                           disposition=d.disposition, delay_s=d.delay_s)

    @staticmethod
    def _record_answer(answer: Answer) -> None:
        metrics.PARTNER_RESPONSES.labels(str(answer.status) if answer.status else "error").inc()
        metrics.PARTNER_DURATION.observe(answer.elapsed_s)

    async def _settle(self, delivery: Delivery, op: Operation, target: OpState,
                      reason: str | None, attempt_id: int | None = None,
                      answer: Answer | None = None, *,
                      disposition: Disposition = Disposition.ACK, delay_s: float = 0.0,
                      refund: bool = False) -> None:
        settlement = Settlement(
            operation_id=op.id, target=target, delivery=delivery, disposition=disposition,
            delay_s=delay_s, reason=reason, attempt_id=attempt_id,
            status=answer.status if answer else None,
            outcome=answer.verdict.value if answer else None,
            detail=answer.detail if answer else None, refund_attempt=refund)
        # The commit must not be torn by a shutdown cancelling this worker: it runs in a
        # task of its own, awaited to the end either way. What the transport still needs
        # after it may be cut short (a lost ack is redelivered and acked on sight).
        commit = asyncio.ensure_future(self.ledger.settle([settlement]))
        try:
            leftover = await asyncio.shield(commit)
        except asyncio.CancelledError:
            await asyncio.wait([commit])
            if disposition is Disposition.ACK:
                # Settled, its ack not sent: it comes back and is acked on sight; a copy
                # handed back now would only be one more.
                self._moved.add(delivery.receipt)
            raise
        if disposition is not Disposition.KEEP:
            self._moved.add(delivery.receipt)
        await self.courier.follow_up(leftover)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("operation %s -> %s (%s)", op.id, target.value,
                      answer.detail if answer else reason,
                      extra={"operation_id": op.id, "run_id": op.run_id, "action": "settle"})
        if target in SETTLED:
            metrics.count_settled(target.value)
            self.settled += 1
            self._on_settled()

