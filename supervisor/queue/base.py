"""The queue protocol every backend implements. Consumers never know which one they have."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Message:
    """Identifiers only: never a profile, always far below any transport's size limit."""

    run_id: str
    operation_id: str
    recipient_id: str


@dataclass(frozen=True, slots=True)
class Delivery:
    """A message held under a lease. ``lease_token`` proves the lease is still ours."""

    message: Message
    lease_token: str
    receives: int


@dataclass(frozen=True, slots=True)
class QueueStats:
    depth: int  # claimable now
    parked: int  # waiting for a delayed retry
    leased: int  # held by a consumer
    oldest_claimable_age_s: float  # 0 when nothing is claimable


class Queue(Protocol):
    async def publish(self, messages: Sequence[Message]) -> None:
        """Make messages claimable. Publishing an operation twice keeps one message."""

    async def receive(self, max_messages: int, lease_s: float) -> list[Delivery]:
        """Claim up to ``max_messages`` claimable messages for ``lease_s``; may return none."""

    async def wait(self, timeout_s: float) -> None:
        """Return when a message may have become claimable, or after ``timeout_s``."""

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Remove delivered messages. A lease lost meanwhile makes that ack a no-op."""

    async def nack(self, delivery: Delivery, delay_s: float) -> None:
        """Give the message back, claimable again after ``delay_s``."""

    async def extend(self, delivery: Delivery, lease_s: float) -> bool:
        """Push the lease ``lease_s`` into the future; False when the lease was lost."""

    async def missing(self, operation_ids: Sequence[str]) -> set[str]:
        """Which of these operations have no message in the queue (for redrive)."""

    async def stats(self) -> QueueStats:
        """Depth, parked, leased and the age of the oldest claimable message."""
