"""The consumer pool: workers that take a delivery, decide, attempt, settle.

The jobs are each a module of this package: :mod:`.fetcher` receives, prefetches and
extends leases; :mod:`.decide` says what a delivery calls for before anything is sent;
:mod:`.executor` makes the attempt under the budget; :mod:`.settler` writes the outcome
and moves the message; :mod:`.frontier` samples how far the consumers have got. This
module runs the workers, performs what :func:`.decide.decide` returns, and drains.

Pulled deliveries reach :meth:`ConsumerPool.work` through the fetcher and a worker;
pushed ones (supervisor/push.py) through :meth:`ConsumerPool.deliver`, on the HTTP
request's own task. Both end in the same :meth:`ConsumerPool.work`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from supervisor import metrics
from supervisor.budget.base import RateBudget
from supervisor.config import Config
from supervisor.consumer.batches import BatchSender
from supervisor.consumer.decide import Action, Do, Rules, decide
from supervisor.consumer.executor import Executor, Phase, Phases
from supervisor.consumer.fetcher import STORAGE_BACKOFF_S, Fetcher, pause
from supervisor.consumer.frontier import Frontier
from supervisor.consumer.settler import Settler
from supervisor.errors import QueueError, StorageError
from supervisor.ledger.base import Ledger
from supervisor.model import Delivery, Operation, Received
from supervisor.ownership import Ownership
from supervisor.partner import PartnerClient
from supervisor.queue.base import Queue
from supervisor.queue.courier import Courier
from supervisor.states import SETTLED

log = logging.getLogger(__name__)


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
        self.rules = Rules.of(config, self.caps)
        self._stopping = asyncio.Event()
        self._phases: Phases = {}
        self.frontier = Frontier()
        receiving = config.queue
        if config.batch.enabled and config.queue.receive_batch < config.batch.max_items:
            # A batch's worth per receive: a batch formed from several small receives
            # leaves at its linger half full.
            receiving = dataclasses.replace(config.queue,
                                            receive_batch=config.batch.max_items)
        self.fetcher = Fetcher(receiving, ledger, queue, self.courier, budget,
                               self.frontier, self._stopping)
        self.settler = Settler(ledger, self.courier, on_settled)
        # An attempt holds its operation for its request's own bound plus slack, renewed
        # while it waits for its token (supervisor/ownership.py), so it never runs out.
        owned = Ownership(ledger, budget, cover_s=config.partner.request_bound_seconds)
        self.busy_s = owned.busy_s
        self.executor = Executor(config, ledger, budget, partner, self.courier, self.settler,
                                 owned, self.rules, self._phases, self._stopping,
                                 self.fetcher.held_since)
        # Batch partners (docs/batch.md): each worker's operation joins a batch.
        self.batches: BatchSender | None = None
        if config.batch.enabled:
            self.batches = BatchSender(config, ledger, budget, partner, self.courier,
                                       self.settler, self.rules, self._phases, owned)
        self._fetching: asyncio.Task[None] | None = None
        self._extending: asyncio.Task[None] | None = None
        self._pumping: asyncio.Task[None] | None = None

    @property
    def workers(self) -> int:
        """How many deliveries are worked at once: ``limits.concurrency`` requests, each
        of up to ``batch.max_items`` ids for a batch partner."""
        if self.config.batch.enabled:
            return self.config.limits.concurrency * self.config.batch.max_items
        return self.config.limits.concurrency

    @property
    def settled(self) -> int:
        return self.settler.settled

    @property
    def running(self) -> bool:
        return bool(self._phases) and not self._stopping.is_set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def storage_healthy(self) -> bool:
        return self.ledger.healthy

    @property
    def waiting(self) -> int:
        """This pool's deliveries held and not yet sent."""
        return sum(1 for p in self._phases.values() if p is Phase.WAITING)

    async def run(self) -> None:
        self._stopping.clear()
        # A restart after a crash starts from nothing: no dead worker counts as running.
        self._phases.clear()
        self.fetcher.reset()
        metrics.WORKERS.set(self.workers)
        try:
            async with asyncio.TaskGroup() as tg:
                self._fetching = tg.create_task(self.fetcher.run(), name="consumer-fetch")
                if self.caps.extend:
                    self._extending = tg.create_task(self.fetcher.extend_leases(),
                                                     name="consumer-leases")
                if self.batches is not None and self.config.batch.shape == "job":
                    self._pumping = tg.create_task(self.batches.pump_jobs(),
                                                   name="consumer-jobs")
                for i in range(self.workers):
                    task = tg.create_task(self._worker(), name=f"consumer-{i}")
                    self._phases[task] = Phase.IDLE
        finally:
            self._phases.clear()
            # Messages received that no worker took: back to the transport.
            await self.fetcher.hand_back_unclaimed()
            self.fetcher.held.clear()

    async def stop(self, grace_s: float) -> dict[str, int]:
        """Drain the pool; return how many workers finished and how many were cut off."""
        self._stopping.set()
        workers = len(self._phases)
        if self.batches is not None:
            self.batches.chunker.drop_all()
        for helper in (self._fetching, self._extending, self._pumping):
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
        if self.batches is not None:
            await self.batches.stop()
        # A claim the fetcher had in progress is handed back by the fetcher itself: let it
        # finish, or the caller's cancellation of run() would cut that hand-back short.
        if self._fetching is not None:
            await asyncio.wait([self._fetching])
        await self.fetcher.hand_back_unclaimed()
        return {"workers": workers, "cut_off": cut}

    def redrive_horizon(self, grace_s: float) -> float | None:
        """What redrive may call passed by: messages due before the horizon that nothing
        has touched since have been overtaken, so they were lost (:mod:`.frontier`). None
        while the budget holds every worker (nothing is delivered, nothing is overtaken)."""
        now = time.time()
        if not self.running or self.budget.snapshot().held_for(now) > 0:
            return None
        return self.frontier.horizon(grace_s, now)

    async def deliver(self, delivery: Delivery, lease_s: float) -> None:
        """A delivery that came on its own (pushed), worked on the caller's task as a
        worker works a pulled one. Its transport may deliver one message again (its
        answer lost, or late): one message, one receive, however often it comes. Raises
        StorageError or QueueError when its bookkeeping cannot be written."""
        task = asyncio.current_task()
        assert task is not None
        self._phases[task] = Phase.WAITING
        try:
            [received] = await self.ledger.note_received([delivery], lease_s,
                                                         per_message=True)
            self.frontier.sample([received])
            await self.work(task, delivery, received)
        finally:
            self._phases.pop(task, None)
            # The caller's answer is the hand-back: nothing is left to track for it.
            self.settler.moved.discard(delivery.receipt)

    async def _worker(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        while not self._stopping.is_set():
            self._phases[task] = Phase.IDLE
            delivery, received = await self.fetcher.take()
            metrics.WORKERS_BUSY.inc()
            try:
                await self.work(task, delivery, received)
            except asyncio.CancelledError:
                # Shutdown: hand the message back now, not when its lease runs out. If the
                # request had left, its attempt stays open and the redelivery treats it
                # as ambiguous.
                await self.settler.hand_back(delivery)
                raise
            except (StorageError, QueueError) as exc:
                # Nothing was acked: the lease expires and the message comes back. A
                # failed commit was reported once by the ledger ("ledger cannot commit"),
                # not once per write: only a fault the ledger has not reported is a warning.
                log.log(logging.WARNING if self.ledger.healthy else logging.DEBUG,
                        "could not record operation %s: %s",
                        delivery.message.operation_id, exc)
                await pause(self._stopping, STORAGE_BACKOFF_S)
            finally:
                self.fetcher.release(delivery)
                self.settler.moved.discard(delivery.receipt)
                metrics.WORKERS_BUSY.dec()
        self._phases[task] = Phase.IDLE

    async def work(self, task: asyncio.Task[None], delivery: Delivery,
                   received: Received | None) -> None:
        """One delivery, pulled or pushed: decide, then attempt or do what was decided."""
        if received is None:  # the bookkeeping write failed: read, and count nothing
            received = Received(await self.ledger.get_operation(delivery.message.operation_id),
                                0)
        op = received.operation
        # An open attempt no one holds, or one whose batch this process is sending again.
        if self.batches is not None and op is not None and op.unfinished_attempt \
                and op.state not in SETTLED \
                and (received.held_s <= 0 or self.batches.resolving(op.id)):
            handled, instead = await self.batches.recover(delivery, op)
            if handled and (instead is None or instead.do is not Do.ATTEMPT):
                if instead is not None:
                    await self._perform(delivery, op, instead)
                return
            if handled:  # its batch resolved, this one goes out again: as it is now
                received = Received(await self.ledger.get_operation(op.id), 0)
                op = received.operation
        action = decide(received, self.rules, time.time())
        if op is None or action.do is not Do.ATTEMPT:
            await self._perform(delivery, op, action)
            return
        if self.batches is not None:
            instead = await self.batches.attempt(task, delivery, op)
        else:
            instead = await self.executor.attempt(task, delivery, op)
        if instead is not None:
            await self._perform(delivery, op, instead)

    async def _perform(self, delivery: Delivery, op: Operation | None, action: Action) -> None:
        if action.duplicate:
            metrics.QUEUE_DUPLICATES.inc()
        if action.do is Do.DROP:
            if op is None:
                log.warning("message for unknown operation %s dropped",
                            delivery.message.operation_id)
            await self.courier.drop(delivery, action.reason or "")
        elif action.do is Do.RETRY_LATER:
            await self.courier.retry_later(delivery, action.delay_s)
        elif action.do is Do.DEFER:
            await self.settler.defer(delivery, action.delay_s)
        elif action.do is Do.SETTLE:
            assert op is not None, "decide settles only an operation it read"
            assert action.target is not None, "a settle names its state"
            await self.settler.settle(delivery, op, action.target, action.reason)
        # LEAVE: its lease runs out and whoever holds it acks it. ATTEMPT never gets here.
