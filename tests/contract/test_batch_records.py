"""The BatchRecords protocol's contract (supervisor/ledger/base.py): both ledgers, read
only through the protocol. A batch row, its attempts by position, the batch of an
operation's open attempt, and the job cap shared by everyone writing to one ledger."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from supervisor.model import Batch, Settled, Settlement
from supervisor.states import OpState
from tests.contract.test_ledger import (
    Backend,
    _target,
    discovered_run,
    open_backend,
    transported_run,
)
from tests.helpers import eventually, still_waiting


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest) -> tuple[str, Any]:
    return _target(request)


@pytest.fixture
async def backend(target: tuple[str, Any], tmp_path: Path) -> AsyncIterator[Backend]:
    async with open_backend(target[0], tmp_path, target[1]) as b:
        yield b


async def _batch_of(b: Backend, ids: list[str], batch_id: str = "b-1",
                    shape: str = "job") -> list[str]:
    run = await discovered_run(b, ids)
    ops = await b.ledger.list_operations(run.id, None, None, 100)
    attempts = [await b.ledger.begin_attempt(op.id, "delete") for op in ops]
    await b.ledger.record_batch(Batch(batch_id, shape, len(ops), "formed", 0.0),
                                [(a, pos) for pos, a in enumerate(attempts)])
    return [op.id for op in ops]


class TestBatchRecords:
    async def test_members_come_back_by_position_with_their_recipients(
            self, backend: Backend) -> None:
        op_ids = await _batch_of(backend, ["r-1", "r-2", "r-3"])
        members = await backend.ledger.batch_members("b-1")
        assert [m.position for m in members] == [0, 1, 2]
        assert [m.operation_id for m in members] == op_ids
        assert sorted(m.recipient_id for m in members) == ["r-1", "r-2", "r-3"]
        assert all(m.outcome is None for m in members)
        batch = await backend.ledger.get_batch("b-1")
        assert batch is not None
        assert (batch.state, batch.size, batch.shape) == ("formed", 3, "job")
        assert await backend.ledger.get_batch("nope") is None

    async def test_an_open_attempt_names_its_batch_until_it_is_settled(
            self, backend: Backend) -> None:
        op_ids = await _batch_of(backend, ["r-1", "r-2"])
        found = await backend.ledger.open_batch_of(op_ids[0])
        assert found is not None
        assert found.id == "b-1"
        [member] = [m for m in await backend.ledger.batch_members("b-1")
                    if m.operation_id == op_ids[0]]
        await backend.ledger.settle([Settlement(op_ids[0], OpState.DELETED, None,
                                                attempt_id=member.attempt_id,
                                                outcome="deleted", status=200)])
        assert await backend.ledger.open_batch_of(op_ids[0]) is None
        assert await backend.ledger.open_batch_of(op_ids[1]) is not None
        outcomes = {m.operation_id: m.outcome for m in await backend.ledger.batch_members("b-1")}
        assert outcomes == {op_ids[0]: "deleted", op_ids[1]: None}

    async def test_updates_keep_what_they_do_not_name_and_close(self, backend: Backend) -> None:
        await _batch_of(backend, ["r-1"])
        await backend.ledger.update_batch("b-1", "submitted", job_ref="J-7", submitted=True,
                                          results_expire_at=1234.0)
        await backend.ledger.update_batch("b-1", "submitted", polled=True, detail="running")
        batch = await backend.ledger.get_batch("b-1")
        assert batch is not None
        assert (batch.job_ref, batch.results_expire_at, batch.detail) == ("J-7", 1234.0,
                                                                          "running")
        assert batch.submitted_at is not None
        assert batch.polled_at is not None
        assert batch.closed_at is None
        assert [j.id for j in await backend.ledger.open_jobs()] == ["b-1"]
        await backend.ledger.update_batch("b-1", "closed")
        batch = await backend.ledger.get_batch("b-1")
        assert batch is not None
        assert batch.closed_at is not None
        assert await backend.ledger.open_jobs() == []
        # A late update (a submission answered after the poller gave up on it) never
        # reopens a closed batch.
        await backend.ledger.update_batch("b-1", "submitted", job_ref="J-8")
        batch = await backend.ledger.get_batch("b-1")
        assert batch is not None
        assert (batch.state, batch.job_ref) == ("closed", "J-7")

    async def test_the_job_cap_holds_under_concurrent_reservations(
            self, backend: Backend) -> None:
        run = await discovered_run(backend, [f"r-{i}" for i in range(6)])
        ops = await backend.ledger.list_operations(run.id, None, None, 100)
        for i, op in enumerate(ops):
            attempt = await backend.ledger.begin_attempt(op.id, "delete")
            await backend.ledger.record_batch(Batch(f"b-{i}", "job", 1, "formed", 0.0),
                                              [(attempt, 0)])
        got = await asyncio.gather(*(backend.ledger.reserve_job(f"b-{i}", 2)
                                     for i in range(6)))
        assert sum(got) == 2
        assert len(await backend.ledger.open_jobs()) == 2
        # A reservation already held is not counted against itself.
        held = [i for i, ok in enumerate(got) if ok]
        assert await backend.ledger.reserve_job(f"b-{held[0]}", 2)
        await backend.ledger.update_batch(f"b-{held[0]}", "closed")
        free = [i for i, ok in enumerate(got) if not ok]
        assert await backend.ledger.reserve_job(f"b-{free[0]}", 2)


class TestBeginAttempts:
    async def test_one_write_begins_each_and_says_what_refused_the_rest(
            self, backend: Backend) -> None:
        from supervisor.errors import IllegalTransition, OperationBusy

        run = await discovered_run(backend, ["r-1", "r-2", "r-3", "r-4"])
        ops = await backend.ledger.list_operations(run.id, None, None, 100)
        a, b, c, d = (op.id for op in ops)
        held = await backend.ledger.begin_attempt(b, "delete", owner="other", busy_s=60.0)
        await backend.ledger.settle([Settlement(c, OpState.DELETED, None, outcome="deleted",
                                                attempt_id=await backend.ledger.begin_attempt(
                                                    c, "delete"))])
        got = await backend.ledger.begin_attempts(
            [(a, "me"), (b, "me"), (c, "me"), (d, "me"), ("op_nope", "me")], "delete", 30.0)
        assert isinstance(got[0], int)
        assert isinstance(got[3], int)
        assert isinstance(got[1], OperationBusy)
        assert isinstance(got[2], IllegalTransition)
        assert isinstance(got[4], KeyError)
        # The refused ones are untouched: b still held by the other owner's attempt.
        assert (await backend.ledger.get_operation(b)).attempts == 1  # type: ignore[union-attr]
        assert await backend.ledger.owns_attempt(b, held, "other", 1.0)
        op_a = await backend.ledger.get_operation(a)
        assert op_a is not None
        assert (op_a.state, op_a.attempts, op_a.unfinished_attempt) == (OpState.IN_FLIGHT, 1, True)
        # The same owner begins again, superseding its own open attempt (a resend under
        # the same key).
        again = await backend.ledger.begin_attempts([(a, "me")], "delete", 30.0)
        assert isinstance(again[0], int)
        assert again[0] != got[0]


class TestBatchOwnership:
    """Right before a batch leaves, which members are still their deliveries'
    (supervisor/ownership.py, Ownership.still_owned): one read, a short hold extended,
    a lost one named."""

    async def test_a_short_hold_is_extended_and_a_lost_one_named(self, backend: Backend) -> None:
        from supervisor.budget.local import LocalBudget
        from supervisor.budget.settings import LimitsConfig
        from supervisor.ownership import Ownership

        ledger, queue = backend.ledger, backend.queue
        await discovered_run(backend, ["a", "b", "c", "d"])
        ds = await queue.receive(4, 60)
        ops = [d.message.operation_id for d in ds]
        owned = Ownership(ledger, LocalBudget(LimitsConfig(), key="p"), cover_s=2.0,
                          slack_s=5.0)
        # a: held long enough. b: held, but for less than the request's bound (the token
        # came late): extended. c: its hold ran out. d: a later attempt superseded it.
        a = await ledger.begin_attempt(ops[0], "delete", owner="l-a", busy_s=30)
        b = await ledger.begin_attempt(ops[1], "delete", owner="l-b", busy_s=1.0)
        c = await ledger.begin_attempt(ops[2], "delete", owner="l-c", busy_s=0.01)
        d = await ledger.begin_attempt(ops[3], "delete", owner="l-d", busy_s=30)
        await ledger.begin_attempt(ops[3], "delete", owner="l-d", busy_s=30,
                                   supersedes_open=True)
        await asyncio.sleep(0.05)  # c's hold is a deadline on a clock: let it pass
        claims = [(ops[0], a, "l-a"), (ops[1], b, "l-b"), (ops[2], c, "l-c"),
                  (ops[3], d, "l-d")]
        assert await owned.still_owned(claims) == {ops[0], ops[1]}
        assert await ledger.owns_attempt(ops[1], b, "l-b", 2.0)  # b's hold now covers it
        assert await owned.still_owned([]) == set()


    async def test_holds_are_renewed_while_a_sender_works_and_never_taken_back(
            self, backend: Backend) -> None:
        from supervisor.budget.local import LocalBudget
        from supervisor.budget.settings import LimitsConfig
        from supervisor.ownership import Ownership

        ledger = backend.ledger
        run = await discovered_run(backend, ["a", "b", "c"])
        a, b, c = (op.id for op in await ledger.list_operations(run.id, None, None, 10))
        # Holds of 60 s (a request's bound of 60 s, a slack of 40 ms), renewed every
        # 20 ms: a renewal shows as a hold far longer than the 20 s each attempt was
        # begun with, whatever the host's pace.
        owned = Ownership(ledger, LocalBudget(LimitsConfig(), key="p"), cover_s=60.0,
                          slack_s=0.04)
        held = await ledger.begin_attempt(a, "delete", owner="me", busy_s=20.0)
        unheld = await ledger.begin_attempt(c, "delete", owner="me", busy_s=20.0)
        # b's hold ran out and another owner took it before the sender got to it.
        lapsed = await ledger.begin_attempt(b, "delete", owner="me", busy_s=0.01)
        await asyncio.sleep(0.05)  # a hold is a deadline on a clock: let it pass
        [theirs] = await ledger.begin_attempts([(b, "them")], "delete", 20.0)
        assert isinstance(theirs, int)
        async with owned.holding([(a, held, "me"), (b, lapsed, "me")]):
            await eventually(lambda: ledger.owns_attempt(a, held, "me", 30.0),
                             what="a's hold renewed")
            # Renewed again and again (a renewal every 20 ms; a wrong one would show in
            # any of them): b never taken back, c (not claimed) left alone.
            for _ in range(3):
                await asyncio.sleep(0.02)
                assert await ledger.owns_attempt(b, theirs, "them", 1.0)
                assert not await ledger.owns_attempt(b, lapsed, "me", 0.0)
        assert not await ledger.owns_attempt(c, unheld, "me", 30.0)
        assert await ledger.owns_attempt(c, unheld, "me", 0.0)  # held all the same, as begun
        # b's hold is still the one its owner took: 20 s, not a renewal's 60.
        assert not await ledger.owns_attempt(b, theirs, "them", 30.0)

    async def test_a_wait_for_a_token_ends_once_a_hold_is_found_taken(
            self, backend: Backend) -> None:
        """A batch waiting through a pause for the token it would go again with stops
        waiting when one of its holds turns out to be another owner's: it could not go."""
        from supervisor import metrics
        from supervisor.budget.base import Feedback, Outcome
        from supervisor.budget.local import LocalBudget
        from supervisor.budget.settings import LimitsConfig
        from supervisor.ownership import Ownership

        ledger = backend.ledger
        run = await discovered_run(backend, ["a", "b"])
        a, b = (op.id for op in await ledger.list_operations(run.id, None, None, 10))
        budget = LocalBudget(LimitsConfig(rate_per_second=10), key="p")
        owned = Ownership(ledger, budget, cover_s=60.0, slack_s=0.04)
        # The partner said to wait an hour (the budget waits its longest, 15 minutes).
        budget.release(await budget.acquire(1),
                       Feedback(Outcome.THROTTLED, 0.01, retry_after_s=3600))
        held = await ledger.begin_attempt(a, "delete", owner="me", busy_s=20.0)
        lapsed = await ledger.begin_attempt(b, "delete", owner="me", busy_s=0.01)
        await asyncio.sleep(0.05)  # a hold is a deadline on a clock: let it pass
        await ledger.begin_attempts([(b, "them")], "delete", 20.0)

        async with owned.holding([(a, held, "me")]) as mine:
            waiting = asyncio.create_task(owned.acquire_held(mine, 1))
            assert await still_waiting(waiting, 0.3)  # renewed, no token before the pause ends
            waiting.cancel()
            await asyncio.wait([waiting])
        not_sent = metrics.ATTEMPTS_NOT_SENT._value.get()
        async with owned.holding([(a, held, "me"), (b, lapsed, "me")]) as mine:
            async with asyncio.timeout(30):  # not the pause
                assert await owned.acquire_held(mine, 1, after_s=0.01) is None
        assert mine.lost == {b}
        assert metrics.ATTEMPTS_NOT_SENT._value.get() - not_sent == 1  # b's, counted once
        assert await ledger.owns_attempt(a, held, "me", 30.0)  # a's hold kept all along

    async def test_a_token_come_as_its_wait_is_abandoned_goes_back_if_cancelled_again(
            self, backend: Backend) -> None:
        """A worker cancelled as its token came hands the token back while it stops
        waiting; a second cancellation there (a shutdown's on top) must not drop it: the
        budget's one slot would be gone for the life of the process."""
        from supervisor.budget.base import Feedback, Outcome
        from supervisor.budget.local import LocalBudget
        from supervisor.budget.settings import LimitsConfig
        from supervisor.ownership import Ownership

        budget = LocalBudget(LimitsConfig(concurrency=1), key="p")
        owned = Ownership(backend.ledger, budget, cover_s=60.0)
        waiting = asyncio.ensure_future(budget.acquire(1))
        await asyncio.wait([waiting])  # the token came: the only slot is its
        assert waiting.result() is not None
        abandoning = asyncio.create_task(owned._abandon(waiting))
        await asyncio.sleep(0)  # it is in its wait for the wait to end...
        abandoning.cancel()  # ...and cancelled there
        await asyncio.wait([abandoning])
        async with asyncio.timeout(10):  # a bound, not a pace: the slot is free or never
            grant = await budget.acquire(1)
        budget.release(grant, Feedback(Outcome.OTHER))

    async def test_a_token_come_in_the_instant_a_hold_is_lost_goes_back(
            self, backend: Backend) -> None:
        """The batch's token and the news that one of its holds is another owner's come
        in the same instant: the batch cannot go, and the token goes back unused (the
        budget's one slot would be gone for the life of the process)."""
        from supervisor.budget.base import Feedback, Outcome
        from supervisor.budget.local import LocalBudget
        from supervisor.budget.settings import LimitsConfig
        from supervisor.ownership import Held, Ownership

        budget = LocalBudget(LimitsConfig(concurrency=1), key="p")
        owned = Ownership(backend.ledger, budget, cover_s=60.0)
        taken = await budget.acquire(1)  # the one slot is another sender's
        held = Held()
        waiting = asyncio.create_task(owned.acquire_held(held, 1))
        assert await still_waiting(waiting, 0.05)  # queued for the slot
        budget.release(taken, Feedback(Outcome.OTHER))  # the slot is its...
        held.give_up(["b"])  # ...as it learns b is another owner's
        assert await waiting is None
        async with asyncio.timeout(10):  # a bound, not a pace: the slot is free or never
            grant = await budget.acquire(1)
        budget.release(grant, Feedback(Outcome.OTHER))


class TestBatchClosing:
    @pytest.mark.parametrize("n", [2, 10, 50])
    async def test_items_settled_at_once_each_in_its_own_commit_close_their_batch(
            self, backend: Backend, n: int) -> None:
        # The sender settles a batch's items concurrently, one commit each (one refused
        # must not undo the others): on PostgreSQL, two commits closing the last two
        # attempts at once each saw the other's open, and the batch stayed open (4 times
        # in 5 at 10 and 50 items before each batch's close took its lock).
        await _batch_of(backend, [f"r-{i}" for i in range(n)])
        members = await backend.ledger.batch_members("b-1")
        await asyncio.gather(*(backend.ledger.settle([Settlement(
            m.operation_id, OpState.RETRY_WAIT, None, attempt_id=m.attempt_id,
            outcome="transient", detail="batch b-1 found the partner's job limit reached",
            batch_id="b-1")]) for m in members))
        assert all(m.outcome == "transient" for m in await backend.ledger.batch_members("b-1"))
        batch = await backend.ledger.get_batch("b-1")
        assert batch is not None
        assert batch.state == "closed", batch


class TestTakingABatch:
    """A batch sent again after its sender stopped is taken first
    (supervisor/consumer/batch_recovery.py): every open member held for one sender in
    one commit, or none, so two replicas never send it again at once."""

    async def test_the_open_members_are_held_for_the_taker_and_a_settled_one_left(
            self, backend: Backend) -> None:
        op_ids = await _batch_of(backend, ["r-1", "r-2", "r-3"], shape="per_item")
        members = await backend.ledger.batch_members("b-1")
        await backend.ledger.settle([Settlement(op_ids[0], OpState.DELETED, None,
                                                attempt_id=members[0].attempt_id,
                                                outcome="deleted", status=200)])
        taken = await backend.ledger.take_batch("b-1", "again-1", 30.0)
        assert taken is not None
        assert [m.operation_id for m in taken] == op_ids  # every id it carried, in order
        assert [m.outcome for m in taken] == ["deleted", None, None]
        for m in taken[1:]:
            assert await backend.ledger.owns_attempt(m.operation_id, m.attempt_id,
                                                     "again-1", 1.0)
            op = await backend.ledger.get_operation(m.operation_id)
            assert op is not None
            assert (op.state, op.attempts) == (OpState.IN_FLIGHT, 1)  # the same attempt
        # Another sender is refused while the holds last.
        assert await backend.ledger.take_batch("b-1", "again-2", 30.0) is None

    async def test_concurrent_takers_one_wins(self, backend: Backend) -> None:
        await _batch_of(backend, [f"r-{i}" for i in range(20)], shape="per_item")
        got = await asyncio.gather(*(backend.ledger.take_batch("b-1", f"again-{k}", 30.0)
                                     for k in range(5)))
        winners = [k for k, g in enumerate(got) if g is not None]
        assert len(winners) == 1, got
        for m in await backend.ledger.batch_members("b-1"):
            assert await backend.ledger.owns_attempt(m.operation_id, m.attempt_id,
                                                     f"again-{winners[0]}", 1.0)

    async def test_one_member_held_by_a_delivery_takes_none(self, backend: Backend) -> None:
        run = await discovered_run(backend, ["r-1", "r-2"])
        a, b = (op.id for op in await backend.ledger.list_operations(run.id, None, None, 10))
        first = await backend.ledger.begin_attempt(a, "delete")
        second = await backend.ledger.begin_attempt(b, "delete", owner="delivery-b",
                                                    busy_s=60.0)
        await backend.ledger.record_batch(Batch("b-1", "per_item", 2, "sent", 0.0),
                                          [(first, 0), (second, 1)])
        assert await backend.ledger.take_batch("b-1", "again-1", 30.0) is None
        # Nothing was taken: a's attempt is not the taker's, b is still the delivery's.
        assert not await backend.ledger.owns_attempt(a, first, "again-1", 1.0)
        assert await backend.ledger.owns_attempt(b, second, "delivery-b", 1.0)

    async def test_a_closed_or_unknown_batch_is_not_taken(self, backend: Backend) -> None:
        await _batch_of(backend, ["r-1"], shape="per_item")
        await backend.ledger.update_batch("b-1", "closed")
        assert await backend.ledger.take_batch("b-1", "again-1", 30.0) is None
        assert await backend.ledger.take_batch("b-nope", "again-1", 30.0) is None


@pytest.fixture(params=["sqlite", "sqlite-transport", "postgres"])
def settling_target(request: pytest.FixtureRequest) -> tuple[str, Any]:
    """Both of SQLite's settlements: the group commit's vectorised one (its own queue)
    and the core's, one by one (beside a transport); PostgreSQL's."""
    return _target(request)


@pytest.fixture
async def every_settlement(settling_target: tuple[str, Any],
                           tmp_path: Path) -> AsyncIterator[Backend]:
    async with open_backend(settling_target[0], tmp_path, settling_target[1]) as b:
        yield b


class TestSettlingATakenBatch:
    """A batch's attempt is carried on by its taker (the same attempt, the same key): the
    first sender's outcome, should it come after all (it stalled past its hold), is not
    written over the taker's."""

    async def test_only_the_owner_writes_the_outcome(self, every_settlement: Backend) -> None:
        ledger = every_settlement.ledger
        names = ["r-1", "r-2", "r-3", "r-4"]
        if every_settlement.embedded is not None:
            run = await discovered_run(every_settlement, names)
            deliveries = await every_settlement.queue.receive(4, 60)
        else:
            run, deliveries = await transported_run(ledger, names)
        ids = [op.id for op in await ledger.list_operations(run.id, None, None, 10)]
        delivery = {d.message.operation_id: d for d in deliveries}
        # A hold of a hundredth of a second: the sender stalls past it.
        begun = await ledger.begin_attempts([(i, "sender") for i in ids[:3]], "delete", 0.01)
        [alone] = await ledger.begin_attempts([(ids[3], "sender")], "delete", 0.01)
        attempts = [a for a in begun if isinstance(a, int)]
        assert len(attempts) == 3
        assert isinstance(alone, int)
        await ledger.record_batch(Batch("b-1", "per_item", 3, "sent", 0.0),
                                  [(a, pos) for pos, a in enumerate(attempts)])
        await asyncio.sleep(0.05)  # a hold is a deadline on a clock: let it pass
        assert await ledger.take_batch("b-1", "taker", 30.0) is not None

        def outcome(i: int, owner: str, target: OpState, verdict: str) -> Settlement:
            return Settlement(ids[i], target, None, attempt_id=attempts[i], outcome=verdict,
                              detail=f"by {owner}", batch_id="b-1", owner=owner)

        # The stalled sender's answer comes first for r-1: not written, its message not
        # acked (the taker settles on the ledger alone: the message must come back to
        # move on what it writes), r-1 still the taker's; then the taker's is written.
        late = await ledger.settle([replace(outcome(0, "sender", OpState.DELETED, "deleted"),
                                            delivery=delivery[ids[0]])])
        assert late == Settled([], frozenset({ids[0]}))
        op = await ledger.get_operation(ids[0])
        assert op is not None
        assert op.state is OpState.IN_FLIGHT
        assert await ledger.owns_attempt(ids[0], attempts[0], "taker", 1.0)
        # r-2, r-3: both answers in one group commit, in either order.
        await asyncio.gather(
            ledger.settle([outcome(0, "taker", OpState.RETRY_WAIT, "transient")]),
            ledger.settle([outcome(1, "sender", OpState.DELETED, "deleted")]),
            ledger.settle([outcome(1, "taker", OpState.RETRY_WAIT, "transient")]),
            ledger.settle([outcome(2, "taker", OpState.RETRY_WAIT, "transient")]),
            ledger.settle([outcome(2, "sender", OpState.DELETED, "deleted")]))
        members = await ledger.batch_members("b-1")
        assert [m.outcome for m in members] == ["transient"] * 3  # the taker's, each
        for i in ids[:3]:
            op = await ledger.get_operation(i)
            assert op is not None
            assert op.state is OpState.RETRY_WAIT, op
        batch = await ledger.get_batch("b-1")
        assert batch is not None
        assert batch.state == "closed"
        # A hold that only ran out, taken by nobody: its sender's answer is the evidence.
        await ledger.settle([Settlement(ids[3], OpState.DELETED, None, attempt_id=alone,
                                        outcome="deleted", owner="sender")])
        op = await ledger.get_operation(ids[3])
        assert op is not None
        assert op.state is OpState.DELETED
