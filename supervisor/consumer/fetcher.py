"""Taking messages from the transport for the pool's workers: receive as many as there
are idle workers (plus the prefetch), note each claim in the ledger in one write, keep
the leases of held messages alive, and recognise a second delivery of one held here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from supervisor import metrics
from supervisor.budget.base import RateBudget
from supervisor.consumer.frontier import Frontier
from supervisor.errors import QueueBlocked, QueueError, QueueRefused, StorageError
from supervisor.ledger.base import Ledger
from supervisor.model import Delivery, Received
from supervisor.queue.base import Queue
from supervisor.queue.courier import Courier
from supervisor.queue.settings import QueueConfig

log = logging.getLogger(__name__)

# Empty receives from a billed transport back off to this; a publish of ours wakes at once.
IDLE_POLL_MAX_S = 30.0
BLOCKED_RETRY_S = (5.0, 60.0)
STORAGE_BACKOFF_S = 1.0

Claimed = tuple[Delivery, Received | None]


async def pause(stopping: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds``, or less if the pool stops meanwhile."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stopping.wait()


class Fetcher:
    def __init__(self, config: QueueConfig, ledger: Ledger, queue: Queue, courier: Courier,
                 budget: RateBudget, frontier: Frontier, stopping: asyncio.Event) -> None:
        self.config = config
        self.ledger = ledger
        self.queue = queue
        self.caps = queue.capabilities
        self.courier = courier
        self.budget = budget
        self.frontier = frontier
        self._stopping = stopping
        # Messages received for idle workers (and prefetched), and every message held: for
        # lease extension, and so that a second delivery of one is recognised.
        self._inbox: asyncio.Queue[Claimed] = asyncio.Queue()
        self._idle = 0
        self.wanted = asyncio.Event()
        self.held: dict[str, tuple[Delivery, float]] = {}
        self._refusals: set[str] = set()

    def reset(self) -> None:
        """A restart after a crash starts from nothing: no dead worker is idle."""
        self._idle = 0

    async def take(self) -> Claimed:
        """The next message for an idle worker (the caller)."""
        self._idle += 1
        self.wanted.set()
        try:
            return await self._inbox.get()
        finally:
            self._idle -= 1

    def release(self, delivery: Delivery) -> None:
        """A worker is done with it: acked, handed back or left to its lease."""
        self.held.pop(delivery.message.operation_id, None)

    def held_since(self, delivery: Delivery) -> float | None:
        """When the lease on its message was last taken or extended (monotonic)."""
        held = self.held.get(delivery.message.operation_id)
        return held[1] if held else None

    async def hand_back_unclaimed(self) -> None:
        """Received but never picked up by a worker: back to the transport at once."""
        while not self._inbox.empty():
            await asyncio.shield(self.courier.hand_back(self._inbox.get_nowait()[0]))

    async def run(self) -> None:
        """Receive as many messages as there are idle workers (plus ``prefetch``, so a
        transport's round trip does not cost pace), in one call; never more, so no
        message waits under lease in our hands while another consumer could work it."""
        q = self.config
        poll_s = q.poll_interval_seconds
        blocked = 0
        if not self.caps.pull:
            await self._stopping.wait()  # pushed: nothing to receive, ever
            return
        prefetch = q.prefetch if q.prefetch is not None else self.caps.default_prefetch
        while True:
            waiting = self._inbox.qsize()
            wanted = self._idle + prefetch - waiting
            # Refill once half the prefetched messages are taken: one call for several
            # messages, not one call per worker that frees up. Prefetched are those no
            # idle worker is about to take: messages just put in the inbox still count
            # their workers as idle until those run, and a worker that waits for a whole
            # batch to be answered does not come back to ask (batch partners).
            if wanted <= 0 or waiting - self._idle > prefetch // 2:
                self.wanted.clear()
                await self.wanted.wait()
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
                await pause(self._stopping, min(BLOCKED_RETRY_S[1], BLOCKED_RETRY_S[0] * blocked))
                continue
            except (StorageError, QueueError) as exc:
                self._report(exc)
                await pause(self._stopping, STORAGE_BACKOFF_S)
                continue
            blocked = 0
            if not deliveries:
                self.frontier.found_nothing()
                try:
                    await self.queue.wait(poll_s)
                except QueueError as exc:
                    # A broker's wait is a call of its own: one that fails is a pause,
                    # and the next receive says what is wrong.
                    self._report(exc)
                    await pause(self._stopping, STORAGE_BACKOFF_S)
                if self.caps.billed:
                    poll_s = min(IDLE_POLL_MAX_S, poll_s * 2)
                continue
            poll_s = q.poll_interval_seconds
            await self._admit(deliveries)

    def _report(self, exc: StorageError | QueueError) -> None:
        # The ledger reports a failed commit once; each failed claim only at DEBUG. A
        # refusal nothing else reports (an unknown queue, a bad request) is said once per
        # kind, so a consumer that takes nothing is never silent.
        if isinstance(exc, QueueRefused) and exc.code not in self._refusals:
            self._refusals.add(exc.code)
            log.warning("the queue refuses to hand out messages: %s", exc,
                        extra={"action": "queue_refused"})
        log.debug("could not claim messages: %s", exc)

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

    async def _admit(self, deliveries: list[Delivery]) -> None:
        now = time.monotonic()
        fresh = []
        for d in deliveries:
            if d.message.operation_id in self.held:
                # Its visibility timeout ran out while a worker here holds it: that worker
                # acks it when done. Leave this copy to its lease; never a second attempt.
                metrics.QUEUE_DUPLICATES.inc()
                continue
            self.held[d.message.operation_id] = (d, now)
            fresh.append(d)
        # One write for the whole claim, not one per message. Whatever happens to it (a
        # fault, shutdown), the messages reach the inbox: a worker reads its own
        # operation, and stop() hands back what no worker took.
        received: list[Received] | None = None
        try:
            received = await self.ledger.note_received(fresh, self.config.lease_seconds)
        except StorageError:
            pass
        finally:
            for i, d in enumerate(fresh):
                self._inbox.put_nowait((d, received[i] if received else None))
        self.frontier.sample(received or [])

    async def extend_leases(self) -> None:
        """Extend the lease of every message held for more than a third of it: a worker
        waiting on the limiter or a Retry-After keeps its message, and nobody else gets it."""
        lease_s = self.config.lease_seconds
        while True:
            await asyncio.sleep(lease_s / 3)  # a period, not a synchronisation
            due = time.monotonic() - lease_s / 3
            for op_id, (delivery, since) in list(self.held.items()):
                if since > due:
                    continue
                try:
                    kept = await self.queue.extend(delivery, lease_s)
                except (StorageError, QueueError):
                    continue
                if op_id in self.held:
                    self.held[op_id] = (delivery, time.monotonic())
                if not kept:
                    log.warning("lease on %s lost", op_id, extra={"operation_id": op_id})
