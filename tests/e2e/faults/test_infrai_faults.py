"""Faults through real processes with the queue in Infrai (issue 8, point 6), in both
partner modes: the service's console script with ``queue.backend = "infrai"`` against the
emulator process (``python -m cleanup_sandbox.infrai``) and the partner simulator.

Infrai has no nack, no extend, no receive count and no transactional ack: the ledger
commits an outcome and the ack follows as a second call, a retry is a new message
published with ``delay_seconds`` (the old one acked after), and a message held past its
visibility timeout comes back. The cases:

1. a SIGKILL storm (scan, drain right after partner executions, boot), checking after
   each kill that nothing that still needs work is stranded, and showing from the
   emulator's call log that kills landed between a commit and its ack;
2. duplicate deliveries (the emulator hands out messages leased elsewhere or just acked);
3. a visibility timeout shorter than a partner pause (Retry-After storms);
4. Infrai 429 and 5xx bursts during the drain;
5. Infrai refusing us mid-run (402 INSUFFICIENT_CREDIT), then credit restored.

Every case ends with :func:`verify` (no recipient executed twice, every operation
terminal or ambiguous with its evidence, the API's counts equal the ledger's rows), which
for Infrai also checks that whatever the emulator still holds is a settled operation's.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tests.e2e.faults.harness import (
    Fault,
    FaultService,
    Mode,
    background,
    fault_service,
    settle,
    stranded_in_infrai,
    verify,
)
from tests.e2e.harness import E2E, Infrai, Sandbox
from tests.e2e.ledger_file import attempts_started_after
from tests.helpers import eventually

pytestmark = pytest.mark.e2e

CONCURRENCY = 8
# Every case: quick polls after an empty receive, redrive every second (a kill between a
# retry's commit and its repost leaves no live message: redrive's to publish).
QUEUE: dict[str, Any] = {"poll_interval_seconds": 0.2, "redrive_interval_seconds": 1.0,
                         "redrive_grace_seconds": 20.0}


def partner(fault: Fault, mode: Mode, population: int, *args: str | float) -> tuple[Any, ...]:
    return ("--recipients", population, "--seed", fault.seed, *args, *mode.sandbox_args)


async def service(e2e: E2E, sandbox: Sandbox, infrai: Infrai, mode: Mode,
                  *overrides: dict[str, Any]) -> FaultService:
    return fault_service(e2e, sandbox, {"queue": QUEUE,
                                        "limits": {"concurrency": CONCURRENCY}},
                         *overrides, mode.overrides, infrai=infrai)


def faults_in(log: list[dict[str, Any]], queue: str) -> Counter[str]:
    """Injected faults the emulator logged on this queue's calls, by kind."""
    return Counter(e["fault"] for e in log if e["fault"] and e["queue"] in (queue, None))


# -- 1. SIGKILL storm ---------------------------------------------------------------------

STORM_POPULATION = 600
STORM_PAGES = 12
SCAN_KILLS = 4
DRAIN_KILLS = 14
BOOT_KILLS = 4


@pytest.mark.one_mode("no-keys")
async def test_sigkill_storm(e2e: E2E, fault: Fault, mode: Mode) -> None:
    """Kills at seeded partner executions (the answer on its way back, being committed,
    or committed and its ack not yet accepted: Infrai answers some calls 429, so some acks
    wait a second after their commit), during the scan, and right after a restart listens. After each one: no
    operation that needs work is stranded, i.e. its live message is still in Infrai
    (visible, delayed or leased by the dead process) or the ledger names none (redrive
    publishes it)."""
    rng = fault.rng
    n = STORM_POPULATION
    sandbox = await e2e.sandbox(*partner(fault, mode, n, "--rate", 2000, "--burst", 50,
                                         "--latency-ms", 5, "--page-delay-ms", 80))
    # One Infrai call in 20 answers 429 with Retry-After 1 s: an ack so refused waits a
    # second after its commit, so a kill often finds outcomes committed and not acked.
    infrai = await e2e.infrai("--seed", fault.seed, "--latency-ms", 5,
                              "--rate-limit-share", 0.05, "--retry-after", 1)
    svc = await service(e2e, sandbox, infrai, mode, {
        "source": {"page_size": n // STORM_PAGES},
        # What a killed process held comes back after this; no kill waits out 30 s.
        "queue": {"lease_seconds": 4.0},
        "limits": {"rate_per_second": 500},
    })
    await svc.start()
    run_id = await svc.open_run()

    later = ["drain"] * DRAIN_KILLS + ["boot"] * BOOT_KILLS
    rng.shuffle(later)
    plan = ["scan"] * SCAN_KILLS + later
    drain_targets = iter(sorted(rng.sample(range(n // 5, n * 9 // 10), DRAIN_KILLS)))
    caught: Counter[str] = Counter()
    committed_pages = 0
    for kind in plan:
        stats = await sandbox.stats()
        if kind == "scan" and committed_pages < STORM_PAGES:
            step = min(STORM_PAGES - committed_pages, rng.randint(1, 2))
            # A page served: its commit, then its publish, are under way.
            await sandbox.wait(30, pages=stats["pages_served"] + step)
            jitter = 0
        elif kind == "drain":
            await sandbox.wait(30, executions=max(next(drain_targets), stats["executions"] + 1))
            jitter = rng.randint(0, 4)
        else:
            kind, jitter = "boot", 0
        if jitter:
            now = await sandbox.stats()
            await sandbox.wait(30, requests=now["requests"] + jitter)
        await svc.kill()
        caught[f"kill_{kind}"] += 1

        rows = svc.ledger()
        messages = await infrai.messages()
        held = messages.held
        stranded = stranded_in_infrai(rows, held)
        by_op_all: dict[str, set[str]] = {}
        for m, op in messages.operation_of.items():
            by_op_all.setdefault(op, set()).add(f"{m}{'' if m in held else ' (acked)'}")
        # A live message the emulator no longer holds: nothing is bound to deliver the
        # operation again until redrive finds it, minutes later.
        assert stranded == [], (kind, len(stranded), [
            (op, rows.state_of[op], rows.live[op], sorted(by_op_all.get(op, ())))
            for op in stranded[:3]])
        # The brief's form of the same: each active operation has a message carrying its
        # operation ID in Infrai, or no live message in the ledger.
        by_op = messages.by_operation()
        assert all(op in by_op or mid is None for op, mid in rows.live.items())
        assert sum(rows.states.values()) <= n
        committed_pages = rows.scan_pages
        caught["mid_scan"] += any(state == "scanning" for state in rows.runs.values())
        caught["request_in_air"] += rows.states["in_flight"] > 0
        caught["no_live_message"] += sum(1 for mid in rows.live.values() if mid is None)
        # The outcome committed, the message it came with (its live one) not acked when
        # the kill struck, or its ack still in the air (the emulator acts on a request a
        # moment after it arrived). Other copies of a settled operation's message, e.g. a
        # publish the killed process never recorded, are not counted.
        caught["settled_unacked_at_kill"] += sum(
            1 for m, op in held.items() if op in rows.terminal_at and rows.message_of[op] == m)
        await svc.start()

    v = await verify(e2e, svc, sandbox, run_id, mode, fault)
    assert v.infrai is not None
    assert svc.kills == len(plan) >= 20
    assert caught["mid_scan"] >= 1, caught
    assert caught["request_in_air"] >= 1, caught
    assert caught["settled_unacked_at_kill"] >= 1, caught

    # Kills between a commit and its ack: the message an outcome was committed with,
    # delivered again after that commit (the kill left it unacked, its visibility timeout
    # ran out), found settled by a later process and acked without a partner call: no
    # attempt begun after the commit, the recipient executed once.
    msgs, rows = v.infrai, v.ledger
    cut = {m: op for m, op in msgs.operation_of.items()
           if op in rows.terminal_at and rows.message_of[op] == m and m in msgs.acked
           and msgs.deliveries[m] >= 2
           and min(msgs.delivered_at[m]) < rows.terminal_at[op] < max(msgs.delivered_at[m])}
    assert cut, caught
    late_attempts = attempts_started_after(
        svc.ledger_path, {op: rows.terminal_at[op] for op in cut.values()})
    assert not any(late_attempts.values()), late_attempts
    recipient_of = {op["id"]: op["recipient_id"] for op in v.ops}
    # Executed once at most: none was sent again after its commit. Once, but for an
    # operation killed before its request left, whose recipient the partner never had
    # (the simulator's absent share): without keys a probe settles it, nothing is sent.
    assert all(v.executions[recipient_of[op]] <= 1 for op in cut.values())
    assert sum(v.executions[recipient_of[op]] == 0 for op in cut.values()) <= \
        v.stats["initially_absent"], v.stats

    if mode.keys:
        assert v.ledger.outcomes[("delete", "unknown")] >= 1, v.ledger.outcomes
    else:
        unknown = v.ledger.outcomes[("delete", "unknown")]
        assert unknown >= 1, v.ledger.outcomes
        assert v.ledger.attempts["probe"] >= unknown, v.ledger.attempts
    fault.record.notes.update(caught)
    fault.record.notes["commit_kill_ack_later"] = len(cut)


# -- 2. duplicate deliveries ----------------------------------------------------------------

POPULATION = 300


async def test_duplicate_deliveries(e2e: E2E, fault: Fault, mode: Mode) -> None:
    """30% of consumes also hand out a message leased elsewhere or just acked: each copy
    is recognised (held here already, or its operation settled) and never sent twice."""
    sandbox = await e2e.sandbox(*partner(fault, mode, POPULATION, "--rate", 1000,
                                         "--latency-ms", 10))
    infrai = await e2e.infrai("--seed", fault.seed, "--duplicate-share", 0.3)
    svc = await service(e2e, sandbox, infrai, mode, {"queue": {"lease_seconds": 10.0}})
    await svc.start()
    run_id = await svc.open_run()
    await settle(svc, run_id, probing=True)
    # The consumers keep polling after the run settled, and the emulator keeps handing
    # out copies: count the copies first, then wait for the service to have recognised
    # that many (a copy is counted when handed out, recognised a moment later; read the
    # other way round, a copy handed out between the two reads failed a slow CI).
    handed_out = (await infrai.queue_stats())["duplicates_injected"]

    async def recognised() -> float | None:
        m = await svc.metrics()
        seen = (m.get("cleanup_queue_duplicate_deliveries_total")
                + m.get("cleanup_queue_dropped_deliveries_total", reason="settled"))
        return seen if seen >= handed_out else None

    # Every copy handed out was recognised as one: none led to an attempt (below).
    seen = await eventually(recognised, 10.0, f"{handed_out} copies recognised")
    v = await verify(e2e, svc, sandbox, run_id, mode, fault)
    assert v.infrai_stats is not None
    injected = v.infrai_stats["queues"][infrai.queue]["duplicates_injected"]
    assert injected >= handed_out >= 10, v.infrai_stats
    assert faults_in(await infrai.log(), infrai.queue)["duplicate"] == injected
    assert v.ledger.attempts["delete"] == v.stats["requests"] == POPULATION
    assert v.stats["executions"] == POPULATION
    fault.record.notes.update({"duplicates_injected": injected,
                               "recognised": int(seen)})


# -- 3. a visibility timeout shorter than a partner pause -----------------------------------

LEASE_S = 3.0
PAUSE_S = 4.5  # Retry-After 5 s
STORMS = 2


@pytest.mark.one_mode("keys")
async def test_lease_shorter_than_a_partner_pause(e2e: E2E, fault: Fault, mode: Mode) -> None:
    """Visibility timeout 3 s, Retry-After storms of 5 s: every message a worker holds
    through the pause would come back to someone else, so it is published again for when
    the pause ends and the held copy acked (no extend to keep it). One DELETE executed
    per recipient, no attempt counted for a 429, nothing lost."""
    rng = fault.rng
    sandbox = await e2e.sandbox(*partner(fault, mode, POPULATION, "--rate", 400, "--burst", 20,
                                         "--latency-ms", 20))
    infrai = await e2e.infrai("--seed", fault.seed)
    svc = await service(e2e, sandbox, infrai, mode, {
        "queue": {"lease_seconds": LEASE_S},
        "limits": {"rate_per_second": 300}})
    await svc.start()
    run_id = await svc.open_run()
    began = []
    for target in sorted(rng.sample(range(POPULATION // 10, POPULATION * 7 // 10), STORMS)):
        await sandbox.wait(30, executions=target)
        await sandbox.control(pause_seconds=PAUSE_S)
        # The next storm starts once this one is over and the drain is under way again.
        began.append(target)
        await sandbox.wait(30, executions=target + CONCURRENCY + 1)
    await settle(svc, run_id, probing=True)
    reposts = (await svc.metrics()).get("cleanup_queue_reposts_total")
    v = await verify(e2e, svc, sandbox, run_id, mode, fault)
    assert v.infrai_stats is not None
    q = v.infrai_stats["queues"][infrai.queue]
    stats = v.stats
    assert stats["rate_limited"] >= STORMS, stats
    # The held messages were published again (and their copies acked), not left to come
    # back to another worker while the first one still waited.
    assert reposts >= 1, reposts
    assert q["published"] >= POPULATION + reposts, q
    assert v.ledger.outcomes[("delete", "throttled")] == stats["rate_limited"]
    assert v.ledger.op_attempts == stats["requests"] - stats["rate_limited"] == POPULATION
    assert stats["executions"] == POPULATION, stats
    # No attempt's outcome was ever unknown: nothing was resent over a lost lease.
    assert v.ledger.outcomes[("delete", "unknown")] == 0, v.ledger.outcomes
    assert v.ledger.outcomes[("delete", "ambiguous")] == 0, v.ledger.outcomes
    fault.record.notes.update({"storms_after": began, "rate_limited": stats["rate_limited"],
                               "service_reposts": int(reposts),
                               "lease_expiries": q["lease_expiries"]})


# -- 4. Infrai 429 and 5xx bursts ----------------------------------------------------------


async def infrai_bursts(infrai: Infrai, sandbox: Sandbox, rng: random.Random) -> dict[str, Any]:
    """At seeded points of the drain: a burst of 429s with Retry-After 1 s, a burst of
    503s, and a stretch where 10% of calls get each."""
    a, b, c = sorted(rng.sample(range(POPULATION // 10, POPULATION * 7 // 10), 3))
    rate_limited, errors = rng.randint(15, 30), rng.randint(20, 40)
    await sandbox.wait(30, executions=a)
    await infrai.control(rate_limit_next=rate_limited, retry_after=1.0)
    await sandbox.wait(30, executions=b)
    await infrai.control(error_next=errors)
    stats = await sandbox.wait(30, executions=c)
    await infrai.control(rate_limit_share=0.1, error_share=0.1, retry_after=1.0)
    await sandbox.wait(30, requests=stats["requests"] + rng.randint(30, 60))
    await infrai.control(rate_limit_share=0.0, error_share=0.0)
    return {"burst_429": rate_limited, "burst_5xx": errors}


@pytest.mark.one_mode("no-keys")
async def test_infrai_429_and_5xx_bursts(e2e: E2E, fault: Fault, mode: Mode) -> None:
    """Publishes, consumes and acks answered 429 (waited out) or 503 (retried with
    backoff under the same idempotency key): delayed, never doubled, never lost."""
    sandbox = await e2e.sandbox(*partner(fault, mode, POPULATION, "--rate", 1000,
                                         "--latency-ms", 10))
    infrai = await e2e.infrai("--seed", fault.seed)
    svc = await service(e2e, sandbox, infrai, mode, {"queue": {"lease_seconds": 5.0},
                                                     "limits": {"rate_per_second": 200}})
    await svc.start()
    run_id = await svc.open_run()
    async with background(infrai_bursts(infrai, sandbox, fault.rng)) as driver:
        await settle(svc, run_id, probing=True)
        driven = await driver
    m = await svc.metrics()
    v = await verify(e2e, svc, sandbox, run_id, mode, fault)
    injected = faults_in(await infrai.log(), infrai.queue)
    assert injected["rate_limited"] >= driven["burst_429"], injected
    assert injected["error"] >= driven["burst_5xx"], injected
    # The service saw them and retried: counted per call and answer.
    seen_429 = sum(val for (name, labels), val in m.samples.items()
                   if name == "cleanup_transport_requests_total" and ("result", "429") in labels)
    seen_503 = sum(val for (name, labels), val in m.samples.items()
                   if name == "cleanup_transport_requests_total" and ("result", "503") in labels)
    assert seen_429 == injected["rate_limited"], (seen_429, injected)
    assert seen_503 == injected["error"], (seen_503, injected)
    # A refused call did nothing, so nothing was sent to the partner twice and no attempt
    # was left without an outcome.
    assert v.stats["executions"] == POPULATION, v.stats
    assert v.ledger.outcomes[("delete", "unknown")] == 0, v.ledger.outcomes
    fault.record.notes.update(driven)
    fault.record.notes.update({"infrai_429": injected["rate_limited"],
                               "infrai_5xx": injected["error"]})


# -- 5. 402 mid-run -------------------------------------------------------------------------

PREFETCH = 4
REFUSED = r"ERROR .*Infrai refuses us"


def refused_consumes(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in log if e["capability"] == "queue.consume" and e["status"] == 402]


async def logged(infrai: Infrai, reached: Callable[[list[dict[str, Any]]], bool],
                 within_s: float = 30.0) -> list[dict[str, Any]]:
    """The emulator's call log once ``reached`` holds. The emulator has no long-poll, and
    the service logs nothing for a retry a refusing transport refuses again, so this
    reads the log every 100 ms until the deadline."""
    deadline = time.monotonic() + within_s
    while not reached(log := await infrai.log()):
        assert time.monotonic() < deadline, f"the emulator's log never got there: {log[-5:]}"
        await asyncio.sleep(0.1)
    return log


@pytest.mark.one_mode("keys")
async def test_credit_exhausted_mid_run(e2e: E2E, fault: Fault, mode: Mode) -> None:
    """Infrai answers 402 INSUFFICIENT_CREDIT mid-run: one ERROR line, /readyz 503 with
    the queue check false, cleanup_transport_blocked{reason="INSUFFICIENT_CREDIT"} 1,
    consumption stopped (only what was already received is worked). Credit back: it
    resumes by itself and the run completes."""
    sandbox = await e2e.sandbox(*partner(fault, mode, POPULATION, "--rate", 1000,
                                         "--latency-ms", 10))
    infrai = await e2e.infrai("--seed", fault.seed)
    svc = await service(e2e, sandbox, infrai, mode, {
        "queue": {"lease_seconds": 5.0, "prefetch": PREFETCH},
        "limits": {"rate_per_second": 150}})
    sp = await svc.start()
    run_id = await svc.open_run()
    target = fault.rng.randint(POPULATION // 5, POPULATION // 2)
    await sandbox.wait(30, executions=target)
    mark = len(sp.lines)
    await infrai.control(credit_exhausted=True)
    at_block = await sandbox.stats()
    line = await sp.wait_for_new_line(REFUSED, mark, 15)
    assert "INSUFFICIENT_CREDIT" in line, line
    status, doc = await svc.request("GET", "/readyz", auth=False)
    assert status == 503, doc
    assert doc["checks"]["queue"] is False, doc
    assert doc["checks"]["ledger"] is True, doc
    m = await svc.metrics()
    assert m.value("cleanup_transport_blocked", reason="INSUFFICIENT_CREDIT") == 1.0
    assert m.value("cleanup_ready") == 0.0

    # Refused until the consumer has tried again on its own (it retries a refusing
    # transport slowly) and been refused again; then credit back, which it finds out at
    # its next try.
    log = await logged(infrai, lambda log: len(refused_consumes(log)) >= 2)
    first, second = refused_consumes(log)[:2]
    at_second = await sandbox.stats()
    await infrai.control(credit_exhausted=False)
    mark = len(sp.lines)
    await sp.wait_for_new_line(r"WARNING .*Infrai accepts us again", mark, 30)
    at_unblock = await sandbox.stats()
    status, doc = await svc.request("GET", "/readyz", auth=False)
    assert status == 200, doc
    m = await svc.metrics()
    assert m.value("cleanup_transport_blocked", reason="INSUFFICIENT_CREDIT") == 0.0

    await verify(e2e, svc, sandbox, run_id, mode, fault)
    # Consumption stopped: for the seconds between the two refused consumes (hundreds of
    # DELETEs at 150/s), only messages already received were worked; none from the
    # second refusal until the service saw Infrai accept it again.
    assert second["t"] - first["t"] >= 3.0, (first, second)
    worked_blocked = at_second["executions"] - at_block["executions"]
    assert worked_blocked <= CONCURRENCY + PREFETCH, (worked_blocked, at_block, at_second)
    assert at_unblock["executions"] - at_second["executions"] <= CONCURRENCY, at_unblock
    refused = [e for e in await infrai.log() if e["status"] == 402]
    # ... and Infrai was not hammered meanwhile: the held messages' acks, a few consumes.
    assert len(refused) <= 2 * (CONCURRENCY + PREFETCH) + 10, Counter(
        e["capability"] for e in refused)
    assert svc.count(REFUSED) == 1, [ln for ln in svc.all_lines() if "refuses" in ln]
    fault.record.notes.update({"refused_calls": len(refused),
                               "worked_while_refused": worked_blocked})
