"""SIGKILL storms against a batch partner (issue 19, point 5): crash safety as with one
DELETE per operation, in each answer shape of docs/batch.md and both partner modes.

A batch goes through more hands than a DELETE: formed (its attempts and its row written),
sent or submitted (the request in the air), recorded (a job's reference), polled, and
its items settled. The kill moments come from the case's RNG over the partner's own
counters: a batch request arriving (the partner holds it for its latency: the kill
lands with the request in the air), executions (a batch just acted on, its answer on
the way back or being committed; for a job, its items running while it is polled), a
job accepted (its reference on the way to the ledger), a job finished (its results
being read and copied), and kills right after a restarted process logs that it listens
(the recovery itself: leases handed back, batches found again). After every kill the
ledger file is read as the dead process left it: no operation that still needs work is
without its message, unless a job the partner may hold carries it (the job poller,
driven by the ledger alone, owns those).

Each case ends with the fault suite's :func:`verify` in batch mode, then asserts that
every batch row is closed (a batch closes in the commit of its last item's outcome).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.faults.harness import Fault, FaultService, Mode, fault_service, reach, verify
from tests.e2e.harness import E2E, Sandbox

pytestmark = pytest.mark.e2e

POPULATION = 600
MAX_ITEMS = 50
BOOT_KILLS = 2


@dataclass(frozen=True)
class Shape:
    """One partner to storm: the service's ``[batch]`` for it, the partner's flags, its
    pace, and the kills aimed at its counters (kind -> how many)."""

    name: str
    shape: str  # batch.shape
    path: str
    rate: float  # the service's requests per second: batches, probes and polls
    sandbox: tuple[str | float, ...]
    batch: dict[str, Any]
    kills: dict[str, int]


_JOB_KILLS = {"request": 2, "submit": 2, "execution": 2, "finish": 2}
SHAPES = {s.name: s for s in (
    # The partner takes its time over each batch (a quarter of a second, two in the air
    # at once): a dozen batches last long enough for kills to land across the drain.
    Shape("per_item", "per_item", "/recipients/batch-delete", 50.0, ("--latency-ms", 250),
          {}, {"request": 3, "execution": 4}),
    # Every id is probed after its batch, on the same budget: the probes are the drain.
    Shape("accepted", "accepted", "/recipients/batch-archive", 60.0, ("--latency-ms", 120),
          {}, {"request": 3, "execution": 4}),
    # Two jobs at a time, two seconds each, their results kept far longer than any
    # outage here: every job is found again and its results read.
    Shape("job", "job", "/recipients/batch-jobs", 20.0,
          ("--latency-ms", 100, "--batch-job-seconds", 2.0, "--batch-max-jobs", 2,
           "--batch-job-result-ttl-seconds", 3600),
          {"max_jobs_in_flight": 2}, _JOB_KILLS),
    # Shorter jobs whose results are kept half a second (Zendesk's "only the last 100
    # jobs"): a job finished while the service was down is gone when it comes back, its
    # items probed; and one whose submission was in doubt is gone before it is looked up.
    Shape("job_expiring", "job", "/recipients/batch-jobs", 60.0,
          ("--latency-ms", 100, "--batch-job-seconds", 1.0, "--batch-max-jobs", 2,
           "--batch-job-result-ttl-seconds", 0.5),
          {"max_jobs_in_flight": 2}, _JOB_KILLS),
)}


def batch_service(e2e: E2E, sandbox: Sandbox, shape: Shape, mode: Mode) -> FaultService:
    return fault_service(e2e, sandbox, {
        "batch": {"shape": shape.shape, "path": shape.path, "max_items": MAX_ITEMS,
                  "linger_seconds": 0.02, "poll_initial_seconds": 0.2,
                  "poll_max_seconds": 1.0, **shape.batch},
        # A job submission whose answer was lost is looked up once its request cannot
        # still be in the air (connect + request timeouts): a few seconds, not fifteen.
        "partner": {"connect_timeout_seconds": 1.0, "request_timeout_seconds": 2.0},
        "limits": {"rate_per_second": shape.rate, "concurrency": 2},
    }, mode.overrides)


async def aim(kind: str, fault: Fault, sandbox: Sandbox, svc: FaultService,
              run_id: str) -> bool:
    """Wait for the moment a kill of ``kind`` is aimed at; False when the run finished
    first (the kill then lands on its tail: the last probes, polls and commits)."""
    rng = fault.rng
    stats = await sandbox.stats()
    if kind == "boot":
        return True  # the process has just logged that it listens
    if kind == "request":
        targets = {"batch_requests": stats["batch_requests"] + rng.randint(1, 2)}
    elif kind == "execution":
        targets = {"executions": stats["executions"] + rng.randint(1, 2 * MAX_ITEMS)}
    elif kind == "submit":
        targets = {"batch_jobs_submitted": stats["batch_jobs_submitted"] + rng.randint(1, 2)}
    else:
        targets = {"batch_jobs_finished": stats["batch_jobs_finished"] + 1}
    if await reach(sandbox, svc, run_id, **targets) is None:
        return False
    jitter = rng.randint(0, 1) if kind == "execution" else 0
    if jitter:
        # One more batch arriving moves the kill along (batches overlap).
        now = await sandbox.stats()
        return await reach(sandbox, svc, run_id,
                           batch_requests=now["batch_requests"] + jitter) is not None
    return True


def closing(detail: str | None) -> str:
    """The recovery a batch's closing detail names ("" for none)."""
    for words, name in (("never sent", "never_sent"), ("job limit", "job_limit"),
                        ("no job carries our tag", "not_found_by_tag"),
                        ("expired before", "results_expired"), ("(replayed)", "replayed")):
        if words in (detail or ""):
            return name
    return ""


@pytest.mark.one_mode("alternate")
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_batch_sigkill_storm(e2e: E2E, fault: Fault, mode: Mode, shape: str,
                                   request: pytest.FixtureRequest) -> None:
    s = SHAPES[shape]
    rng = fault.rng
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--seed", fault.seed,
                                "--rate", 1000, "--batch", s.shape, *s.sandbox,
                                *mode.sandbox_args)
    svc = batch_service(e2e, sandbox, s, mode)
    await svc.start()
    run_id = await svc.open_run()

    plan = [kind for kind, n in s.kills.items() for _ in range(n)]
    rng.shuffle(plan)
    # Boot kills anywhere but first: the first process has nothing to recover.
    for _ in range(BOOT_KILLS):
        plan.insert(rng.randint(1, len(plan)), "boot")
    caught: Counter[str] = Counter()
    for kind in plan:
        if not await aim(kind, fault, sandbox, svc, run_id):
            kind = "tail"
        await svc.kill()
        caught[f"kill_{kind}"] += 1

        rows = svc.ledger()
        # Nothing acked without its committed outcome: every operation that still needs
        # work has its message, or is in a job the poller will read.
        stranded = sorted(set(rows.stranded) - set(rows.in_open_job))
        assert stranded == [], (kind, stranded[:5], [rows.log_of.get(o) for o in stranded[:2]])
        assert sum(rows.states.values()) <= POPULATION
        # What the kill caught in the air: batches with attempts still unanswered.
        for state in {b.state for b in rows.batches.values() if b.open_attempts}:
            caught[f"batch_{state}"] += 1
        caught["ops_in_flight"] += rows.states["in_flight"]
        caught["ops_in_jobs"] += len(rows.in_open_job)
        await svc.start()

    fault.record.notes.update(caught)
    try:
        v = await verify(e2e, svc, sandbox, run_id, mode, fault, batch=s.shape)
    finally:
        if fault.record.duplicates is None:
            # verify failed before it filled in the case's record: the table still
            # shows what the storm did and what the partner saw.
            stats = await sandbox.stats()
            fault.record.kills = svc.kills
            fault.record.processes = len(svc.history)
            fault.record.operations = stats["population"]
            fault.record.duplicates = stats["duplicates"]
            fault.record.notes.update(requests=stats["batch_requests"],
                                      executions=stats["executions"])
    # How the batches ended, for the closing note: the recoveries among them.
    fault.record.notes.update(Counter(
        closing(b.detail) for b in v.ledger.batches.values() if closing(b.detail)))
    assert svc.kills == len(plan) >= 9
    # The kills landed where they were aimed: with batches in the air (sent and not
    # answered, or a job the partner holds).
    in_air = ("batch_sent",) if s.shape != "job" else ("batch_submitting", "batch_submitted")
    assert sum(caught[k] for k in in_air) >= 1, caught
    # Every restart handed back what the killed process held (nothing waited out a lease).
    for sp in svc.history[1:]:
        assert any("leases handed back" in line for line in sp.lines), sp.tail()
    if mode.keys and s.shape != "job":
        # A batch a kill caught in the air was sent again whole under its own ID, and
        # the partner replayed what it had done.
        assert v.stats["replays"] >= 1, v.stats
        assert sum(v.sends.values()) > len(v.sends), v.sends

    # Every batch row closed (checked last: all else held when this fails). A row whose
    # attempts all have their batch's own outcomes lost only its closing write.
    fault.record.notes["left_open"] = len(v.left_open)
    assert v.left_open == [], v.left_open
