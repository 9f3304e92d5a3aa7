"""An ambiguous operation whose probe stays inconclusive (issue 17, L3): each probe puts the
next one off twice as long, up to partner.probe_backoff_max_seconds, instead of probing
(and writing an attempt row, and spending partner budget) every 30 s forever; a gauge
counts the operations waiting so, for the alert."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from cleanup_sandbox import SandboxConfig, run_sandbox
from supervisor import metrics
from supervisor.budget.local import LocalBudget
from supervisor.budget.settings import LimitsConfig
from supervisor.config import PartnerConfig
from supervisor.monitor import Monitor
from supervisor.partner import PartnerClient, Presence
from supervisor.reconcile import Reconciler
from supervisor.runs import RunWatch
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue
from supervisor.states import OpState
from tests.helpers import ambiguous_operation


@pytest.fixture
async def partner() -> AsyncIterator[tuple[PartnerConfig, PartnerClient]]:
    # The partner wants a token this client does not send: every probe answers 401,
    # neither present nor absent.
    async with run_sandbox(SandboxConfig(recipients=1, token="not-the-clients")) as sandbox:
        cfg = PartnerConfig(base_url=sandbox.url, probe_settle_seconds=30,
                            probe_backoff_max_seconds=100)
        client = PartnerClient(cfg, 1)
        await client.start()
        try:
            yield cfg, client
        finally:
            await client.close()


async def test_an_inconclusive_probe_backs_off_capped_and_is_counted(
        ledger: SqliteLedger, queue: SqliteQueue,
        partner: tuple[PartnerConfig, PartnerClient]) -> None:
    cfg, client = partner
    op_id = await ambiguous_operation(ledger, queue)
    budget = LocalBudget(LimitsConfig(), key="t")
    reconciler = Reconciler(cfg, ledger, queue, budget, client)
    monitor = Monitor(ledger, queue, budget, RunWatch())
    await monitor.refresh()
    assert (await ledger.stats()).inconclusive == 0  # ambiguous, never probed yet
    assert metrics.INCONCLUSIVE._value.get() == 0
    waits = []
    for _ in range(4):
        op = await ledger.get_operation(op_id)
        assert op is not None
        assert await reconciler.probe(op) is Presence.UNKNOWN
        after = await ledger.get_operation(op_id)
        assert after is not None
        assert after.state is OpState.AMBIGUOUS
        assert after.due_at is not None
        waits.append(round(after.due_at - after.updated_at, 6))
    assert waits == [30, 60, 100, 100]  # doubling from probe_settle_seconds, capped
    # Not due: however long it has settled, the reconciler's next pass skips it.
    assert await ledger.ambiguous_due(time.time() + 86400, 10) == []
    log = await ledger.attempts(op_id)
    assert [a.kind for a in log] == ["delete", "probe", "probe", "probe", "probe"]
    assert log[-1].detail == "inconclusive: probe HTTP 401; next probe in 100 s"
    assert (await ledger.stats()).inconclusive == 1
    await monitor.refresh()
    assert metrics.INCONCLUSIVE._value.get() == 1
    # An operator decides: no longer waiting on a probe.
    await reconciler.resolve(after, "deleted", "ops", "checked by hand")
    assert (await ledger.stats()).inconclusive == 0
    await monitor.refresh()
    assert metrics.INCONCLUSIVE._value.get() == 0


async def test_a_put_off_probe_comes_due_again(ledger: SqliteLedger,
                                               queue: SqliteQueue) -> None:
    """The wait puts the probe off, it does not drop it: once past, the operation is due."""
    op_id = await ambiguous_operation(ledger, queue)
    await ledger.record_evidence(op_id, "probe", OpState.AMBIGUOUS, "ambiguous",
                                 "inconclusive: probe HTTP 503", probe_after_s=0.0)
    [due] = await ledger.ambiguous_due(time.time() + 1, 10)
    assert due.id == op_id
    await ledger.record_evidence(op_id, "probe", OpState.AMBIGUOUS, "ambiguous",
                                 "inconclusive: probe HTTP 503", probe_after_s=3600.0)
    assert await ledger.ambiguous_due(time.time() + 1, 10) == []
    # Queued again on evidence: due at once, the put-off forgotten.
    await ledger.record_evidence(op_id, "operator", OpState.QUEUED, "retry", "operator: retry")
    op = await ledger.get_operation(op_id)
    assert op is not None
    assert op.due_at is not None
    assert op.due_at <= time.time()
