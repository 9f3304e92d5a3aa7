"""What each item's verdict makes of its operation: the batch twin of
:mod:`supervisor.outcomes`, pure, and written once for the sender and the job poller.

An operation settles only on its own item's verdict or its own probe, never on the
batch's state. An item with no result in an answer that promised one is held ambiguous
and probed, not resent: a resend in another batch would carry another key."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.config import PartnerConfig
from supervisor.model import Disposition
from supervisor.outcomes import decide
from supervisor.partner import Answer, Presence, Verdict, classify
from supervisor.states import OpState


@dataclass(frozen=True, slots=True)
class Ruling:
    target: OpState
    reason: str | None
    answer: Answer
    disposition: Disposition = Disposition.ACK
    delay_s: float = 0.0
    # Throttled on its own (Graph's inner 429): not an attempt; kept and sent again.
    again: bool = False
    refund: bool = False


def item_answer(batch_id: str, status: int, whole: Answer, code: str | None = None) -> Answer:
    """An item's verdict as an answer; ``code``, the partner's own (Salesforce's
    ENTITY_IS_DELETED), is what the audit trail names beside the status it maps to."""
    said = f"item {code} (HTTP {status})" if code else f"item HTTP {status}"
    return Answer(classify(status, None), status, f"{said} in batch {batch_id}",
                  elapsed_s=whole.elapsed_s)


def rule(p: PartnerConfig, answer: Answer, attempts: int) -> Ruling:
    """An item's (or a whole batch's, for each of its items) answer to its
    ``attempts``-th attempt."""
    if answer.verdict is Verdict.THROTTLED:
        return Ruling(OpState.RETRY_WAIT, None, answer, Disposition.KEEP, again=True,
                      refund=True)
    d = decide(p, answer, attempts)
    return Ruling(d.target, d.reason, answer, d.disposition, d.delay_s)


def rule_result(p: PartnerConfig, batch_id: str, items: dict[str, int] | None,
                recipient_id: str, whole: Answer, attempts: int,
                codes: dict[str, str] | None = None) -> Ruling:
    """A per-item answer (or a finished job's results) for one item."""
    status = None if items is None else items.get(recipient_id)
    if status is None:
        missing = Answer(Verdict.AMBIGUOUS, whole.status,
                         f"batch {batch_id} answered with no result for it")
        return Ruling(OpState.AMBIGUOUS, f"{missing.detail}; not resent", missing)
    answer = item_answer(batch_id, status, whole, (codes or {}).get(recipient_id))
    if answer.verdict is Verdict.THROTTLED:
        # Throttled on its own (Graph's inner 429): an attempt like any retryable one,
        # backed off and counted, so an item the partner keeps refusing ends failed
        # instead of going round for ever. (A whole batch's 429 pauses everyone and
        # counts nothing: refused_whole.)
        answer = Answer(Verdict.TRANSIENT, status, answer.detail, elapsed_s=answer.elapsed_s)
    return rule(p, answer, attempts)


def refused_whole(batch_id: str, whole: Answer, why: str) -> Ruling:
    """The partner refused the whole batch and did nothing (429, 413, a bad id): not a
    failed attempt of any item. Kept, sent again."""
    answer = Answer(Verdict.TRANSIENT, whole.status, f"batch {batch_id} {why}",
                    whole.retry_after_s, whole.elapsed_s)
    return Ruling(OpState.RETRY_WAIT, None, answer, Disposition.KEEP, again=True, refund=True)


def lost_hold(batch_id: str, delay_s: float) -> Ruling:
    """Not sent: when the batch's token came, the item's attempt was no longer its
    delivery's (its hold ran out and another took the operation over; on PostgreSQL,
    this replica was not fresh enough). Whoever holds the operation decides it; the
    message comes back ``delay_s`` later, as a single DELETE's would."""
    answer = Answer(Verdict.TRANSIENT, None,
                    f"not sent: its hold was lost before batch {batch_id}'s token came")
    return Ruling(OpState.RETRY_WAIT, None, answer, Disposition.RETRY, delay_s=delay_s,
                  refund=True)


def rule_probe(p: PartnerConfig, batch_id: str, presence: Presence, detail: str,
               attempts: int, resend_if_present: bool) -> Ruling:
    """A probe after a batch that gave nothing per item (accepted whole; a job whose
    results expired or whose submission is in doubt). Present is a silent miss, sent
    again only where nothing can still act on it (``resend_if_present``)."""
    if presence is Presence.ABSENT:
        return Ruling(OpState.DELETED, f"batch {batch_id}: a probe found it gone",
                      Answer(Verdict.DELETED, None, detail))
    if presence is Presence.PRESENT and resend_if_present:
        answer = Answer(Verdict.TRANSIENT, None,
                        f"batch {batch_id} missed it silently ({detail})")
        return rule(p, answer, attempts)
    why = "still present, and the job may yet act" if presence is Presence.PRESENT \
        else "the probe was inconclusive"
    return Ruling(OpState.AMBIGUOUS, f"batch {batch_id}: {why} ({detail}); not resent",
                  Answer(Verdict.AMBIGUOUS, None, detail))
