"""The consumer pool through a transport with none of the optional capabilities: the
Infrai adapter against the emulator, the SQLite ledger keeping the bookkeeping, the
partner simulator on loopback. Ack after commit as a second step, reposts instead of
nack and extend, redeliveries recognised by the ledger."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from cleanup_sandbox import SandboxConfig, run_sandbox
from cleanup_sandbox.infrai import Emulator
from supervisor import metrics
from supervisor.budget.local import LocalBudget
from supervisor.budget.settings import LimitsConfig
from supervisor.config import Config, PartnerConfig
from supervisor.consumer import ConsumerPool
from supervisor.infrai.queue import InfraiQueue
from supervisor.model import Disposition, Settlement
from supervisor.partner import PartnerClient
from supervisor.queue.courier import Courier
from supervisor.queue.settings import QueueConfig
from supervisor.redrive import Redriver
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.states import TERMINAL, OpState
from tests.helpers import infrai_config

N = 40


@dataclass
class Rig:
    ledger: SqliteLedger
    queue: InfraiQueue
    emulator: Emulator
    partner_url: str
    run_id: str


@pytest.fixture
def emulator_options() -> dict[str, Any]:
    return {"seed": 11}


@pytest.fixture
async def rig(db: Database, emulator: Emulator) -> AsyncIterator[Rig]:
    ledger = SqliteLedger(db, owns_queue=False)
    queue = InfraiQueue(infrai_config(emulator, queue="ops"))
    await queue.start()
    opened = await ledger.open_run("weekly@1", "weekly", None, {"kind": "inline"}, False)
    assert opened.run is not None
    await ledger.record_page(opened.run.id, [f"r-{i:06d}" for i in range(1, N + 1)], None, 0)
    await Courier(ledger, queue).publish(await ledger.unpublished(1000))
    try:
        yield Rig(ledger, queue, emulator, "", opened.run.id)
    finally:
        await queue.close()


def service_config(partner_url: str, lease_s: float = 30.0) -> Config:
    return Config(queue=QueueConfig(lease_seconds=lease_s, poll_interval_seconds=0.05,
                                    prefetch=2),
                  partner=PartnerConfig(base_url=partner_url, backoff_initial_seconds=0.05,
                                        backoff_max_seconds=0.2),
                  limits=LimitsConfig(rate_per_second=200, concurrency=4))


async def drain(rig: Rig, config: Config, budget: LocalBudget | None = None,
                within_s: float = 30, on_first: Callable[[], None] | None = None) -> None:
    partner = PartnerClient(config.partner, config.limits.concurrency)
    await partner.start()
    done = asyncio.Event()
    budget = budget or LocalBudget(config.limits, key="test")
    first = [on_first]

    def settled() -> None:
        if first[0] is not None:
            first.pop()()
            first.append(None)
        asyncio.get_running_loop().create_task(check())

    async def check() -> None:
        counts = await rig.ledger.run_counts(rig.run_id)
        if sum(n for s, n in counts.items() if s in TERMINAL) == N:
            done.set()

    pool = ConsumerPool(config, rig.ledger, rig.queue, budget, partner, on_settled=settled)
    task = asyncio.create_task(pool.run())
    try:
        async with asyncio.timeout(within_s):
            await done.wait()
    finally:
        await pool.stop(2.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await partner.close()


async def test_a_run_drains_through_a_transport_without_nack_or_extend(rig: Rig) -> None:
    async with run_sandbox(SandboxConfig(recipients=N, absent_share=0.1,
                                         rate_per_second=0)) as sandbox:
        await drain(rig, service_config(sandbox.url))
        stats = sandbox.state.stats()
    assert stats["duplicates"] == 0
    counts = await rig.ledger.run_counts(rig.run_id)
    assert stats["executions"] == N  # one DELETE executed per operation, no more
    assert counts[OpState.DELETED] + counts.get(OpState.ALREADY_ABSENT, 0) == N
    # Every message was acked after its outcome committed: nothing is left in Infrai.
    q = rig.emulator.state.stats()["ops"]
    assert q["visible"] + q["leased"] + q["delayed"] == 0, q
    s = await rig.ledger.queue_stats()
    assert (s.depth, s.parked, s.leased) == (0, 0, 0)


async def test_a_pause_longer_than_the_visibility_timeout_reposts_and_never_doubles(
        rig: Rig) -> None:
    """Lease 2 s; after the first deletion the partner answers 429 with a Retry-After of
    4 s: every worker holding a throttled message publishes it again for when the pause
    ends and acks its copy, and nothing more is taken meanwhile; no two attempts of one
    operation in flight, nothing lost."""
    reposts = metrics.QUEUE_REPOSTS._value.get()
    async with run_sandbox(SandboxConfig(recipients=N, absent_share=0.0,
                                         rate_per_second=0)) as sandbox:
        config = service_config(sandbox.url, lease_s=2.0)
        await drain(rig, config,
                    on_first=lambda: sandbox.state.apply_control({"pause_seconds": 4.0}))
        stats = sandbox.state.stats()
    assert stats["executions"] == N
    assert stats["duplicates"] == 0
    assert stats["rate_limited"] >= 1
    reposted = metrics.QUEUE_REPOSTS._value.get() - reposts
    # Only what was held when the pause began (workers and prefetch), not the backlog.
    assert 0 < reposted <= config.limits.concurrency + 2, reposted
    for op in await rig.ledger.list_operations(rig.run_id, None, None, N):
        attempts = await rig.ledger.attempts(op.id)
        # Throttled attempts are refunded, not failed; one attempt deleted each. An
        # attempt written before the pause began and waiting for its token then is
        # closed unsent (no status: nothing reached the partner), not left open.
        deleting = [a for a in attempts if a.outcome == "deleted"]
        assert len(deleting) == 1, attempts
        unsent = [a for a in attempts if a.outcome == "transient"]
        assert all(a.status is None and (a.detail or "").startswith("not sent:")
                   for a in unsent), attempts
        assert {a.outcome for a in attempts} <= {"deleted", "throttled", "transient"}, attempts


async def test_a_crash_between_commit_and_ack_redelivers_and_is_acked_without_a_call(
        rig: Rig) -> None:
    """The outcome committed, the ack never sent (the process died): the redelivered
    message finds its operation settled and is acked without a partner call."""
    [d] = await rig.queue.receive(1, 1)
    await rig.ledger.note_received([d], 1)
    op_id = d.message.operation_id
    attempt = await rig.ledger.begin_attempt(op_id, "delete", owner=d.receipt, busy_s=30)
    leftover = await rig.ledger.settle([Settlement(op_id, OpState.DELETED, d, attempt_id=attempt,
                                                   status=204, outcome="deleted")])
    assert [s.delivery for s in leftover.leftovers] == [d]  # the transport must still ack it
    rig.emulator.advance(2)  # ... which never happens; its visibility timeout ends
    async with run_sandbox(SandboxConfig(recipients=N, absent_share=0.0,
                                         rate_per_second=0)) as sandbox:
        # Only the other N - 1 remain for the partner.
        await drain_until(rig, service_config(sandbox.url), N)
        assert sandbox.state.executions_of(d.message.recipient_id) == 0
        assert sandbox.state.stats()["executions"] == N - 1
    acks = [c for c in rig.emulator.calls if c["capability"] == "queue.ack"
            and d.message_id in c["message_ids"]]
    assert acks, "the redelivered message of a settled operation was never acked"


async def drain_until(rig: Rig, config: Config, settled: int) -> None:
    # The pre-settled one counts: the run is complete when all N are deleted.
    await drain(rig, config)
    counts = await rig.ledger.run_counts(rig.run_id)
    assert counts == {OpState.DELETED: settled}, counts


async def test_duplicate_deliveries_never_double_an_attempt(rig: Rig) -> None:
    rig.emulator.set_faults(duplicate_share=0.5)
    async with run_sandbox(SandboxConfig(recipients=N, absent_share=0.0,
                                         rate_per_second=0)) as sandbox:
        await drain(rig, service_config(sandbox.url))
        stats = sandbox.state.stats()
    assert stats["executions"] == N
    assert stats["duplicates"] == 0
    assert rig.emulator.state.stats()["ops"]["duplicates_injected"] > 0


async def test_redrive_publishes_a_message_infrai_lost(rig: Rig) -> None:
    # Infrai loses one message (retention, a purge by hand): only the ledger's age tells.
    [d] = await rig.queue.receive(1, 30)
    await rig.queue.ack([d])
    while held := await rig.queue.receive(10, 30):  # a consumer holds every other one
        await rig.ledger.note_received(held, 30)
    redriver = Redriver(QueueConfig(redrive_grace_seconds=0.001), rig.ledger, rig.queue)
    await asyncio.sleep(0.01)  # the grace is wall-clock age, not a synchronisation
    assert await redriver.sweep() == 1
    [again] = await rig.queue.receive(1, 30)
    assert again.message == d.message
    assert again.message_id != d.message_id


async def test_poison_is_found_from_the_ledgers_own_receive_count(rig: Rig) -> None:
    """Infrai reports no receive count: a message delivered again and again without an
    outcome (its holder dies each time) is failed from the ledger's count, unsent."""
    [d] = await rig.queue.receive(1, 1)
    for _ in range(3):
        await rig.ledger.note_received([d], 1)
        rig.emulator.advance(2)
        [d] = [x for x in await rig.queue.receive(10, 1) if x.message_id == d.message_id] or [d]
    async with run_sandbox(SandboxConfig(recipients=N, absent_share=0.0,
                                         rate_per_second=0)) as sandbox:
        config = service_config(sandbox.url)
        config = Config(queue=QueueConfig(lease_seconds=30, poll_interval_seconds=0.05,
                                          max_receives=3), partner=config.partner,
                        limits=config.limits)
        await drain(rig, config)
        assert sandbox.state.executions_of(d.message.recipient_id) == 0
    op = await rig.ledger.get_operation(d.message.operation_id)
    assert op is not None
    assert op.state is OpState.FAILED
    assert "received 4 times without an outcome" in (op.reason or "")


async def test_queue_gauges_come_from_the_ledger_when_the_transport_has_none(rig: Rig) -> None:
    """No stats from Infrai: depth is what is claimable now, parked what waits for a
    delayed retry, leased what a consumer holds; the age is the oldest claimable one's."""
    assert not rig.queue.capabilities.stats
    held = await rig.queue.receive(2, 30)
    await rig.ledger.note_received(held, 30)
    s = await rig.ledger.queue_stats()
    assert (s.depth, s.parked, s.leased) == (N - 2, 0, 2)
    assert s.oldest_claimable_age_s >= 0
    # One of the held ones waits for a retry in a minute: parked, not claimable, not aged.
    d = held[0]
    attempt = await rig.ledger.begin_attempt(d.message.operation_id, "delete",
                                             owner=d.receipt, busy_s=30)
    [left] = (await rig.ledger.settle([Settlement(
        d.message.operation_id, OpState.RETRY_WAIT, d, Disposition.RETRY, delay_s=60,
        attempt_id=attempt, status=503, outcome="transient")])).leftovers
    await Courier(rig.ledger, rig.queue).follow_up([left])
    s = await rig.ledger.queue_stats()
    assert (s.depth, s.parked, s.leased) == (N - 2, 1, 1)
    q = rig.emulator.state.stats()["ops"]
    assert q["delayed"] == 1  # the repost, published with delay_seconds


async def test_a_wait_past_seven_days_stays_in_the_ledger_until_due(rig: Rig) -> None:
    """Infrai delays at most 7 days: a longer wait publishes nothing; the ledger keeps
    the operation without a live message, and redrive publishes it once it is due."""
    courier = Courier(rig.ledger, rig.queue)
    [d] = await rig.queue.receive(1, 30)
    published = len([c for c in rig.emulator.calls if c["capability"] == "queue.publish"])
    eight_days = 8 * 86400.0
    await courier.retry_later(d, eight_days)
    assert len([c for c in rig.emulator.calls
                if c["capability"] == "queue.publish"]) == published  # nothing sent
    op = await rig.ledger.get_operation(d.message.operation_id)
    assert op is not None
    assert op.due_at is not None
    assert op.due_at >= time.time() + eight_days - 5
    now = time.time()
    assert d.message not in await rig.ledger.overdue(None, now, 100)  # not due yet
    assert d.message in await rig.ledger.overdue(None, now + eight_days + 1, 100)
