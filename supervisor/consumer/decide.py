"""What to do with a delivery before anything is sent: the consumer's admission table,
pure, so every rule is tested without a ledger or a transport (tests/unit/test_decide.py).

:func:`decide` reads the operation as the delivery found it (:class:`Received`: its
state, attempts, due time, how many receives and how long someone still holds it) and
returns one :class:`Action`; the pool performs it. The reactions to what the ledger says
when the attempt is written (another delivery holds it, an earlier attempt is open, it
was settled meanwhile) are here too, so each rule is written once. What an answer from
the partner makes of an operation is :mod:`supervisor.outcomes`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from supervisor.config import Config
from supervisor.model import Received
from supervisor.queue.base import Capabilities
from supervisor.states import SETTLED, OpState

# A message due this much later than its delivery is deferred rather than worked early
# (a repost's predecessor delivered again after a crash).
EARLY_S = 1.0


class Do(enum.Enum):
    DROP = "drop"  # ack it, nothing written: ``reason`` is the metric's label
    RETRY_LATER = "retry_later"  # hand it back, visible again after ``delay_s``
    LEAVE = "leave"  # touch nothing: its lease runs out, whoever holds it acks it
    SETTLE = "settle"  # write ``target`` with ``reason``, then ack
    DEFER = "defer"  # publish it again for ``delay_s`` from now, ack this copy
    ATTEMPT = "attempt"  # write an attempt and send the request


@dataclass(frozen=True, slots=True)
class Action:
    do: Do
    target: OpState | None = None  # SETTLE only
    reason: str | None = None
    delay_s: float = 0.0
    # A second delivery of an operation somebody else has (cleanup_queue_duplicates_total).
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class Rules:
    """What the decision depends on besides the operation: configuration and the
    transport's capabilities."""

    idempotency_keys: bool  # the partner deduplicates a resend carrying the same key
    max_receives: int
    nack: bool  # the transport can hand a message back with a delay

    @classmethod
    def of(cls, config: Config, caps: Capabilities) -> Rules:
        return cls(idempotency_keys=config.partner.idempotency_keys,
                   max_receives=config.queue.max_receives, nack=caps.nack)


def decide(received: Received, rules: Rules, now: float) -> Action:
    """What to do with a delivery whose operation the ledger reads as ``received``."""
    op = received.operation
    if op is None:
        return Action(Do.DROP, reason="unknown_operation")
    if op.state in SETTLED:
        # Redelivered after its outcome committed (the ack was lost or never sent).
        return Action(Do.DROP, reason="settled")
    if op.state is OpState.IN_FLIGHT and received.held_s > 0:
        # Another worker's attempt holds it, its guard alive (a copy, a redelivery after
        # the visibility timeout, a replay): that attempt is not ours to end, nor to
        # double. Come back when its guard is over.
        return busy(rules, received.held_s)
    if op.unfinished_attempt and not rules.idempotency_keys:
        # The last request may have acted and the partner cannot dedupe a resend: never
        # resend blindly. Hold it for reconciliation.
        return Action(Do.SETTLE, OpState.AMBIGUOUS,
                      f"attempt {op.attempts} has no recorded outcome; not resent")
    if received.receives > rules.max_receives and received.held_s <= 0:
        # Poison: delivered over and over, and nobody holds it (an attempt in the air or
        # a retry not yet due is progress, however many copies arrive meanwhile).
        target = OpState.AMBIGUOUS if op.unfinished_attempt else OpState.FAILED
        return Action(Do.SETTLE, target,
                      f"received {received.receives} times without an outcome")
    early = (op.due_at or 0.0) - now
    if early > EARLY_S and not op.unfinished_attempt:
        # Its retry is not due: a repost's predecessor, delivered again because its ack
        # was lost. Wait as the retry asked.
        return Action(Do.DEFER, delay_s=early)
    return Action(Do.ATTEMPT)


def busy(rules: Rules, held_s: float) -> Action:
    """A second delivery of an operation another worker holds for ``held_s`` more: come
    back when that is over, or, without nack, when this copy's lease ends (the holder
    acks it)."""
    if rules.nack:
        return Action(Do.RETRY_LATER, delay_s=max(0.0, held_s), duplicate=True)
    return Action(Do.LEAVE, duplicate=True)


# The ledger refused the attempt: without keys, an earlier attempt is open and its holder
# is gone (its hold ran out), its outcome unknown. Never resend blindly; hold it for
# reconciliation, as decide would have.
ATTEMPT_OPEN = Action(Do.SETTLE, OpState.AMBIGUOUS,
                      "an earlier attempt has no recorded outcome; not resent")
# Another delivery settled it while this one waited for its slot.
SETTLED_MEANWHILE = Action(Do.DROP, reason="settled", duplicate=True)
