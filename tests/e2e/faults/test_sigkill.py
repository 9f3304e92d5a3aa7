"""SIGKILL again and again, at seeded points of scan, publish, request-in-flight, commit
and ack, restarting after each (issue 3, point 5, first bullet), in both partner modes.

The kill moments come from the case's RNG over the partner's own counters, long-polled
through ``/_sandbox/wait``: pages served (the scan: a page read and not yet committed, or
committed and not yet published), executions (the drain: a DELETE the partner has just
executed, whose answer is on its way back, being committed, or committed with its ack,
which is the same transaction), a few extra requests for jitter, and kills right after the
restarted process logs that it listens (its first moves: dead leases handed back,
redelivered messages, resumed scan). After every kill the ledger file is read as the dead
process left it: what the kill caught is counted, and no operation that still needs
work may be without its message (no ack without a committed outcome, no lost publish).
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.e2e.faults.harness import Fault, Mode, fault_service, verify
from tests.e2e.harness import E2E

pytestmark = pytest.mark.e2e

POPULATION = 1500
PAGES = 15
SCAN_KILLS = 5  # while the scan runs
DRAIN_KILLS = 13  # at seeded execution counts
BOOT_KILLS = 4  # right after a restart logs that it listens


@pytest.mark.one_mode("keys")
async def test_sigkill_storm(e2e: E2E, fault: Fault, mode: Mode) -> None:
    rng = fault.rng
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--seed", fault.seed,
                                "--rate", 2000, "--burst", 50, "--latency-ms", 5,
                                "--page-delay-ms", 60, *mode.sandbox_args)
    svc = fault_service(e2e, sandbox, {
        "source": {"page_size": POPULATION // PAGES},
        "limits": {"rate_per_second": 500, "concurrency": 8},
    }, mode.overrides)
    await svc.start()
    run_id = await svc.open_run()

    later = ["drain"] * DRAIN_KILLS + ["boot"] * BOOT_KILLS
    rng.shuffle(later)
    plan = ["scan"] * SCAN_KILLS + later
    drain_targets = iter(sorted(rng.sample(range(POPULATION // 5, POPULATION * 9 // 10),
                                           DRAIN_KILLS)))
    caught: Counter[str] = Counter()
    committed_pages = 0
    for kind in plan:
        stats = await sandbox.stats()
        if kind == "scan" and committed_pages < PAGES:
            step = min(PAGES - committed_pages, rng.randint(1, 2))
            await sandbox.wait(30, pages=stats["pages_served"] + step)
            jitter = rng.randint(0, 3)  # a page served: its commit, then its publish
        elif kind == "drain":
            await sandbox.wait(30, executions=next(drain_targets))
            jitter = rng.randint(0, 6)
        else:
            kind, jitter = "boot", 0
        if jitter:
            # A few more DELETEs (the drain runs beside the scan) move the kill along.
            now = await sandbox.stats()
            await sandbox.wait(30, requests=now["requests"] + jitter)
        await svc.kill()
        caught[f"kill_{kind}"] += 1

        rows = svc.ledger()
        # Nothing acked without its committed outcome, nothing published lost: every
        # operation that still needs work has its message.
        assert rows.stranded == [], (kind, rows.stranded[:5])
        assert sum(rows.states.values()) <= POPULATION
        committed_pages = rows.scan_pages
        caught["mid_scan"] += any(state == "scanning" for state in rows.runs.values())
        caught["unpublished"] += rows.states["discovered"] > 0
        caught["request_in_air"] += rows.states["in_flight"] > 0
        caught["in_flight_ops"] += rows.states["in_flight"]
        caught["leased"] += rows.leased > 0
        await svc.start()

    v = await verify(e2e, svc, sandbox, run_id, mode, fault)
    fault.record.notes.update(caught)
    assert svc.kills == len(plan) >= 20
    # The kills landed where they were aimed: in the scan (a page read or committed but
    # not published: "unpublished"), with requests in the air, with messages leased.
    assert caught["mid_scan"] >= 1, caught
    assert caught["request_in_air"] >= 1, caught
    assert caught["leased"] >= 1, caught
    # Every restart handed back what the killed process held (nothing waited out a lease).
    for sp in svc.history[1:]:
        assert any("leases handed back" in line for line in sp.lines), sp.tail()
    if mode.keys:
        # Requests a kill caught in the air were resent with their key, and the partner
        # replayed those it had executed.
        assert v.ledger.outcomes[("delete", "unknown")] >= 1, v.ledger.outcomes
        assert v.stats["replays"] >= 1, v.stats
    else:
        # Not resent: held as ambiguous, probed, and moved on the evidence alone (a probe
        # per interrupted attempt at least; a probe a kill interrupted is made again).
        unknown = v.ledger.outcomes[("delete", "unknown")]
        assert unknown >= 1, v.ledger.outcomes
        assert v.ledger.attempts["probe"] >= unknown, v.ledger.attempts
