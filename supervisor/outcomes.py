"""What an answer from the partner makes of an operation: the consumer's decision table,
pure, so every row of it is tested without a request (tests/unit/test_outcomes.py).

The consumer writes what :func:`decide` returns; a 429 never reaches here (it is not a
failed attempt: the budget pauses everyone and the message is kept).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from supervisor.budget.base import Feedback, Outcome
from supervisor.config import PartnerConfig
from supervisor.model import Disposition
from supervisor.partner import Answer, Verdict
from supervisor.states import OpState


@dataclass(frozen=True, slots=True)
class Decision:
    target: OpState
    reason: str | None
    disposition: Disposition = Disposition.ACK
    delay_s: float = 0.0


def feedback(answer: Answer) -> Feedback:
    """What the rate budget learns from one answer."""
    if answer.verdict in (Verdict.DELETED, Verdict.ABSENT):
        outcome = Outcome.OK
    elif answer.verdict is Verdict.THROTTLED:
        outcome = Outcome.THROTTLED
    else:
        outcome = Outcome.OTHER
    return Feedback(outcome, answer.elapsed_s, answer.retry_after_s, answer.policies)


def backoff(p: PartnerConfig, attempts: int, rng: random.Random | None = None) -> float:
    ceiling = min(p.backoff_max_seconds, p.backoff_initial_seconds * 2.0 ** (attempts - 1))
    # Equal jitter: spreads retries of a burst without ever retrying at once.
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


def decide(p: PartnerConfig, answer: Answer, attempts: int,
           rng: random.Random | None = None) -> Decision:
    """The operation's next state after its ``attempts``-th attempt got ``answer``."""
    v = answer.verdict
    if v is Verdict.DELETED:
        return Decision(OpState.DELETED, None)
    if v is Verdict.ABSENT:
        return Decision(OpState.ALREADY_ABSENT, None)
    if v is Verdict.TERMINAL:
        return Decision(OpState.FAILED, f"partner answered {answer.detail}")
    if v is Verdict.AMBIGUOUS and not p.idempotency_keys:
        # It may have acted and a resend cannot be deduplicated: reconcile, never resend.
        return Decision(OpState.AMBIGUOUS,
                        f"{answer.detail} after the request was sent; not resent")
    if attempts >= p.max_attempts:
        # Transient, or ambiguous with keys: out of attempts. If any may have acted, the
        # outcome is unknown, not failed.
        target = OpState.AMBIGUOUS if v is Verdict.AMBIGUOUS else OpState.FAILED
        return Decision(target, f"gave up after {attempts} attempts: {answer.detail}")
    delay = backoff(p, attempts, rng)
    if answer.retry_after_s is not None:
        delay = max(delay, answer.retry_after_s)
    return Decision(OpState.RETRY_WAIT, None, Disposition.RETRY, delay)
