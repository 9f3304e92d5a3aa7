"""The operation state machine: every legal transition, checked in one place."""

from __future__ import annotations

import enum

from supervisor.errors import IllegalTransition


class OpState(enum.StrEnum):
    DISCOVERED = "discovered"
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    RETRY_WAIT = "retry_wait"
    AMBIGUOUS = "ambiguous"
    DELETED = "deleted"
    ALREADY_ABSENT = "already_absent"
    FAILED = "failed"


class RunState(enum.StrEnum):
    SCANNING = "scanning"  # the producer is still paging the source
    DRAINING = "draining"  # every candidate is discovered; operations are being worked
    DONE = "done"  # nothing left queued or in flight (ambiguous ones wait for evidence)


TERMINAL: frozenset[OpState] = frozenset({OpState.DELETED, OpState.ALREADY_ABSENT, OpState.FAILED})
# Not terminal, but nothing will move these without evidence or an operator.
SETTLED: frozenset[OpState] = TERMINAL | {OpState.AMBIGUOUS}

_S = OpState
TRANSITIONS: dict[OpState, frozenset[OpState]] = {
    # discovered -> in_flight/failed: a consumer may claim the message before the outbox
    # has recorded the publish; the message exists, so the operation is as good as queued.
    _S.DISCOVERED: frozenset({_S.QUEUED, _S.IN_FLIGHT, _S.FAILED}),
    # queued -> failed: received too many times before any attempt could be made.
    _S.QUEUED: frozenset({_S.IN_FLIGHT, _S.FAILED}),
    _S.IN_FLIGHT: frozenset({
        _S.DELETED, _S.ALREADY_ABSENT, _S.FAILED, _S.RETRY_WAIT, _S.AMBIGUOUS,
        # redelivered after a crash with the attempt unfinished: resend with the same key
        _S.IN_FLIGHT,
        # a lease handed back at shutdown before the request left
        _S.QUEUED,
    }),
    _S.RETRY_WAIT: frozenset({_S.IN_FLIGHT, _S.FAILED, _S.QUEUED}),
    # ambiguous -> ambiguous: an inconclusive probe, recorded as evidence so far.
    _S.AMBIGUOUS: frozenset({_S.DELETED, _S.ALREADY_ABSENT, _S.QUEUED, _S.FAILED, _S.AMBIGUOUS}),
    _S.DELETED: frozenset(),
    _S.ALREADY_ABSENT: frozenset(),
    _S.FAILED: frozenset(),
}


def is_legal(current: OpState, target: OpState) -> bool:
    return target in TRANSITIONS[current]


def check(operation_id: str, current: OpState, target: OpState) -> None:
    """Raise IllegalTransition unless ``current -> target`` is in the table."""
    if not is_legal(current, target):
        raise IllegalTransition(operation_id, current, target)


def predecessors(target: OpState) -> frozenset[OpState]:
    """Every state from which ``target`` may be reached (the table, read backwards)."""
    return _PREDECESSORS[target]


_PREDECESSORS: dict[OpState, frozenset[OpState]] = {
    t: frozenset(s for s, targets in TRANSITIONS.items() if t in targets) for t in OpState
}
