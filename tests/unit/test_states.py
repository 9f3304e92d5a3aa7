"""The operation state machine: the table, and properties of every reachable path."""

from __future__ import annotations

import itertools
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import states
from supervisor.errors import IllegalTransition
from supervisor.states import SETTLED, TERMINAL, TRANSITIONS, OpState

S = OpState

# The architecture's diagram, written out independently of the module under test.
EXPECTED: dict[OpState, set[OpState]] = {
    S.DISCOVERED: {S.QUEUED, S.IN_FLIGHT, S.FAILED},
    S.QUEUED: {S.IN_FLIGHT, S.FAILED},
    S.IN_FLIGHT: {S.DELETED, S.ALREADY_ABSENT, S.FAILED, S.RETRY_WAIT, S.AMBIGUOUS, S.IN_FLIGHT,
                  S.QUEUED},
    S.RETRY_WAIT: {S.IN_FLIGHT, S.FAILED, S.QUEUED},
    S.AMBIGUOUS: {S.DELETED, S.ALREADY_ABSENT, S.QUEUED, S.FAILED, S.AMBIGUOUS},
    S.DELETED: set(),
    S.ALREADY_ABSENT: set(),
    S.FAILED: set(),
}


def test_table_matches_the_architecture() -> None:
    assert set(TRANSITIONS) == set(OpState)
    assert {k: set(v) for k, v in TRANSITIONS.items()} == EXPECTED


def test_terminal_and_settled_sets() -> None:
    assert {S.DELETED, S.ALREADY_ABSENT, S.FAILED} == TERMINAL
    assert TERMINAL | {S.AMBIGUOUS} == SETTLED


@pytest.mark.parametrize("current", list(OpState))
@pytest.mark.parametrize("target", list(OpState))
def test_check_agrees_with_is_legal(current: OpState, target: OpState) -> None:
    legal = target in EXPECTED[current]
    assert states.is_legal(current, target) is legal
    if legal:
        states.check("op_x", current, target)
    else:
        with pytest.raises(IllegalTransition) as info:
            states.check("op_x", current, target)
        assert info.value.operation_id == "op_x"
        assert info.value.current == current
        assert info.value.target == target
        assert f"{current} -> {target}" in str(info.value)


@pytest.mark.parametrize("state", sorted(TERMINAL))
def test_terminal_states_have_no_exits(state: OpState) -> None:
    assert not TRANSITIONS[state]
    for target in OpState:
        with pytest.raises(IllegalTransition):
            states.check("op", state, target)


def test_nothing_returns_to_discovered() -> None:
    # The ID and discovery happen once; no transition re-discovers an operation.
    assert all(S.DISCOVERED not in targets for targets in TRANSITIONS.values())


def _reachable(start: OpState) -> set[OpState]:
    seen = {start}
    todo = deque([start])
    while todo:
        for nxt in TRANSITIONS[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("state", sorted(set(OpState) - TERMINAL))
def test_every_non_terminal_state_can_reach_a_terminal_one(state: OpState) -> None:
    assert _reachable(state) & TERMINAL


def test_every_state_is_reachable_from_discovered() -> None:
    assert _reachable(S.DISCOVERED) == set(OpState)


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(st.lists(st.sampled_from(list(OpState)), max_size=40))
def test_random_event_sequences_never_reach_an_illegal_transition(
        events: list[OpState]) -> None:
    """Drive requested targets through check(): refused moves leave the state alone, and the
    path actually taken is made of table entries only."""
    current = S.DISCOVERED
    path = [current]
    for target in events:
        try:
            states.check("op", current, target)
        except IllegalTransition:
            assert target not in TRANSITIONS[current]
            continue
        assert target in TRANSITIONS[current]
        current = target
        path.append(current)
    for a, b in itertools.pairwise(path):
        assert states.is_legal(a, b)
    # Once terminal, always terminal: nothing after it moved.
    if any(s in TERMINAL for s in path):
        first = next(i for i, s in enumerate(path) if s in TERMINAL)
        assert path[first:] == [path[first]]
    # Wherever the sequence stopped, a terminal state is still reachable (or we are in one).
    assert _reachable(current) & TERMINAL


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_random_legal_walks_always_have_a_way_out(data: st.DataObject) -> None:
    current = S.DISCOVERED
    for _ in range(30):
        exits = sorted(TRANSITIONS[current])
        if not exits:
            assert current in TERMINAL
            return
        target = data.draw(st.sampled_from(exits))
        states.check("op", current, target)
        current = target
        assert _reachable(current) & TERMINAL


@pytest.mark.parametrize("target", list(OpState))
def test_predecessors_read_the_table_backwards(target: OpState) -> None:
    # The ledger's guarded UPDATE matches only these states: it must agree with check().
    assert states.predecessors(target) == {s for s in OpState if target in EXPECTED[s]}
