"""The ``[queue]`` section: which transport carries the operations' messages, and how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from supervisor.configtypes import _positive


@dataclass(frozen=True, slots=True)
class QueueConfig:
    # sqlite: a table in the ledger's own file; infrai: Infrai's managed queue, pulled
    # (works from a private network), see [infrai]; postgres: a table in the PostgreSQL
    # ledger's database (claims with SKIP LOCKED, ack in the outcome's transaction).
    backend: Literal["sqlite", "infrai", "postgres"] = "sqlite"
    lease_seconds: float = 60.0
    # A message received this many times ends its operation as failed: a poison message
    # must not circulate for ever.
    max_receives: int = 20
    receive_batch: int = 32
    # Messages received beyond the idle workers, so a transport's round trip never leaves
    # a worker waiting (each one is held under its visibility timeout meanwhile), refilled
    # in batches once half are taken. Unset: none for the embedded queue, 10 for a
    # managed one (its calls cost time and money).
    prefetch: int | None = None
    poll_interval_seconds: float = 1.0
    # The ledger is truth: every interval, an unfinished operation untouched for the grace
    # period and without a message in the queue is published again.
    redrive_interval_seconds: float = 60.0
    redrive_grace_seconds: float = 120.0

    def problems(self) -> list[str]:
        out = _positive("queue", self, "lease_seconds", "max_receives", "receive_batch",
                        "poll_interval_seconds", "redrive_interval_seconds",
                        "redrive_grace_seconds")
        if self.prefetch is not None and self.prefetch < 0:
            out.append(f"queue.prefetch must be >= 0, got {self.prefetch}")
        return out
