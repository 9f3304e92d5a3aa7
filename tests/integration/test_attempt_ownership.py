"""An attempt is owned from the moment it is written until it is settled (review M1).

The probe in one process: two consumer pools (two replicas, in effect) share one SQLite
ledger, one rate budget and one Infrai queue (the emulator: no extend, no nack, a short
visibility timeout), against the partner simulator honouring Idempotency-Key. The first
pool takes every message; tokens are slow, so its workers wait for them with attempts
written. After the first outcome the partner answers 429 with a Retry-After longer than
``long_pause_seconds`` and than an attempt's in-flight guard, and the second pool starts.
Every message held meanwhile outlives its visibility timeout, and the second pool
receives it again once the pause ends: a second delivery of an operation whose first
attempt was written before the pause.

What must hold, read from the partner's own counters and log: no operation has two
DELETEs in the air (the partner answers 409 to a key in progress), none gets a second
DELETE after its first was answered (a replay), each recipient is deleted once. No answer
was lost on the way (no timeout, no reset), so no second DELETE is ever justified.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from cleanup_sandbox import SandboxConfig, run_sandbox
from cleanup_sandbox.infrai import Emulator
from supervisor.budget.local import LocalBudget
from supervisor.budget.settings import LimitsConfig
from supervisor.config import Config, PartnerConfig
from supervisor.consumer import ConsumerPool
from supervisor.infrai.queue import InfraiQueue
from supervisor.partner import PartnerClient
from supervisor.queue.courier import Courier
from supervisor.queue.settings import QueueConfig
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.states import TERMINAL, OpState
from tests.helpers import infrai_config

# What the first pool takes in one receive (its idle workers and its prefetch).
WORKERS = 6
PREFETCH = 2
N = WORKERS + PREFETCH
# Longer than an attempt's guard (connect + request + slack below = 7 s) and than the
# visibility timeout, and above long_pause_seconds: the partner's own pause.
PAUSE_S = 9.0


@dataclass
class Rig:
    ledger: SqliteLedger
    queues: list[InfraiQueue]
    run_id: str


@pytest.fixture
def emulator_options() -> dict[str, Any]:
    return {"seed": 17}


@pytest.fixture
async def rig(db: Database, emulator: Emulator) -> AsyncIterator[Rig]:
    ledger = SqliteLedger(db, owns_queue=False)
    queues = [InfraiQueue(infrai_config(emulator, queue="ops")) for _ in range(2)]
    for q in queues:
        await q.start()
    opened = await ledger.open_run("weekly@1", "weekly", None, {"kind": "inline"}, False)
    assert opened.run is not None
    await ledger.record_page(opened.run.id, [f"r-{i:06d}" for i in range(1, N + 1)], None, 0)
    await Courier(ledger, queues[0]).publish(await ledger.unpublished(1000))
    try:
        yield Rig(ledger, queues, opened.run.id)
    finally:
        for q in queues:
            await q.close()


def service_config(partner_url: str) -> Config:
    return Config(queue=QueueConfig(lease_seconds=2.0, poll_interval_seconds=0.05,
                                    prefetch=PREFETCH),
                  partner=PartnerConfig(base_url=partner_url, connect_timeout_seconds=0.5,
                                        request_timeout_seconds=1.5,
                                        backoff_initial_seconds=0.05, backoff_max_seconds=0.2),
                  # Slow tokens: workers wait for them, attempts written (the old order).
                  limits=LimitsConfig(rate_per_second=8, concurrency=WORKERS,
                                      long_pause_seconds=2.5))


async def test_a_pause_after_attempts_were_written_and_a_second_delivery_send_nothing_twice(
        rig: Rig) -> None:
    async with run_sandbox(SandboxConfig(recipients=N, absent_share=0.0,
                                         rate_per_second=0)) as sandbox:
        config = service_config(sandbox.url)
        budget = LocalBudget(config.limits, key="shared")  # one budget, as replicas share
        partner = PartnerClient(config.partner, 2 * config.limits.concurrency)
        await partner.start()
        done = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []

        def settled() -> None:
            if len(pools) == 1:
                # The first outcome is in: from now on the partner holds everyone with a
                # Retry-After, while the other workers wait for their tokens; and the
                # second replica starts.
                sandbox.state.apply_control({"pause_seconds": PAUSE_S})
                pools.append(ConsumerPool(config, rig.ledger, rig.queues[1], budget, partner,
                                          on_settled=settled))
                tasks.append(asyncio.create_task(pools[1].run()))
            asyncio.get_running_loop().create_task(check())

        async def check() -> None:
            counts = await rig.ledger.run_counts(rig.run_id)
            if sum(n for s, n in counts.items() if s in TERMINAL) == N:
                done.set()

        pools = [ConsumerPool(config, rig.ledger, rig.queues[0], budget, partner,
                              on_settled=settled)]
        tasks.append(asyncio.create_task(pools[0].run()))
        try:
            async with asyncio.timeout(60):
                await done.wait()
        finally:
            for p in pools:
                await p.stop(2.0)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await partner.close()
        counters = sandbox.state.counters
        executions = [e.recipient_id for e in sandbox.state.log]
    # The probe did what it is for: the pause landed after attempts were written.
    assert counters.rate_limited >= 1
    assert counters.requests_during_pause >= 1
    assert len(pools) == 2
    # No answer was lost: every attempt sent has the partner's status, so no second
    # DELETE of any operation was ever justified.
    ops = await rig.ledger.list_operations(rig.run_id, None, None, N)
    attempts = [a for op in ops for a in await rig.ledger.attempts(op.id)]
    assert not [a for a in attempts if a.outcome == "ambiguous"], attempts
    # The partner's own account: nothing in the air twice, nothing sent again.
    assert counters.conflicts == 0  # a key already in progress
    assert counters.replays == 0  # a key already answered
    assert counters.duplicates == 0
    assert sorted(executions) == sorted(op.recipient_id for op in ops)  # each once
    assert {op.state for op in ops} == {OpState.DELETED}
    # Attempts written and waiting for their token when the pause began were closed
    # unsent (then waited the pause out without an open attempt), not sent late.
    unsent = [a for a in attempts if (a.detail or "").startswith("not sent:")]
    assert unsent, attempts
    assert all(a.status is None and a.finished_at is not None for a in unsent)
