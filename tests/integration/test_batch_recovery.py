"""A batch found again after its sender died is taken, then waits for its token
(supervisor/consumer/batch_recovery.py): in one process, on a real SQLite ledger and
queue, against the partner simulator's per-item batch endpoint honouring keys.

The wait may be long: a partner's ``Retry-After`` pauses the budget. The batch's holds
are renewed through it, so when the token comes the batch is still this sender's and
goes, once, under its key. A hold left to run out meanwhile was read as lost, and the
batch was left for a later copy of one of its messages to find again."""

from __future__ import annotations

import asyncio

from cleanup_sandbox import SandboxConfig, run_sandbox
from supervisor.batchsettings import BatchConfig
from supervisor.budget.base import Feedback, Outcome
from supervisor.budget.local import LocalBudget
from supervisor.budget.settings import LimitsConfig
from supervisor.config import Config, PartnerConfig
from supervisor.consumer.batches import BatchSender
from supervisor.consumer.decide import Rules
from supervisor.consumer.settler import Settler
from supervisor.model import Batch
from supervisor.ownership import Ownership
from supervisor.partner import PartnerClient
from supervisor.queue.courier import Courier
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue
from supervisor.states import OpState

N = 3
# The budget's pause: twice a taken batch's hold (the request's bound of 1 s, the slack
# of 2 s and the wait for one token behind the others in the air). Renewed every second
# (half the slack), a hold outlasts any stall of the host shorter than 2 s.
PAUSE_S = 6.0


async def test_a_taken_batch_keeps_its_holds_through_a_long_pause(db: Database) -> None:
    ledger, queue = SqliteLedger(db, owns_queue=True), SqliteQueue(db)
    opened = await ledger.open_run("weekly@1", "weekly", None, {"kind": "inline"}, False)
    assert opened.run is not None
    await ledger.record_page(opened.run.id, [f"r-{i:06d}" for i in range(1, N + 1)], None, 0)
    courier = Courier(ledger, queue)
    await courier.publish(await ledger.unpublished(100))
    deliveries = await queue.receive(N, 60)
    # A sender wrote the batch, sent it and died: its holds have run out.
    begun = await ledger.begin_attempts([(d.message.operation_id, "dead-sender")
                                         for d in deliveries], "delete", 0.01)
    attempts = [a for a in begun if isinstance(a, int)]
    assert len(attempts) == N
    await ledger.record_batch(Batch("b-lost", "per_item", N, "sent", 0.0),
                              [(a, pos) for pos, a in enumerate(attempts)])
    await asyncio.sleep(0.05)  # a hold is a deadline on a clock: let it pass

    async with run_sandbox(SandboxConfig(recipients=N, absent_share=0.0, rate_per_second=0,
                                         batch_shape="per_item")) as sandbox:
        config = Config(
            partner=PartnerConfig(base_url=sandbox.url, connect_timeout_seconds=0.5,
                                  request_timeout_seconds=0.5, idempotency_keys=True),
            limits=LimitsConfig(rate_per_second=50, concurrency=2),
            batch=BatchConfig(shape="per_item", path="/recipients/batch-delete",
                              max_items=50, linger_seconds=0.02))
        budget = LocalBudget(config.limits, key="partner")
        partner = PartnerClient(config.partner, 4)
        await partner.start()
        try:
            owned = Ownership(ledger, budget, cover_s=config.partner.request_bound_seconds,
                              slack_s=2.0)
            settler = Settler(ledger, courier, lambda: None)
            sender = BatchSender(config, ledger, budget, partner, courier, settler,
                                 Rules.of(config, queue.capabilities), {}, owned)
            # The partner said to wait: every token waits for the pause to end.
            grant = await budget.acquire(1)
            budget.release(grant, Feedback(Outcome.THROTTLED, 0.01, retry_after_s=PAUSE_S))
            op = await ledger.get_operation(deliveries[0].message.operation_id)
            assert op is not None
            async with asyncio.timeout(30):
                found, _ = await sender.recover(deliveries[0], op)
            assert found
            stats = sandbox.state.stats()
        finally:
            await partner.close()
    # Sent again once, the same batch under its key, after the pause.
    assert stats["batch_requests"] == 1, stats
    assert (stats["executions"], stats["duplicates"]) == (N, 0), stats
    ops = await ledger.get_operations([d.message.operation_id for d in deliveries])
    assert {o.state for o in ops.values()} == {OpState.DELETED}, ops
