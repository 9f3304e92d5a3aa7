"""The consumer's decision table, row by row, with no request: what each verdict of the
partner makes of an operation, with and without idempotency keys, before and at the last
attempt."""

from __future__ import annotations

import random

import pytest

from supervisor.budget.base import Outcome
from supervisor.config import PartnerConfig
from supervisor.model import Disposition
from supervisor.outcomes import backoff, decide, feedback
from supervisor.partner import Answer, Verdict
from supervisor.states import OpState

KEYS = PartnerConfig(idempotency_keys=True, max_attempts=3, backoff_initial_seconds=1.0,
                     backoff_max_seconds=8.0)
NO_KEYS = PartnerConfig(idempotency_keys=False, max_attempts=3, backoff_initial_seconds=1.0,
                        backoff_max_seconds=8.0)


def answer(verdict: Verdict, status: int | None = None, retry_after: float | None = None,
           ) -> Answer:
    return Answer(verdict, status, f"{status or 'no answer'}", retry_after_s=retry_after)


@pytest.mark.parametrize("p", [KEYS, NO_KEYS], ids=["keys", "no-keys"])
@pytest.mark.parametrize(("verdict", "status", "target"), [
    (Verdict.DELETED, 204, OpState.DELETED),
    (Verdict.ABSENT, 404, OpState.ALREADY_ABSENT),
    (Verdict.TERMINAL, 400, OpState.FAILED),
])
def test_a_final_answer_settles_whatever_the_attempt(p: PartnerConfig, verdict: Verdict,
                                                    status: int, target: OpState) -> None:
    for attempts in (1, p.max_attempts):
        d = decide(p, answer(verdict, status), attempts)
        assert (d.target, d.disposition) == (target, Disposition.ACK)
        assert (d.reason is not None) == (target is OpState.FAILED)


def test_an_unknown_outcome_without_keys_is_never_resent() -> None:
    d = decide(NO_KEYS, answer(Verdict.AMBIGUOUS), 1)
    assert d.target is OpState.AMBIGUOUS
    assert d.disposition is Disposition.ACK
    assert d.reason is not None
    assert "not resent" in d.reason


def test_an_unknown_outcome_with_keys_is_retried_then_left_ambiguous() -> None:
    d = decide(KEYS, answer(Verdict.AMBIGUOUS), 1, random.Random(1))
    assert (d.target, d.disposition) == (OpState.RETRY_WAIT, Disposition.RETRY)
    last = decide(KEYS, answer(Verdict.AMBIGUOUS), KEYS.max_attempts)
    assert last.target is OpState.AMBIGUOUS  # it may have acted: not "failed"
    assert last.reason is not None
    assert "gave up after 3 attempts" in last.reason


@pytest.mark.parametrize("p", [KEYS, NO_KEYS], ids=["keys", "no-keys"])
def test_a_transient_failure_backs_off_then_fails(p: PartnerConfig) -> None:
    rng = random.Random(7)
    first = decide(p, answer(Verdict.TRANSIENT, 503), 1, rng)
    assert (first.target, first.disposition) == (OpState.RETRY_WAIT, Disposition.RETRY)
    assert 0.5 <= first.delay_s <= 1.0  # equal jitter of the first step
    assert decide(p, answer(Verdict.TRANSIENT, 503), p.max_attempts).target is OpState.FAILED


def test_a_retry_after_on_a_5xx_is_waited_at_least() -> None:
    d = decide(KEYS, answer(Verdict.TRANSIENT, 503, retry_after=30.0), 1, random.Random(3))
    assert d.delay_s == 30.0


def test_backoff_doubles_within_its_ceiling() -> None:
    rng = random.Random(11)
    for attempts, ceiling in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)):
        delay = backoff(KEYS, attempts, rng)
        assert ceiling / 2 <= delay <= ceiling, (attempts, delay)


def test_feedback_tells_the_budget_ok_throttled_or_other() -> None:
    assert feedback(answer(Verdict.DELETED, 204)).outcome is Outcome.OK
    assert feedback(answer(Verdict.ABSENT, 404)).outcome is Outcome.OK
    assert feedback(answer(Verdict.THROTTLED, 429, 2.0)).outcome is Outcome.THROTTLED
    assert feedback(answer(Verdict.TRANSIENT, 503)).outcome is Outcome.OTHER
