"""Each operation counts once in cleanup_operations_total, however it got there; the pool
reports only the workers it has now, after a restart too."""

from __future__ import annotations

import asyncio

from cleanup_sandbox import SandboxConfig, run_sandbox
from supervisor import metrics
from supervisor.budget.local import LocalBudget
from supervisor.budget.settings import LimitsConfig
from supervisor.config import Config, PartnerConfig
from supervisor.consumer import ConsumerPool
from supervisor.partner import PartnerClient
from supervisor.queue.settings import QueueConfig
from supervisor.reconcile import Reconciler
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue
from supervisor.states import OpState
from tests.helpers import ambiguous_operation


def total(outcome: str) -> float:
    return float(metrics.OPERATIONS.labels(outcome)._value.get())


async def test_ambiguous_then_deleted_is_counted_once(ledger: SqliteLedger,
                                                      queue: SqliteQueue) -> None:
    op_id = await ambiguous_operation(ledger, queue)
    metrics.count_settled(OpState.AMBIGUOUS.value)  # as the consumer counts it
    deleted, ambiguous = total("deleted"), metrics.AMBIGUOUS_ENTERED._value.get()
    # The recipient is gone at the partner: the probe finds it absent.
    async with run_sandbox(SandboxConfig(recipients=1, absent_share=1.0)) as sandbox:
        cfg = PartnerConfig(base_url=sandbox.url)
        partner = PartnerClient(cfg, 1)
        await partner.start()
        try:
            reconciler = Reconciler(cfg, ledger, queue, LocalBudget(LimitsConfig(), key="t"),
                                    partner)
            op = await ledger.get_operation(op_id)
            assert op is not None
            await reconciler.probe(op)
        finally:
            await partner.close()
    assert total("deleted") == deleted + 1
    assert metrics.AMBIGUOUS_ENTERED._value.get() == ambiguous  # not a second entry


async def test_a_restarted_pool_reports_only_its_live_workers(
        ledger: SqliteLedger, queue: SqliteQueue) -> None:
    async with run_sandbox(SandboxConfig(recipients=1)) as sandbox:
        config = Config(queue=QueueConfig(poll_interval_seconds=0.05),
                        partner=PartnerConfig(base_url=sandbox.url),
                        limits=LimitsConfig(concurrency=3))
        partner = PartnerClient(config.partner, 3)
        await partner.start()
        pool = ConsumerPool(config, ledger, queue, LocalBudget(config.limits, key="t"),
                            partner, on_settled=lambda: None)
        try:
            for _ in range(2):  # a crash (the task cancelled), then the supervisor's restart
                pool.fetcher.wanted.clear()
                task = asyncio.create_task(pool.run())
                # A worker that starts waiting for a message says so: the pool is up.
                await asyncio.wait_for(pool.fetcher.wanted.wait(), 5)
                assert pool.running
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                assert not pool.running
                assert pool._phases == {}
        finally:
            await partner.close()
