"""The harness and end-of-case checks of the fault suite (issue 3, points 4, 5 and 7).

Every case drives real processes through the harness of ``tests/e2e/harness.py``: the
partner simulator and the service's console script (``python -m supervisor serve``),
restarted on the same data dir as often as a case needs. Each case draws its fault
moments from ``random.Random(seed)``; the seed is fixed per case (derived from the test's
name), printed when the case fails, and can be forced with ``FAULT_SEED=<n>``.

Every case ends with :func:`verify`, which asserts what issue 3 promises:

* every discovered operation is terminal, or ``ambiguous`` with its evidence (a reason
  and a non-empty attempts log);
* the partner executed no recipient twice, in both partner modes, and where it ignores
  idempotency keys the ledger shows no DELETE sent after an attempt whose outcome was
  unknown, unless a probe or an operator queued the operation again in between;
* the run's counts in the API equal the ledger's rows, read from the SQLite file
  (read-only) after the service stopped; the attempts rows agree with what the partner
  saw and with each operation's attempts log in the API;
* with a batch partner (``batch``, docs/batch.md): every batch the partner received was
  recorded before it left, under its batch ID as key (the same ids each time it was sent
  again); each operation settled on its item's result settled on what the partner did;
  the batch rows left open are returned, for the case to assert last;
* with ``queue.backend = "infrai"`` (the emulator process) instead of the embedded
  queue's table: whatever the emulator still holds belongs to settled operations, and
  its own counts agree with the messages its call log shows.

Synchronisation is by events only: the service's log lines, its ``?wait=done``
long-poll and the simulator's ``/_sandbox/wait`` long-poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.e2e.harness import E2E, Infrai, InfraiMessages, Sandbox, Sections, Service, ServiceProcess, merge
from tests.e2e.ledger_file import STATES, LedgerRows

TERMINAL = frozenset({"deleted", "already_absent", "failed"})
ACTIVE = ("queued", "in_flight", "retry_wait")
SETTLE_TIMEOUT_S = 60.0

# Applied under every fault case's own overrides: quick retries, plenty of attempts (a 5xx
# burst must delay an operation, not fail it), a limiter that climbs back fast after a 429.
FAULT_DEFAULTS: Sections = {
    "partner": {"backoff_initial_seconds": 0.05, "backoff_max_seconds": 0.5,
                "max_attempts": 30, "probe_settle_seconds": 0.5,
                "probe_interval_seconds": 0.2},
    "limits": {"probe_seconds": 1.0},
}


# -- partner modes --------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """Whether the partner honours ``Idempotency-Key`` (and the service is told so)."""

    name: str
    keys: bool

    @property
    def sandbox_args(self) -> tuple[str, ...]:
        return () if self.keys else ("--no-idempotency",)

    @property
    def overrides(self) -> Sections:
        return {"partner": {"idempotency_keys": self.keys}}


KEYS = Mode("keys", True)
NO_KEYS = Mode("no-keys", False)


# -- the per-case record: seed, counts for the closing note ---------------------------


@dataclass
class FaultRecord:
    case: str
    seed: int
    runs: int = 0  # cleanup runs opened
    processes: int = 0  # service processes started (1 + restarts)
    kills: int = 0
    operations: int = 0
    duplicates: int | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    status: str = "?"
    seconds: float = 0.0


REPORT: list[FaultRecord] = []


@dataclass
class Fault:
    """What a case needs to be reproducible: its seed, an RNG from it, and its record."""

    seed: int
    rng: random.Random
    record: FaultRecord


# -- the service, with stdout kept and a few more controls -----------------------------


class FaultProcess(ServiceProcess):
    """A ``serve`` process whose stdout is kept too (the secrets case reads both)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        super().__init__(proc)
        self.out_lines: list[str] = []
        self._out_reader = asyncio.create_task(self._read_out(), name=f"stdout-{proc.pid}")

    async def _read_out(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.out_lines.append(line.decode(errors="replace").rstrip("\n"))

    def count(self, pattern: str) -> int:
        regex = re.compile(pattern)
        return sum(1 for line in self.lines if regex.search(line))

    async def wait_for_new_line(self, pattern: str, after: int, within_s: float) -> str:
        """The first stderr line matching ``pattern`` at index ``after`` or later."""
        return await self.wait_for_line(pattern, within_s, after=after)

    async def close(self) -> None:
        await super().close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self._out_reader


class FaultService(Service):
    """A :class:`Service` whose processes may take global flags (``--log-level debug``)
    and their own environment, keep their stdout, and stop gracefully on request."""

    process_type = FaultProcess
    keep_stdout = True

    def __init__(self, e2e: E2E, config: dict[str, dict[str, Any]], name: str,
                 global_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 infrai: Infrai | None = None) -> None:
        super().__init__(e2e, config, name, infrai)
        self.global_args = tuple(global_args)
        self.env = dict(self.env if env is None else env)
        self.kills = 0
        self.history: list[FaultProcess] = []  # type: ignore[assignment]
        self.current: FaultProcess | None = None

    async def start(self) -> FaultProcess:
        await super().start()
        assert self.current is not None
        return self.current

    def pid(self) -> int | None:
        """The running process's ID (None before the first start)."""
        return None if self.current is None else self.current.proc.pid

    async def kill(self) -> int:
        self.kills += 1
        return await super().kill()

    async def stop(self) -> None:
        """SIGTERM; the drain must end with exit code 0."""
        assert self.current is not None
        self.current.send(signal.SIGTERM)
        code = await self.current.wait_exit()
        assert code == 0, f"exit {code} after SIGTERM:\n{self.current.tail()}"

    def all_lines(self) -> Iterator[str]:
        for sp in self.history:
            yield from sp.lines
            yield from sp.out_lines

    def count(self, pattern: str) -> int:
        return sum(sp.count(pattern) for sp in self.history)

    async def stranded(self, rows: LedgerRows) -> list[str]:
        """Operations that still need work and that nothing will bring back.

        Embedded queue: no message row. Infrai: the ledger names a live message the
        emulator no longer holds (never published, or acked). An operation whose live
        message is NULL is redrive's to publish; one whose live message is still in the
        emulator (visible, delayed or leased by a dead process) comes back.
        """
        if self.infrai is None:
            return rows.stranded
        held = (await self.infrai.messages()).held
        return stranded_in_infrai(rows, held)


def stranded_in_infrai(rows: LedgerRows, held: dict[str, str]) -> list[str]:
    """Active operations whose live message is not among ``held`` (message_id ->
    operation_id of what the emulator still holds), nor NULL."""
    out = []
    for op_id, message_id in rows.live.items():
        if message_id is None:
            continue
        if held.get(message_id) != op_id:
            out.append(op_id)
    return out


def fault_service(e2e: E2E, sandbox: Sandbox | None, *overrides: Sections,
                  name: str = "service", global_args: Sequence[str] = (),
                  env: dict[str, str] | None = None,
                  infrai: Infrai | None = None) -> FaultService:
    """A :class:`FaultService` on the e2e base configuration, FAULT_DEFAULTS and
    ``overrides`` (later ones win); with ``infrai`` its queue is that emulator's."""
    config: Sections = FAULT_DEFAULTS
    for o in overrides:
        config = merge(config, o)
    plain = e2e.service(sandbox, config, name, infrai)
    svc = FaultService(e2e, plain.config, name, global_args, env, infrai)
    e2e.services[e2e.services.index(plain)] = svc  # the e2e teardown closes it
    return svc


# -- waiting and checking --------------------------------------------------------------


async def settle(svc: FaultService, run_id: str, *, probing: bool,
                 within_s: float = SETTLE_TIMEOUT_S) -> dict[str, Any]:
    """The run once it is done with nothing unfinished and, when a probe is configured,
    nothing ambiguous left.

    A run is done while ambiguous operations wait for the reconciler; its probes are
    logged (``action=probe``), so between long-polls we wait for the next probe line.
    """
    deadline = time.monotonic() + within_s
    while True:
        sp = svc.current
        assert sp is not None
        mark = len(sp.lines)
        left = deadline - time.monotonic()
        status, doc = await svc.request(
            "GET", f"/v1/runs/{run_id}?wait=done&timeout={int(min(30, max(1, left)))}")
        assert status == 200, doc
        # Done means nothing left to act on, even when a probe queued an operation again.
        assert doc["state"] != "done" or doc["unfinished"] == 0, doc
        if doc["state"] == "done" and not (probing and doc["counts"]["ambiguous"]):
            return dict(doc)
        if time.monotonic() >= deadline:
            raise AssertionError(f"run {run_id} not settled after {within_s}s: {doc}\n"
                                 f"{sp.tail()}")
        if doc["state"] == "done":
            await sp.wait_for_new_line(r"\baction=probe\b", mark, max(1.0, left))


@dataclass
class Verified:
    run: dict[str, Any]
    ops: list[dict[str, Any]]
    stats: dict[str, Any]
    ledger: LedgerRows
    executions: Counter[str]
    log: list[dict[str, Any]]  # the partner's executions, in order
    infrai: InfraiMessages | None = None  # the emulator's messages, after the stop
    infrai_stats: dict[str, Any] | None = None  # GET /_emulator/stats, after the stop
    # Batch partners: how many requests the partner received under each batch ID (keys)
    sends: Counter[str] = field(default_factory=Counter)
    # Batches the ledger still shows open once the run settled (see open_batches): the
    # caller asserts there are none, last, so that is all that is wrong when it fails.
    left_open: list[LeftOpen] = field(default_factory=list)


# A batch closed with one of these details never left (docs/batch.md: a batch written and
# never sent, or refused by our own count of the partner's jobs before it was sent).
UNSENT_BATCH = ("never sent", "job limit")


async def verify(e2e: E2E, svc: FaultService, sandbox: Sandbox, run_id: str, mode: Mode,
                 fault: Fault, *, probing: bool = True, allow_ambiguous: bool = False,
                 operator_rows: int = 0, batch: str = "") -> Verified:
    """Settle the run, check it against the partner's record, stop the service, and
    check the API's counts against the ledger file.

    ``batch`` is the service's ``batch.shape`` ("" for one DELETE per operation): then
    a request carries a batch, its key is the batch ID, and requests are counted per
    batch."""
    run = await settle(svc, run_id, probing=probing)
    stats = await sandbox.stats()
    log = await sandbox.log()
    ops = await svc.operations(run_id)
    counts: dict[str, int] = run["counts"]
    population = stats["population"]

    # One operation per candidate, every one accounted for.
    assert run["discovered"] == population == len(ops), (run, stats)
    assert len({op["recipient_id"] for op in ops}) == population
    assert len({op["id"] for op in ops}) == population
    assert sum(counts.values()) == population, run
    assert run["unfinished"] == 0, run
    by_state = Counter(op["state"] for op in ops)
    assert by_state == Counter({k: v for k, v in counts.items() if v}), (by_state, counts)
    assert set(by_state) <= TERMINAL | {"ambiguous"}, by_state
    assert counts["failed"] == 0, run
    if not allow_ambiguous:
        assert counts["ambiguous"] == 0, run
    for op in ops:
        if op["state"] in ("ambiguous", "failed"):
            assert op["reason"], op
            assert (await svc.operation(op["id"]))["attempts_log"], op

    # Never doubled: no recipient executed twice, in either partner mode.
    assert stats["duplicates"] == 0, stats
    executions = Counter(e["recipient_id"] for e in log)
    assert max(executions.values(), default=0) <= 1, executions.most_common(3)
    op_of = {op["recipient_id"]: op for op in ops}
    if not batch:  # a batch's key is its batch ID, checked against the ledger below
        for e in log:
            op = op_of[e["recipient_id"]]
            assert e["idempotency_key"] == (op["id"] if mode.keys else None), (e, op)
    ended = counts["deleted"] + counts["already_absent"]
    # A batch's items may settle on probes (an accepted batch says nothing per id; a
    # job's results may be gone): each outcome read from the partner's own answer is
    # checked against its execution once the ledger is read (check_batches).
    if mode.keys and not batch:
        # Each outcome is the partner's own answer (replayed after a fault).
        assert counts["deleted"] == stats["deleted"], (run, stats)
        assert counts["already_absent"] == stats["absent_answers"], (run, stats)
    else:
        # A probe that finds a recipient gone records "deleted", whoever removed it; an
        # ambiguous operation may have been executed.
        assert ended + counts["ambiguous"] >= stats["deleted"], (run, stats)
    if counts["ambiguous"] == 0:
        assert stats["present"] == 0, stats
        assert ended == population

    # The attempts log the API shows for a sample of operations: those that needed more
    # than one attempt or carry a reason (evidence, an operator), and a few at random.
    sample = ([op for op in ops if op["attempts"] > 1][:20]
              + [op for op in ops if op["reason"]][:20]
              + fault.rng.sample(ops, min(5, len(ops))))
    api_logs = {op["id"]: [(a["n"], a["kind"], a["status"], a["outcome"], a["detail"])
                           for a in (await svc.operation(op["id"]))["attempts_log"]]
                for op in sample}

    # The API's counts are the ledger's rows.
    await svc.stop()
    rows = svc.ledger()
    assert rows.states == {s: counts.get(s, 0) for s in STATES}, (rows.states, counts)
    assert rows.op_attempts == sum(op["attempts"] for op in ops)
    assert rows.stranded == [], rows.stranded[:5]
    assert rows.live == {}, list(rows.live.items())[:5]
    assert rows.messages == 0, rows.messages
    assert rows.runs == {run_id: "done"}, rows.runs
    assert rows.attempts["operator"] == operator_rows, rows.attempts
    for op_id, api_log in api_logs.items():
        assert api_log == rows.log_of.get(op_id, []), (op_id, api_log)
    sends: Counter[str] = Counter()
    if not batch:
        # Every DELETE the partner received was recorded as an attempt before it was sent;
        # a kill between the record and the send adds a row without a request. An attempt
        # closed "not sent" (a hold began, or its ownership was lost, before the request
        # left) is a row without one too, and says so.
        sent = rows.attempts["delete"] - rows.not_sent
        assert sent >= stats["requests"], (rows.attempts, rows.not_sent, stats)
        if svc.kills == 0:
            assert sent == stats["requests"], (rows.attempts, rows.not_sent, stats)
    else:
        sends = await check_batches(sandbox, rows, ops, log, stats, mode, svc.kills)
        fault.record.notes["item_results"] = check_item_outcomes(rows, ops, log)
    if svc.kills == 0:
        assert rows.attempts["probe"] == svc.count(r"\baction=probe\b"), rows.attempts
    # No attempt is left looking as if it were still in the air: one a kill interrupted
    # is closed as "unknown" when its operation is next handled.
    assert rows.open_attempts == 0, rows.outcomes
    if not mode.keys:
        assert rows.blind_resends == [], [rows.log_of[o] for o in rows.blind_resends[:3]]

    messages = emulator = None
    if svc.infrai is not None:
        messages, emulator = await check_infrai(svc.infrai, rows)

    r = fault.record
    r.runs += len(rows.runs)
    r.processes += len(svc.history)
    r.kills += svc.kills
    r.operations += population
    r.duplicates = stats["duplicates"] + (r.duplicates or 0)
    r.notes.update({"requests": stats["batch_requests"] if batch else stats["requests"],
                    "executions": stats["executions"], "replays": stats["replays"],
                    "probes": rows.attempts["probe"], "ambiguous_left": counts["ambiguous"]})
    if batch:
        # A batch's items confirmed by probes (accepted; a job whose results are gone)
        # carry the probe on their own delete attempt, not in a probe row.
        r.notes.update({"batches": len(rows.batches), "resent": sum(
            n - 1 for n in sends.values()), "item_probes": rows.item_probes})
    if messages is not None and emulator is not None:
        q = emulator["queues"][svc.infrai.queue]  # type: ignore[union-attr]
        r.notes.update({
            "infrai_calls": emulator["total_calls"],
            "infrai_calls_per_op": round(emulator["total_calls"] / max(1, population), 2),
            "publishes": q["published"],
            "reposts": q["published"] - population,
            "redeliveries": q["redeliveries"],
            "left_in_infrai": len(messages.held)})
    return Verified(run, ops, stats, rows, executions, log, messages, emulator, sends,
                    open_batches(rows))


async def check_batches(sandbox: Sandbox, rows: LedgerRows, ops: list[dict[str, Any]],
                        log: list[dict[str, Any]], stats: dict[str, Any], mode: Mode,
                        kills: int) -> Counter[str]:
    """A batch partner's requests against the ledger's batch rows; returns how many
    requests the partner received under each batch ID (empty without keys).

    Every batch is written with its attempts before it leaves; a kill between the record
    and the send leaves a row without a request, closed "never sent" when its items are
    next handled. With keys, a batch whose outcome was lost goes again whole under its
    own ID (the partner replays it); without, it is never sent twice (its items are held
    as ambiguous and probed).
    """
    recipient = {op["id"]: op["recipient_id"] for op in ops}
    for b in rows.batches.values():
        assert len(b.members) == b.size == len(set(b.members)), b
    may_have_left = {b.id for b in rows.batches.values()
                     if not any(u in (b.detail or "") for u in UNSENT_BATCH)}
    # The partner opens one request entry per distinct id of every batch it receives.
    entries: dict[str | None, list[str]] = {}
    for e in await sandbox.requests():
        entries.setdefault(e["idempotency_key"], []).append(e["recipient_id"])
    sends: Counter[str] = Counter()
    if mode.keys:
        assert None not in entries, entries.get(None, [])[:5]
        for key, rids in entries.items():
            assert key is not None
            assert key in may_have_left, (key, rows.batches.get(key))
            # The same ids every time the batch went (a resend is the batch, whole).
            ids = {recipient[op_id] for op_id in rows.batches[key].members}
            assert set(rids) == ids, (key, sorted(set(rids) ^ ids)[:5])
            sends[key], extra = divmod(len(rids), len(ids))
            assert extra == 0, (key, len(rids), len(ids))
        assert sum(sends.values()) == stats["batch_requests"], (sends, stats)
        op_of = {rid: op_id for op_id, rid in recipient.items()}
        for e in log:
            batches = rows.batch_of.get(op_of[e["recipient_id"]], [])
            # Executed under one of the batches its own attempts went out in.
            assert e["idempotency_key"] in batches, (e, batches)
    else:
        assert set(entries) <= {None}, list(entries)[:5]
        assert all(e["idempotency_key"] is None for e in log), log[:3]
        assert len(may_have_left) >= stats["batch_requests"], (len(may_have_left), stats)
        if kills == 0:
            assert len(may_have_left) == stats["batch_requests"], (len(may_have_left), stats)
    return sends


@dataclass(frozen=True)
class LeftOpen:
    """A batch not closed, its state, and the outcomes of the attempts it carried."""

    id: str
    state: str
    outcomes: Counter[str | None]


def open_batches(rows: LedgerRows) -> list[LeftOpen]:
    """Each batch the ledger shows not closed."""
    out = []
    for batch_id, state in rows.open_batches.items():
        outcomes: Counter[str | None] = Counter()
        for op_id in rows.batches[batch_id].members:
            deletes = [r for r in rows.log_of[op_id] if r[1] == "delete"]
            for row, carried_by in zip(deletes, rows.batch_of[op_id], strict=True):
                if carried_by == batch_id:
                    outcomes[row[3]] += 1
        out.append(LeftOpen(batch_id, state, outcomes))
    return out


def check_item_outcomes(rows: LedgerRows, ops: list[dict[str, Any]],
                        log: list[dict[str, Any]]) -> int:
    """Every operation settled on its own item's result (``item HTTP <status> in batch
    ...``, a batch's answer or a job's, replayed or not) settled on what the partner did
    to its recipient: 200 is the execution that deleted it, 404 one that found it
    absent. An operation settled on a probe is the stats' business (nothing present).
    Returns how many operations settled on their item's result."""
    result = {e["recipient_id"]: e["result"] for e in log}
    checked = 0
    for op in ops:
        last = rows.log_of.get(op["id"], [])[-1:]
        if not last or last[0][1] != "delete":
            continue
        detail = last[0][4] or ""
        if detail.startswith("item HTTP 200 "):
            assert (op["state"], result.get(op["recipient_id"])) == ("deleted", "deleted"), (
                op, last)
        elif detail.startswith("item HTTP 404 "):
            assert (op["state"], result.get(op["recipient_id"])) == (
                "already_absent", "absent"), (op, last)
        else:
            continue
        checked += 1
    return checked


async def check_infrai(infrai: Infrai, rows: LedgerRows,
                       ) -> tuple[InfraiMessages, dict[str, Any]]:
    """After the stop: the emulator's counts agree with its call log, and whatever it
    still holds is a copy of a settled operation's message (a repost's predecessor, a
    redrive's), dropped on sight should it ever be delivered."""
    messages = await infrai.messages()
    emulator = await infrai.stats()
    q = emulator["queues"][infrai.queue]
    assert len(messages.held) == q["visible"] + q["delayed"] + q["leased"], (
        len(messages.held), q)
    assert q["published"] == len(messages.operation_of), q
    assert q["dlq"] == q["dead_lettered"] == 0, q
    unsettled = {op for op in messages.held.values()
                 if rows.state_of.get(op) not in TERMINAL | {"ambiguous"}}
    assert not unsettled, f"unsettled operations left in Infrai: {sorted(unsettled)[:5]}"
    # Every operation got at least one message, and only the run's operations did.
    assert set(messages.operation_of.values()) == set(rows.state_of), (
        len(set(messages.operation_of.values())), len(rows.state_of))
    return messages, emulator


async def control_after(sandbox: Sandbox, *, executions: int | None = None,
                        requests: int | None = None, within_s: float = 30.0,
                        **changes: float) -> dict[str, Any]:
    """Once the partner's counters reach the targets, change its faults at runtime."""
    targets = {k: v for k, v in (("executions", executions), ("requests", requests))
               if v is not None}
    stats = await sandbox.wait(within_s, **targets)
    await sandbox.control(**changes)
    return stats


# The simulator's /_sandbox/wait long-polls executions, pages and requests only: its batch
# counters (batch_requests, batch_jobs_submitted, batch_jobs_finished) have no event to
# await, so they are read this often. The run is looked at every RUN_EVERY reads.
STATS_POLL_S = 0.01
RUN_EVERY = 10


async def reach(sandbox: Sandbox, svc: FaultService, run_id: str, within_s: float = 30.0,
                **targets: int) -> dict[str, Any] | None:
    """The partner's stats once every named counter of ``/_sandbox/stats`` reaches its
    target; None when the run is done first (nothing more may be sent)."""
    deadline = time.monotonic() + within_s
    reads = 0
    while True:
        stats = await sandbox.stats()
        if all(stats[name] >= target for name, target in targets.items()):
            return stats
        reads += 1
        if reads % RUN_EVERY == 0 and (await svc.run(run_id))["state"] == "done":
            return None
        assert time.monotonic() < deadline, f"partner never reached {targets}: {stats}"
        await asyncio.sleep(STATS_POLL_S)  # a poll interval: see STATS_POLL_S


@contextlib.asynccontextmanager
async def background(coro: Any) -> AsyncIterator[asyncio.Task[Any]]:
    """Run a fault driver beside the case; its failure fails the case, and it never
    outlives it."""
    task = asyncio.ensure_future(coro)
    try:
        yield task
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
