"""What a worker hands the batch path: its operation and delivery, and the future that
tells it how its item ended (done, another action, or round again in the next batch)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.consumer.decide import Action
from supervisor.model import Delivery, Operation


class Again:
    """The item goes round again: its worker adds it to the next batch."""


AGAIN = Again()
Result = Action | None | Again


@dataclass(slots=True)
class Item:
    op: Operation
    delivery: Delivery | None  # None: a member settled on the ledger alone (a recovery)
    task: asyncio.Task[None] | None = None
    done: asyncio.Future[Result] | None = None
    attempt_id: int | None = None
    held_until: float = 0.0  # wall clock: its attempt's hold runs out no sooner
    # Who holds its attempt when no delivery does: a batch's sender found again.
    owner: str | None = None

    @property
    def claim(self) -> tuple[str, int, str] | None:
        """(operation, attempt, owner) as the ledger checks a hold; None: no hold to check
        (a member settled already)."""
        owner = self.delivery.receipt if self.delivery is not None else self.owner
        if owner is None or self.attempt_id is None:
            return None
        return self.op.id, self.attempt_id, owner

    def resolve(self, result: Result) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(result)


def claims(items: Sequence[Item]) -> list[tuple[str, int, str]]:
    """The holds to check or renew for a batch's items."""
    return [c for it in items if (c := it.claim) is not None]
