"""In-memory state of the simulated partner: population, limiter, idempotency store, log, stats.

Everything here is synchronous and single-threaded (it lives on one event loop), so
no locks are needed; the only asyncio object is the change signal that lets
long-polls wake up without polling.
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Literal

from cleanup_sandbox.config import SandboxConfig, Tunables, check_non_negative, check_probability, check_rate
from cleanup_sandbox.limits import (
    Limiter,
    Quota,
    can_hold,
    ceil_seconds,
    make_limiter,
    wait_for_units,
)
from cleanup_sandbox.quotas import RATE_POLICY, Policy, QuotaSet

ExecutionResult = Literal["deleted", "absent"]
AfterActFault = Literal["timeout", "reset"]
JSONItem = dict[str, object] | str | int | None

# Shapes a defensive scanner must reject; deliberately none of them is a valid ID.
_GARBAGE_KINDS: tuple[Callable[[], JSONItem], ...] = (
    lambda: {"id": None},
    lambda: {"id": ""},
    lambda: {"nope": 1},
    lambda: {"id": "x" * 10_000},
    lambda: {"id": "a\u0000b"},
    lambda: {"id": 42},
    lambda: {"id": ["r-000001"]},
    lambda: {"id": "../../admin"},
    lambda: "r-000001",
    lambda: None,
)

# A request sent before the client could have read a 429 is not the client ignoring it:
# requests arriving this soon after an announcement are not counted against it.
ANNOUNCE_GRACE_S = 0.05

# Keys the control endpoint may change, and how each one is validated.
_CONTROL_PROBABILITIES = ("fault_5xx", "fault_timeout_after_act", "fault_reset_after_act")
_CONTROL_DURATIONS = ("latency_ms", "hang_seconds", "page_delay_ms")
CONTROL_KEYS = frozenset(
    ("pause_seconds", "rate_per_second", "burst", *_CONTROL_PROBABILITIES, *_CONTROL_DURATIONS)
)


@dataclass(frozen=True, slots=True)
class Execution:
    seq: int
    recipient_id: str
    idempotency_key: str | None
    t: float
    result: ExecutionResult
    fault: AfterActFault | None

    def as_dict(self) -> dict[str, object]:
        return {
            "seq": self.seq,
            "recipient_id": self.recipient_id,
            "idempotency_key": self.idempotency_key,
            "t": self.t,
            "result": self.result,
            "fault": self.fault,
        }


@dataclass(slots=True)
class DeleteRequest:
    """One DELETE as the partner saw it, from its arrival to its answer: what "at most one
    request in the air per operation" is checked against."""

    seq: int
    recipient_id: str
    idempotency_key: str | None
    arrived: float
    answered: float | None = None
    status: int | None = None
    # How many DELETEs of the same recipient were in the air when this one arrived.
    overlapping: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"seq": self.seq, "recipient_id": self.recipient_id,
                "idempotency_key": self.idempotency_key, "arrived": self.arrived,
                "answered": self.answered, "status": self.status,
                "overlapping": self.overlapping}


@dataclass(frozen=True, slots=True)
class StoredResponse:
    status: int
    body: bytes
    content_type: str | None


class Claim(enum.Enum):
    CLAIMED = "claimed"
    REPLAY = "replay"
    IN_PROGRESS = "in_progress"
    MISMATCH = "mismatch"


@dataclass(slots=True)
class _KeyEntry:
    recipient_id: str
    response: StoredResponse | None = None


class IdempotencyStore:
    """First-response-wins store; only executed actions are ever completed into it."""

    def __init__(self) -> None:
        self._entries: dict[str, _KeyEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def begin(self, key: str, recipient_id: str) -> tuple[Claim, StoredResponse | None]:
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = _KeyEntry(recipient_id)
            return Claim.CLAIMED, None
        # A key bound to another target is a client bug whether or not it finished.
        if entry.recipient_id != recipient_id:
            return Claim.MISMATCH, None
        if entry.response is None:
            return Claim.IN_PROGRESS, None
        return Claim.REPLAY, entry.response

    def complete(self, key: str, response: StoredResponse) -> None:
        entry = self._entries[key]
        if entry.response is None:
            entry.response = response

    def release(self, key: str) -> None:
        """Forget an unfinished claim so a retry may execute (nothing happened yet)."""
        entry = self._entries.get(key)
        if entry is not None and entry.response is None:
            del self._entries[key]

    def in_progress(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.response is None


RefusalReason = Literal["paused", "rate_limited", "quota_exceeded", "item_rate_limited"]


@dataclass(frozen=True, slots=True)
class Refusal:
    retry_after: float
    reason: RefusalReason


@dataclass(frozen=True, slots=True)
class FaultPlan:
    fail_before: bool
    after_act: AfterActFault | None


@dataclass(slots=True)
class Counters:
    requests: int = 0
    unauthorized: int = 0
    rate_limited: int = 0
    requests_during_pause: int = 0
    requests_during_announced_wait: int = 0
    quota_limited: int = 0
    executions: int = 0
    deleted: int = 0
    absent_answers: int = 0
    duplicates: int = 0
    replays: int = 0
    conflicts: int = 0
    key_mismatches: int = 0
    injected_5xx: int = 0
    injected_timeouts: int = 0
    injected_resets: int = 0
    pages_served: int = 0
    max_rate_observed_1s: int = 0
    max_in_flight: int = 0
    # DELETEs that arrived while another of the same recipient was still being answered.
    overlapping_requests: int = 0
    # Batch endpoints (cleanup_sandbox.batch): requests that reached an enabled one, the ids
    # they carried, and what became of them.
    batch_requests: int = 0
    batch_items: int = 0
    batch_item_throttled: int = 0
    batch_item_errors: int = 0
    batch_silent_misses: int = 0
    batch_duplicate_ids: int = 0
    batch_jobs_submitted: int = 0
    batch_jobs_refused: int = 0
    batch_jobs_finished: int = 0
    batch_jobs_expired: int = 0
    batch_refused_bad_id: int = 0
    batch_refused_too_large: int = 0
    # 429s announcing the item limit's wait (batch_items_per_second); rate_limited counts
    # them too, as it counts every 429 of the limiters and quotas.
    batch_item_rate_limited: int = 0


def recipient_ids(count: int) -> list[str]:
    # Widen past six digits for huge populations so lexical order stays numeric order.
    width = max(6, len(str(count)))
    return [f"r-{i:0{width}d}" for i in range(1, count + 1)]


def build_population(config: SandboxConfig) -> tuple[list[str], set[str]]:
    """All stale IDs in order, and the subset that is still present."""
    ids = recipient_ids(config.recipients)
    # Independent, string-seeded streams: adding garbage or faults must not reshuffle
    # which recipients are absent, and str seeds are stable across processes.
    rng = random.Random(f"{config.seed}:absent")
    absent_count = round(len(ids) * config.absent_share)
    absent = {ids[i] for i in rng.sample(range(len(ids)), absent_count)}
    return ids, {rid for rid in ids if rid not in absent}


def build_listing(config: SandboxConfig, ids: list[str]) -> list[JSONItem]:
    """The candidate listing: every stale ID once, in order, with garbage interleaved."""
    garbage_count = round(len(ids) * config.garbage_share)
    if garbage_count == 0:
        return [{"id": rid} for rid in ids]
    rng = random.Random(f"{config.seed}:garbage")
    total = len(ids) + garbage_count
    garbage_at = set(rng.sample(range(total), garbage_count))
    real = iter(ids)
    return [
        rng.choice(_GARBAGE_KINDS)() if position in garbage_at else {"id": next(real)}
        for position in range(total)
    ]


class AnnouncedWaits:
    """Whether a request arrives while a Retry-After the partner sent still holds.

    Announcements come in clock order, so the ones still inside their grace period sit in
    a short queue; once past it they only matter through the latest until-time of all.
    """

    def __init__(self, grace_s: float = ANNOUNCE_GRACE_S) -> None:
        self.grace_s = grace_s
        self._fresh: deque[tuple[float, float]] = deque()  # (announced at, until)
        self.until: float | None = None

    def announce(self, now: float, seconds: float) -> None:
        self._fresh.append((now, now + seconds))

    def holds_at(self, now: float) -> bool:
        fresh = self._fresh
        while fresh and now - fresh[0][0] > self.grace_s:
            _, until = fresh.popleft()
            if self.until is None or until > self.until:
                self.until = until
        return self.until is not None and now < self.until


class SandboxState:
    def __init__(self, config: SandboxConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.tunables = Tunables.from_config(config)
        self.population, self._present = build_population(config)
        self.listing = build_listing(config, self.population)
        self.initially_absent = len(self.population) - len(self._present)
        self.counters = Counters()
        self.idempotency = IdempotencyStore()
        self.log: list[Execution] = []
        self.requests_log: list[DeleteRequest] = []
        self._in_air: dict[str, int] = {}
        started = clock()
        self._limiter: Limiter = make_limiter(
            config.window, config.rate_per_second, config.burst, started, config.window_seconds
        )
        self._quotas = QuotaSet(config.quotas, started)
        # Counts ids, not requests; a rate of 0 leaves it unlimited.
        self._item_limiter: Limiter = make_limiter(
            "bucket", config.batch_items_per_second, config.batch_items_capacity, started
        )
        self._announced = AnnouncedWaits()
        self._pause_until: float | None = None
        self._executions_by_recipient: dict[str, int] = {}
        self._fault_rng = random.Random(f"{config.seed}:faults")
        self._recent: deque[float] = deque()
        self._changed = asyncio.Event()
        self.in_flight = 0

    # -- change notification -------------------------------------------------------

    def _notify(self) -> None:
        # Swap before setting so a waiter that re-arms after waking sees a fresh event.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until predicate() holds, re-checking only when the state changed.

        Unbounded: callers wrap it in asyncio.timeout().
        """
        while not predicate():
            await self._changed.wait()

    def wake_waiters(self) -> None:
        self._notify()

    # -- recipients ----------------------------------------------------------------

    def is_present(self, recipient_id: str) -> bool:
        return recipient_id in self._present

    # -- admission -----------------------------------------------------------------

    def begin_delete(self) -> None:
        """A DELETE past admission is being handled (its latency may depend on how many)."""
        self.in_flight += 1
        self.counters.max_in_flight = max(self.counters.max_in_flight, self.in_flight)

    def end_delete(self) -> None:
        self.in_flight -= 1

    def note_request(self) -> None:
        self.counters.requests += 1
        self._notify()

    def open_request(self, recipient_id: str, idempotency_key: str | None) -> DeleteRequest:
        """An authorised DELETE arrived; :meth:`close_request` once it is answered."""
        overlapping = self._in_air.get(recipient_id, 0)
        self._in_air[recipient_id] = overlapping + 1
        if overlapping:
            self.counters.overlapping_requests += 1
        entry = DeleteRequest(len(self.requests_log) + 1, recipient_id, idempotency_key,
                              self.clock(), overlapping=overlapping)
        self.requests_log.append(entry)
        return entry

    def close_request(self, entry: DeleteRequest, status: int | None) -> None:
        entry.answered = self.clock()
        entry.status = status
        left = self._in_air.get(entry.recipient_id, 1) - 1
        if left:
            self._in_air[entry.recipient_id] = left
        else:
            self._in_air.pop(entry.recipient_id, None)

    def note_unauthorized(self) -> None:
        self.counters.unauthorized += 1

    def pause_remaining(self, now: float) -> float:
        if self._pause_until is None or now >= self._pause_until:
            return 0.0
        return self._pause_until - now

    def holds(self, now: float, cost: int) -> bool:
        """Whether a request costing ``cost`` units could ever pass the limiter and quotas."""
        return can_hold(self._limiter, now, cost) and can_hold(self._quotas, now, cost)

    def holds_items(self, now: float, items: int) -> bool:
        """Whether a batch of ``items`` distinct ids could ever pass the item limit."""
        return can_hold(self._item_limiter, now, items)

    def admit(self, now: float, cost: int = 1, items: int = 0) -> Refusal | None:
        """Storm first, then the limiter, every quota and the item limit; a refusal
        consumes nothing.

        ``cost`` units of the limiter and quotas and ``items`` of the item limit are taken
        together or not at all (a batch: one request or one per id, and its ids).
        """
        if self._announced.holds_at(now):
            self.counters.requests_during_announced_wait += 1
        paused_for = self.pause_remaining(now)
        if paused_for > 0:
            self.counters.requests_during_pause += 1
            refusal = Refusal(paused_for, "paused")
        else:
            # Ask everyone before charging anyone, so a request one of them refuses
            # leaves no trace in the others.
            asked: tuple[tuple[float | None, RefusalReason], ...] = (
                (wait_for_units(self._quotas, now, cost), "quota_exceeded"),
                (wait_for_units(self._item_limiter, now, items) if items else None,
                 "item_rate_limited"),
                (wait_for_units(self._limiter, now, cost), "rate_limited"),
            )
            waits = [Refusal(wait, reason) for wait, reason in asked if wait is not None]
            if not waits:
                for _ in range(cost):
                    self._limiter.commit(now)
                    self._quotas.commit(now)
                for _ in range(items):
                    self._item_limiter.commit(now)
                return None
            # The longest wait is the one to announce: retrying earlier meets another 429.
            # A tie names the first: a quota, then the item limit.
            refusal = max(waits, key=lambda waiting: waiting.retry_after)
            if refusal.reason == "quota_exceeded":
                self.counters.quota_limited += 1
            elif refusal.reason == "item_rate_limited":
                self.counters.batch_item_rate_limited += 1
        self.counters.rate_limited += 1
        self._observe(now)
        self._notify()
        return refusal

    def note_announced(self, now: float, seconds: float) -> None:
        """A 429 told the client to stay away for `seconds` from `now`."""
        self._announced.announce(now, seconds)

    def quota(self, now: float) -> Quota | None:
        """The rate limiter's own quota (a storm shows as nothing left until it ends)."""
        quota = self._limiter.quota(now)
        paused_for = self.pause_remaining(now)
        if quota is None or paused_for <= 0:
            return quota
        return Quota(quota.limit, quota.window_seconds, 0, ceil_seconds(paused_for))

    def policies(self, now: float) -> list[Policy]:
        """Every policy to advertise: the rate limiter's first, then each quota."""
        rate = self.quota(now)
        head = [] if rate is None else [Policy(RATE_POLICY, rate)]
        return head + self._quotas.policies(now)

    # -- faults and execution ------------------------------------------------------

    def _draw(self, probability: float) -> bool:
        # Only draw when the fault is armed, so fault-free runs leave the stream untouched.
        return probability > 0 and self._fault_rng.random() < probability

    def plan_faults(self) -> FaultPlan:
        tun = self.tunables
        if self._draw(tun.fault_5xx):
            self.counters.injected_5xx += 1
            self._notify()
            return FaultPlan(fail_before=True, after_act=None)
        after: AfterActFault | None = None
        if self._draw(tun.fault_timeout_after_act):
            after = "timeout"
            self.counters.injected_timeouts += 1
        elif self._draw(tun.fault_reset_after_act):
            after = "reset"
            self.counters.injected_resets += 1
        return FaultPlan(fail_before=False, after_act=after)

    def execute(
        self, recipient_id: str, idempotency_key: str | None, fault: AfterActFault | None = None
    ) -> Execution:
        now = self.clock()
        if recipient_id in self._present:
            self._present.remove(recipient_id)
            result: ExecutionResult = "deleted"
            self.counters.deleted += 1
        else:
            result = "absent"
            self.counters.absent_answers += 1
        seen = self._executions_by_recipient.get(recipient_id, 0) + 1
        self._executions_by_recipient[recipient_id] = seen
        if seen == 2:
            self.counters.duplicates += 1
        self.counters.executions += 1
        execution = Execution(len(self.log) + 1, recipient_id, idempotency_key, now, result, fault)
        self.log.append(execution)
        self._observe(now)
        self._notify()
        return execution

    def executions_of(self, recipient_id: str) -> int:
        return self._executions_by_recipient.get(recipient_id, 0)

    def note_replay(self) -> None:
        self.counters.replays += 1
        self._notify()

    def note_conflict(self) -> None:
        self.counters.conflicts += 1

    def note_key_mismatch(self) -> None:
        self.counters.key_mismatches += 1

    def _observe(self, now: float) -> None:
        """Track the busiest sliding second of executions + 429s."""
        recent = self._recent
        recent.append(now)
        horizon = now - 1.0
        while recent and recent[0] <= horizon:
            recent.popleft()
        if len(recent) > self.counters.max_rate_observed_1s:
            self.counters.max_rate_observed_1s = len(recent)

    # -- paging --------------------------------------------------------------------

    def page(self, after: int, limit: int) -> tuple[list[JSONItem], int | None]:
        """Items after listing position `after`; the next position, or None at the end."""
        end = min(after + limit, len(self.listing))
        items = self.listing[after:end]
        return items, (end if end < len(self.listing) else None)

    def note_page(self) -> None:
        self.counters.pages_served += 1
        self._notify()

    # -- runtime control -----------------------------------------------------------

    def apply_control(self, changes: Mapping[str, float]) -> None:
        """Validate everything first so a bad request changes nothing."""
        unknown = set(changes) - CONTROL_KEYS
        if unknown:
            raise ValueError(f"unknown control keys: {sorted(unknown)}")
        tun = self.tunables
        rate = changes.get("rate_per_second", tun.rate_per_second)
        burst = changes.get("burst", tun.burst)
        check_rate(rate, burst)
        for name in _CONTROL_PROBABILITIES:
            if name in changes:
                check_probability(name, changes[name])
        for name in (*_CONTROL_DURATIONS, "pause_seconds"):
            if name in changes:
                check_non_negative(name, changes[name])

        now = self.clock()
        if "rate_per_second" in changes or "burst" in changes:
            self._limiter.retune(rate, burst, now)
            tun.rate_per_second, tun.burst = rate, burst
        for name in (*_CONTROL_PROBABILITIES, *_CONTROL_DURATIONS):
            if name in changes:
                setattr(tun, name, float(changes[name]))
        if "pause_seconds" in changes:
            seconds = changes["pause_seconds"]
            # A new pause replaces the old one; 0 ends the storm immediately.
            self._pause_until = now + seconds if seconds > 0 else None
        self._notify()

    def control_snapshot(self) -> dict[str, float]:
        return {**self.tunables.as_dict(), "pause_remaining": self.pause_remaining(self.clock())}

    # -- reporting -----------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        c = self.counters
        return {
            "executions": c.executions,
            "deleted": c.deleted,
            "absent_answers": c.absent_answers,
            "duplicates": c.duplicates,
            "replays": c.replays,
            "rate_limited": c.rate_limited,
            "requests": c.requests,
            "requests_during_pause": c.requests_during_pause,
            "requests_during_announced_wait": c.requests_during_announced_wait,
            "quota_limited": c.quota_limited,
            "pages_served": c.pages_served,
            "present": len(self._present),
            "max_rate_observed_1s": c.max_rate_observed_1s,
            "max_in_flight": c.max_in_flight,
            "overlapping_requests": c.overlapping_requests,
            "population": len(self.population),
            "initially_absent": self.initially_absent,
            "garbage_listed": len(self.listing) - len(self.population),
            "unauthorized": c.unauthorized,
            "conflicts": c.conflicts,
            "key_mismatches": c.key_mismatches,
            "injected_5xx": c.injected_5xx,
            "injected_timeouts": c.injected_timeouts,
            "injected_resets": c.injected_resets,
            "idempotency_keys": len(self.idempotency),
            "pause_remaining": self.pause_remaining(self.clock()),
            **{f.name: getattr(c, f.name) for f in fields(c) if f.name.startswith("batch_")},
        }
