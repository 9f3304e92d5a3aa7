"""The queue protocol: what a transport really does, and what it may also do.

A transport publishes, hands out messages under a visibility timeout and deletes them on
ack. Everything else is optional and declared in :class:`Capabilities`: the consumer,
redrive and monitor work with a transport that has none of it, because the ledger keeps
the bookkeeping a managed queue does not give (each operation's live message, when it
was published, how often it was received, when a delayed retry is due).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from supervisor.model import Delivery, Message, QueueStats

# The documented ceilings of managed queues (Infrai: 256 KB bodies, 7-day delays).
MAX_DELAY_S = 7 * 86400.0
MAX_PAYLOAD_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class Capabilities:
    # Acks and nacks join the ledger's own transaction (the queue lives in its database):
    # the outcome and the ack commit together instead of one after the other.
    transactional_ack: bool = False
    extend: bool = False  # a held message's visibility timeout can be pushed out
    nack: bool = False  # a message can be handed back, visible again after a delay
    stats: bool = False  # depth, parked, leased and oldest age are cheap to ask
    max_delay_s: float = MAX_DELAY_S  # the longest delay publish accepts
    # False: messages arrive by push (HTTP), receive never hands any out.
    pull: bool = True
    # Each receive is a billed call: an empty queue is polled ever more slowly (a publish
    # of ours still wakes the consumer at once) instead of at the configured interval.
    billed: bool = False
    # Messages received beyond the idle workers when ``queue.prefetch`` is unset: a
    # transport whose round trip costs time keeps a few in hand so no worker waits on it.
    default_prefetch: int = 0


class Queue(Protocol):
    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def healthy(self) -> bool:
        """False while the transport refuses us (credentials, credit) or is unreachable."""

    async def publish(self, messages: Sequence[Message], delay_s: float = 0.0) -> list[str]:
        """Make messages claimable after ``delay_s`` (at most ``max_delay_s``); return
        their message IDs in order. A retried publish must not create a second message."""

    async def receive(self, max_messages: int, lease_s: float) -> list[Delivery]:
        """Take up to ``max_messages`` visible messages for ``lease_s``; may return none."""

    async def wait(self, timeout_s: float) -> None:
        """Return when a message may have become visible, or after ``timeout_s``. A
        transport whose wait is a call to its broker may raise QueueError."""

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Delete delivered messages for good."""

    async def nack(self, delivery: Delivery, delay_s: float) -> None:
        """Hand a message back, visible again after ``delay_s``. Only with ``nack``."""

    async def extend(self, delivery: Delivery, lease_s: float) -> bool:
        """Push the visibility timeout ``lease_s`` out; False when the lease was lost.
        Only with ``extend``."""

    async def stats(self) -> QueueStats:
        """Depth, parked, leased, oldest claimable age. Only with ``stats``."""

    async def close(self) -> None: ...


class Unsupported(NotImplementedError):
    """An optional method called on a transport that does not declare it: a bug."""


async def wait_until_due(wakeup: asyncio.Event, next_due: float | None,
                         timeout_s: float) -> None:
    """A table-backed queue's wait: until ``wakeup`` is set, the earliest message
    (``next_due``, wall clock) becomes claimable, or ``timeout_s``. The caller clears
    ``wakeup`` before reading ``next_due``, so a publish during the read still wakes it."""
    if next_due is not None:
        timeout_s = max(0.0, min(timeout_s, next_due - time.time()))
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await wakeup.wait()
