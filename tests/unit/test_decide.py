"""What a delivery calls for before anything is sent (supervisor/consumer/decide.py): each
rule row by row, then properties over every operation state and capability set — decide
is total, answers only what the state allows, never attempts a settled operation again,
never resends blindly without idempotency keys, never poisons an operation somebody
holds, and reads of the transport only whether it can nack."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.config import Config, PartnerConfig
from supervisor.consumer.decide import (
    ATTEMPT_OPEN,
    EARLY_S,
    SETTLED_MEANWHILE,
    Action,
    Do,
    Rules,
    busy,
    decide,
)
from supervisor.model import Operation, Received
from supervisor.queue.base import Capabilities
from supervisor.queue.settings import QueueConfig
from supervisor.states import SETTLED, TERMINAL, OpState, is_legal

NOW = 1_000_000.0
MAX_RECEIVES = 20
KEYS_NACK = Rules(idempotency_keys=True, max_receives=MAX_RECEIVES, nack=True)
NO_KEYS_NACK = dataclasses.replace(KEYS_NACK, idempotency_keys=False)
KEYS_NO_NACK = dataclasses.replace(KEYS_NACK, nack=False)
ALL_RULES = [KEYS_NACK, NO_KEYS_NACK, KEYS_NO_NACK,
             dataclasses.replace(NO_KEYS_NACK, nack=False)]
RULE_IDS = ["keys-nack", "nokeys-nack", "keys-nonack", "nokeys-nonack"]

# What a delivery may call for, by the state its operation is in (None: no operation).
ALLOWED: dict[OpState | None, frozenset[Do]] = {
    None: frozenset({Do.DROP}),
    **{s: frozenset({Do.DROP}) for s in SETTLED},
    OpState.DISCOVERED: frozenset({Do.SETTLE, Do.DEFER, Do.ATTEMPT}),
    OpState.QUEUED: frozenset({Do.SETTLE, Do.DEFER, Do.ATTEMPT}),
    OpState.RETRY_WAIT: frozenset({Do.SETTLE, Do.DEFER, Do.ATTEMPT}),
    OpState.IN_FLIGHT: frozenset({Do.RETRY_LATER, Do.LEAVE, Do.SETTLE, Do.DEFER, Do.ATTEMPT}),
}


def op(state: OpState = OpState.QUEUED, *, attempts: int = 0, due_at: float | None = None,
       unfinished: bool = False) -> Operation:
    return Operation(id="op_1", run_id="run_1", recipient_id="r-1", state=state,
                     attempts=attempts, reason=None, created_at=NOW - 60, updated_at=NOW - 1,
                     due_at=due_at, unfinished_attempt=unfinished)


def received(operation: Operation | None, receives: int = 1, held_s: float = 0.0) -> Received:
    return Received(operation, receives, held_s)


# The rules, row by row.

@pytest.mark.parametrize("rules", ALL_RULES, ids=RULE_IDS)
def test_a_message_for_no_operation_is_dropped(rules: Rules) -> None:
    assert decide(received(None), rules, NOW) == Action(Do.DROP, reason="unknown_operation")


@pytest.mark.parametrize("rules", ALL_RULES, ids=RULE_IDS)
@pytest.mark.parametrize("state", sorted(SETTLED))
def test_a_settled_operation_is_acked_on_sight_whatever_else_holds(
        rules: Rules, state: OpState) -> None:
    for r in (received(op(state)),
              received(op(state, unfinished=True), receives=MAX_RECEIVES + 5, held_s=30),
              received(op(state, due_at=NOW + 3600))):
        assert decide(r, rules, NOW) == Action(Do.DROP, reason="settled")


def test_an_attempt_in_the_air_elsewhere_is_come_back_to_with_nack() -> None:
    r = received(op(OpState.IN_FLIGHT, attempts=1, unfinished=True), held_s=12.5)
    assert decide(r, KEYS_NACK, NOW) == Action(Do.RETRY_LATER, delay_s=12.5, duplicate=True)


def test_an_attempt_in_the_air_elsewhere_is_left_to_its_lease_without_nack() -> None:
    r = received(op(OpState.IN_FLIGHT, attempts=1, unfinished=True), held_s=12.5)
    assert decide(r, KEYS_NO_NACK, NOW) == Action(Do.LEAVE, duplicate=True)


@pytest.mark.parametrize("rules", ALL_RULES, ids=RULE_IDS)
def test_copies_past_max_receives_do_not_end_an_attempt_in_the_air(rules: Rules) -> None:
    r = received(op(OpState.IN_FLIGHT, attempts=1, unfinished=True),
                 receives=MAX_RECEIVES * 3, held_s=5.0)
    assert decide(r, rules, NOW).do in {Do.RETRY_LATER, Do.LEAVE}


def test_without_keys_an_unfinished_attempt_nobody_holds_becomes_ambiguous() -> None:
    r = received(op(OpState.IN_FLIGHT, attempts=2, unfinished=True))
    assert decide(r, NO_KEYS_NACK, NOW) == Action(
        Do.SETTLE, OpState.AMBIGUOUS, "attempt 2 has no recorded outcome; not resent")


def test_with_keys_an_unfinished_attempt_nobody_holds_is_sent_again() -> None:
    r = received(op(OpState.IN_FLIGHT, attempts=2, unfinished=True, due_at=NOW + 600))
    # Its due time does not defer it: the request may have acted, and a resend dedupes.
    assert decide(r, KEYS_NACK, NOW) == Action(Do.ATTEMPT)


@pytest.mark.parametrize("state", [OpState.DISCOVERED, OpState.QUEUED, OpState.RETRY_WAIT,
                                   OpState.IN_FLIGHT])
def test_a_poison_message_nobody_holds_fails_its_operation(state: OpState) -> None:
    r = received(op(state), receives=MAX_RECEIVES + 1)
    assert decide(r, KEYS_NACK, NOW) == Action(
        Do.SETTLE, OpState.FAILED, f"received {MAX_RECEIVES + 1} times without an outcome")


def test_a_poison_message_whose_attempt_may_have_acted_is_ambiguous_not_failed() -> None:
    r = received(op(OpState.IN_FLIGHT, attempts=1, unfinished=True), receives=MAX_RECEIVES + 1)
    action = decide(r, KEYS_NACK, NOW)
    assert (action.do, action.target) == (Do.SETTLE, OpState.AMBIGUOUS)


def test_max_receives_itself_is_not_poison() -> None:
    r = received(op(OpState.QUEUED), receives=MAX_RECEIVES)
    assert decide(r, KEYS_NACK, NOW) == Action(Do.ATTEMPT)


def test_copies_of_a_retry_not_yet_due_are_deferred_not_poisoned() -> None:
    r = received(op(OpState.RETRY_WAIT, attempts=1, due_at=NOW + 45), receives=MAX_RECEIVES * 2,
                 held_s=45)
    assert decide(r, NO_KEYS_NACK, NOW) == Action(Do.DEFER, delay_s=45)


@pytest.mark.parametrize(("due_in", "expected"), [
    (None, Action(Do.ATTEMPT)),
    (-30.0, Action(Do.ATTEMPT)),
    (EARLY_S, Action(Do.ATTEMPT)),  # a clock that jitters: worked now
    (EARLY_S + 0.5, Action(Do.DEFER, delay_s=EARLY_S + 0.5)),
    (3600.0, Action(Do.DEFER, delay_s=3600.0)),
])
def test_a_message_delivered_before_its_due_time_is_deferred(
        due_in: float | None, expected: Action) -> None:
    r = received(op(OpState.RETRY_WAIT, attempts=1,
                    due_at=None if due_in is None else NOW + due_in))
    assert decide(r, KEYS_NACK, NOW) == expected


def test_a_fresh_operation_is_attempted() -> None:
    assert decide(received(op(OpState.QUEUED)), NO_KEYS_NACK, NOW) == Action(Do.ATTEMPT)
    assert decide(received(op(OpState.DISCOVERED)), NO_KEYS_NACK, NOW) == Action(Do.ATTEMPT)


def test_busy_comes_back_no_sooner_than_now() -> None:
    assert busy(KEYS_NACK, -3.0) == Action(Do.RETRY_LATER, delay_s=0.0, duplicate=True)
    assert busy(KEYS_NACK, 7.0) == Action(Do.RETRY_LATER, delay_s=7.0, duplicate=True)
    assert busy(KEYS_NO_NACK, 7.0) == Action(Do.LEAVE, duplicate=True)


def test_the_ledgers_refusals_when_the_attempt_is_written() -> None:
    assert (ATTEMPT_OPEN.do, ATTEMPT_OPEN.target) == (Do.SETTLE, OpState.AMBIGUOUS)
    assert (SETTLED_MEANWHILE.do, SETTLED_MEANWHILE.reason) == (Do.DROP, "settled")
    assert SETTLED_MEANWHILE.duplicate


def test_rules_read_the_configuration_and_the_transport() -> None:
    config = Config(partner=PartnerConfig(idempotency_keys=False),
                    queue=QueueConfig(max_receives=7))
    assert Rules.of(config, Capabilities(nack=True)) == Rules(False, 7, True)
    assert Rules.of(Config(), Capabilities()) == Rules(True, QueueConfig().max_receives, False)


# Properties over every state and capability set.

capabilities = st.builds(
    Capabilities, transactional_ack=st.booleans(), extend=st.booleans(), nack=st.booleans(),
    stats=st.booleans(), max_delay_s=st.sampled_from([7 * 86400.0, float("inf")]),
    pull=st.booleans(), billed=st.booleans(), default_prefetch=st.integers(0, 64))
configs = st.builds(
    lambda keys, max_receives: Config(partner=PartnerConfig(idempotency_keys=keys),
                                      queue=QueueConfig(max_receives=max_receives)),
    st.booleans(), st.integers(1, 50))
offsets = st.floats(-1e6, 1e6, allow_nan=False)


@st.composite
def operations(draw: st.DrawFn, consistent: bool = False) -> Operation | None:
    """Any operation, or none. ``consistent``: only what the ledger can hold, where an
    attempt without an outcome leaves its operation in flight (or settled since)."""
    if draw(st.booleans()) and draw(st.booleans()):
        return None
    state = draw(st.sampled_from(list(OpState)))
    unfinished = draw(st.booleans())
    if consistent and state not in SETTLED and state is not OpState.IN_FLIGHT:
        unfinished = False
    due = draw(st.none() | offsets)
    return op(state, attempts=draw(st.integers(0, 100)),
              due_at=None if due is None else NOW + due, unfinished=unfinished)


def arrivals(consistent: bool = False) -> st.SearchStrategy[Received]:
    held = st.just(0.0) | st.floats(-10.0, 1e6, allow_nan=False)
    # Mostly below max_receives (so the later rules are reached), sometimes far past it.
    receives = st.integers(0, 5) | st.integers(0, 200)
    return st.builds(Received, operations(consistent), receives, held)


@given(arrivals(), configs, capabilities, offsets)
def test_decide_is_total_and_answers_only_what_the_state_allows(
        r: Received, config: Config, caps: Capabilities, skew: float) -> None:
    rules = Rules.of(config, caps)
    action = decide(r, rules, NOW + skew)
    state = r.operation.state if r.operation else None
    assert action.do in ALLOWED[state]
    assert action.delay_s >= 0
    assert (action.target is not None) == (action.do is Do.SETTLE)
    assert decide(r, rules, NOW + skew) == action  # pure: the same answer every time


@given(arrivals(), configs, capabilities)
def test_a_settled_operation_is_never_attempted_moved_or_written_again(
        r: Received, config: Config, caps: Capabilities) -> None:
    if r.operation is None or r.operation.state not in SETTLED:
        return
    action = decide(r, Rules.of(config, caps), NOW)
    assert action == Action(Do.DROP, reason="settled")
    if r.operation.state in TERMINAL:
        assert action.do is not Do.ATTEMPT


@given(arrivals(), configs, capabilities)
def test_without_keys_an_unfinished_attempt_is_never_resent_blindly(
        r: Received, config: Config, caps: Capabilities) -> None:
    rules = Rules.of(config, caps)
    if rules.idempotency_keys or r.operation is None or not r.operation.unfinished_attempt:
        return
    assert decide(r, rules, NOW).do is not Do.ATTEMPT


@given(arrivals(consistent=True), configs, capabilities)
def test_a_settlement_is_a_legal_transition_and_never_fails_what_may_have_acted(
        r: Received, config: Config, caps: Capabilities) -> None:
    action = decide(r, Rules.of(config, caps), NOW)
    if action.do is not Do.SETTLE:
        return
    assert r.operation is not None
    assert action.target is not None
    assert is_legal(r.operation.state, action.target)
    if r.operation.unfinished_attempt:
        assert action.target is OpState.AMBIGUOUS


@given(arrivals(consistent=True), configs, capabilities)
def test_no_number_of_copies_ends_an_operation_somebody_holds(
        r: Received, config: Config, caps: Capabilities) -> None:
    if r.held_s <= 0:
        return
    action = decide(r, Rules.of(config, caps), NOW)
    assert action.do is not Do.SETTLE
    if r.operation is not None and r.operation.state is OpState.IN_FLIGHT:
        # An attempt in the air elsewhere is never doubled: come back, or leave it.
        assert action.do in {Do.RETRY_LATER, Do.LEAVE}
        assert action.duplicate


@given(arrivals(), configs, capabilities)
def test_a_message_is_handed_back_only_by_a_transport_that_can(
        r: Received, config: Config, caps: Capabilities) -> None:
    action = decide(r, Rules.of(config, caps), NOW)
    if action.do is Do.RETRY_LATER:
        assert caps.nack
    if action.do is Do.LEAVE:
        assert not caps.nack


@given(arrivals(), configs, capabilities)
def test_a_deferral_waits_exactly_until_due_and_never_holds_back_an_unfinished_attempt(
        r: Received, config: Config, caps: Capabilities) -> None:
    action = decide(r, Rules.of(config, caps), NOW)
    if action.do is not Do.DEFER:
        return
    assert r.operation is not None
    assert r.operation.due_at is not None
    assert action.delay_s == r.operation.due_at - NOW
    assert action.delay_s > EARLY_S
    assert not r.operation.unfinished_attempt


@settings(max_examples=300)
@given(st.builds(lambda attempts, due, receives, held: received(
                     op(OpState.IN_FLIGHT, attempts=attempts, unfinished=True,
                        due_at=None if due is None else NOW + due), receives, held),
                 st.integers(1, 100), st.none() | offsets, st.integers(0, 60),
                 st.just(0.0) | st.floats(-10.0, 1e6, allow_nan=False)),
       configs, capabilities)
def test_an_attempt_that_may_have_acted_is_never_put_off_or_failed(
        r: Received, config: Config, caps: Capabilities) -> None:
    """Its due time is a retry's, not this attempt's: with keys it is resent at once
    (the partner dedupes it), without it is held for reconciliation."""
    action = decide(r, Rules.of(config, caps), NOW)
    assert action.do is not Do.DEFER
    assert action.target is not OpState.FAILED


@given(arrivals(), configs, capabilities)
def test_an_attempt_is_made_only_when_every_rule_lets_it(
        r: Received, config: Config, caps: Capabilities) -> None:
    rules = Rules.of(config, caps)
    if decide(r, rules, NOW).do is not Do.ATTEMPT:
        return
    o = r.operation
    assert o is not None
    assert o.state not in SETTLED
    assert not (o.state is OpState.IN_FLIGHT and r.held_s > 0)
    assert rules.idempotency_keys or not o.unfinished_attempt
    assert r.receives <= rules.max_receives or r.held_s > 0
    assert o.unfinished_attempt or (o.due_at or 0.0) - NOW <= EARLY_S


@given(arrivals(), configs, capabilities, capabilities)
def test_of_the_transport_only_nack_matters(
        r: Received, config: Config, a: Capabilities, b: Capabilities) -> None:
    b = dataclasses.replace(b, nack=a.nack)
    assert decide(r, Rules.of(config, a), NOW) == decide(r, Rules.of(config, b), NOW)


@given(st.floats(-1e6, 1e6, allow_nan=False), capabilities)
def test_busy_never_waits_less_than_nothing(held_s: float, caps: Capabilities) -> None:
    action = busy(Rules.of(Config(), caps), held_s)
    assert action.delay_s >= 0
    assert action.duplicate
    assert action.do is (Do.RETRY_LATER if caps.nack else Do.LEAVE)
