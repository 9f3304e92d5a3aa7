"""The queue model behind the Infrai emulator: queues, leases, dead-letter queues, idempotency.

Pure and synchronous: no I/O and no aiohttp. Every instant comes from one injectable clock
plus an offset that tests advance, so a lease expiry or a 7-day delay costs no real waiting.
No method awaits, which is what makes the app's look-up-then-act sequences (an idempotency
check, the publish, the record) atomic under asyncio.

Time-driven changes are applied lazily: each operation first replays, in time order, the
timers (delay ends, lease expiries) that fell due on its queue since the last one.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cleanup_sandbox.infrai.config import EmulatorConfig, TimestampFormat

DAY = 86400.0


class ApiError(Exception):
    """A refusal the app renders as an ok:false envelope."""

    def __init__(self, status: int, code: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.hint = hint


def queue_not_found(name: str) -> ApiError:
    return ApiError(404, "QUEUE_NOT_FOUND", f"queue {name!r} does not exist", "call POST /v1/queue/create")


def uuid7(unix_seconds: float, rng: random.Random) -> str:
    """RFC 9562 UUID v7: 48-bit milliseconds, version 7, variant 10, 74 random bits."""
    ms = max(0, int(unix_seconds * 1000)) & ((1 << 48) - 1)
    value = (ms << 80) | (0x7 << 76) | (rng.getrandbits(12) << 64) | (0b10 << 62)
    value |= rng.getrandbits(62)
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def timestamp(seconds: float, fmt: TimestampFormat) -> str | float:
    if fmt == "epoch":
        return round(seconds, 3)
    moment = datetime.fromtimestamp(seconds, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class MessageState(enum.Enum):
    DELAYED = "delayed"  # waiting for delay_seconds (or a nack delay) to pass
    VISIBLE = "visible"
    LEASED = "leased"


@dataclass(slots=True, eq=False)
class Message:
    message_id: str
    payload: dict[str, Any]
    enqueued_at: float
    priority: float
    group_id: str | None
    headers: dict[str, str]
    seq: int = 0
    state: MessageState = MessageState.DELAYED
    visible_at: float = 0.0
    leased_until: float = 0.0
    receive_count: int = 0
    # Failures counted against the current queue's max_retries; a DLQ starts a fresh budget.
    failures: int = 0
    failures_when_dead_lettered: int = 0
    # Bumped on every change, so heap entries pushed before it are recognisably stale.
    version: int = 0
    origin: str | None = None  # the queue it was dead-lettered from


@dataclass(slots=True)
class QueueCounters:
    published: int = 0
    acked: int = 0
    deliveries: int = 0
    redeliveries: int = 0
    duplicates_injected: int = 0
    nacked: int = 0
    lease_expiries: int = 0
    dead_lettered: int = 0
    dropped: int = 0
    redriven: int = 0
    retention_expired: int = 0
    deduplicated: int = 0


@dataclass(slots=True, eq=False)
class Queue:
    name: str
    type: str
    dead_letter_queue: str | None
    max_retries: int
    visibility_timeout_default: float
    message_retention_days: float
    enable_priority: bool
    created_at: float
    messages: dict[str, Message] = field(default_factory=dict)
    # (due, tie, message_id, version): delay ends and lease expiries.
    timers: list[tuple[float, int, str, int]] = field(default_factory=list)
    # (order key, message_id, version) of visible messages; unused by FIFO queues, whose
    # per-group order needs a scan of ``messages`` (kept in arrival order) instead.
    ready: list[tuple[tuple[float, float, int], str, int]] = field(default_factory=list)
    fifo_dedup: dict[str, tuple[str, float]] = field(default_factory=dict)
    recent_acks: deque[tuple[float, Message]] = field(default_factory=deque)
    # A lower bound of the oldest enqueued_at, so retention sweeps run only when due.
    oldest_enqueued: float = math.inf
    counters: QueueCounters = field(default_factory=QueueCounters)

    @property
    def fifo(self) -> bool:
        return self.type == "fifo"

    def record(self, fmt: TimestampFormat) -> dict[str, object]:
        return {
            "name": self.name,
            "type": self.type,
            "dead_letter_queue": self.dead_letter_queue,
            "max_retries": self.max_retries,
            "visibility_timeout_default": self.visibility_timeout_default,
            "message_retention_days": self.message_retention_days,
            "enable_priority": self.enable_priority,
            "created_at": timestamp(self.created_at, fmt),
        }


@dataclass(frozen=True, slots=True)
class StoredCall:
    """The first successful answer to an idempotency key, replayed to its repeats."""

    fingerprint: bytes
    at: float
    status: int
    data: object
    queue: str | None
    message_ids: tuple[str, ...]


class IdempotencyStore:
    def __init__(self) -> None:
        # Insertion order is time order, so expiry pops from the front.
        self._calls: dict[tuple[str, str], StoredCall] = {}

    def get(self, route: str, key: str, now: float, window: float) -> StoredCall | None:
        while self._calls:
            oldest = next(iter(self._calls))
            if now - self._calls[oldest].at < window:
                break
            del self._calls[oldest]
        return self._calls.get((route, key))

    def put(self, route: str, key: str, call: StoredCall) -> None:
        self._calls[(route, key)] = call

    def __len__(self) -> int:
        return len(self._calls)


class QueueState:
    """All queues of one emulated account, on the clock ``now() + offset``."""

    def __init__(self, config: EmulatorConfig, now: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = now
        self.offset = 0.0
        self.queues: dict[str, Queue] = {}
        self.idempotency = IdempotencyStore()
        self._seq = itertools.count(1)
        self._tie = itertools.count()
        # Separate from the fault draws so the ids do not shift which calls get faults.
        self._id_rng = random.Random(config.seed * 7919 + 1)

    # -- clock -----------------------------------------------------------------------------

    def now(self) -> float:
        return self._clock() + self.offset

    def advance(self, seconds: float) -> float:
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"the clock only moves forward, got {seconds!r}")
        self.offset += seconds
        return self.now()

    def new_id(self, prefix: str = "msg_") -> str:
        return prefix + uuid7(self.now(), self._id_rng)

    # -- queues ----------------------------------------------------------------------------

    def get(self, name: str) -> Queue:
        queue = self.queues.get(name)
        if queue is None:
            raise queue_not_found(name)
        return queue

    def create_queue(
        self,
        name: str,
        *,
        type: str = "standard",
        dead_letter_queue: str | None = None,
        max_retries: int | None = None,
        message_retention_days: float | None = None,
        visibility_timeout_default: float | None = None,
        enable_priority: bool = False,
    ) -> tuple[Queue, bool]:
        """The queue and whether it is new; an existing name answers per create_existing."""
        cfg = self.config
        existing = self.queues.get(name)
        if existing is not None:
            if cfg.create_existing == "conflict":
                raise ApiError(409, "QUEUE_EXISTS", f"queue {name!r} already exists")
            return existing, False
        if dead_letter_queue is not None:
            if dead_letter_queue == name:
                raise ApiError(400, "VALIDATION_ERROR", "dead_letter_queue cannot be the queue itself")
            if dead_letter_queue not in self.queues:
                raise ApiError(
                    404,
                    "QUEUE_NOT_FOUND",
                    f"dead_letter_queue {dead_letter_queue!r} does not exist",
                    "create the dead-letter queue first",
                )
        queue = Queue(
            name=name,
            type=type,
            dead_letter_queue=dead_letter_queue,
            max_retries=cfg.default_max_retries if max_retries is None else max_retries,
            visibility_timeout_default=(
                cfg.default_visibility_timeout
                if visibility_timeout_default is None
                else visibility_timeout_default
            ),
            message_retention_days=(
                cfg.default_retention_days if message_retention_days is None else message_retention_days
            ),
            enable_priority=enable_priority,
            created_at=self.now(),
        )
        self.queues[name] = queue
        return queue, True

    def _target(self, name: str) -> Queue:
        if name not in self.queues and self.config.auto_create:
            return self.create_queue(name)[0]
        return self.get(name)

    # -- messages --------------------------------------------------------------------------

    def publish(
        self,
        queue_name: str,
        payload: dict[str, Any],
        *,
        delay_seconds: float = 0.0,
        priority: float = 0.0,
        group_id: str | None = None,
        deduplication_id: str | None = None,
        idempotency_key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[str, bool]:
        """The message id and whether FIFO dedup returned an earlier message instead."""
        now = self.now()
        queue = self._target(queue_name)
        self._advance(queue, now)
        dedup = self._dedup_id(deduplication_id, idempotency_key) if queue.fifo else None
        if dedup is not None:
            fifo_dedup = queue.fifo_dedup
            window = self.config.fifo_dedup_window_seconds
            while fifo_dedup:
                oldest = next(iter(fifo_dedup))
                if now - fifo_dedup[oldest][1] < window:
                    break
                del fifo_dedup[oldest]
            earlier = fifo_dedup.get(dedup)
            if earlier is not None:
                queue.counters.deduplicated += 1
                return earlier[0], True
        message = Message(
            message_id=self.new_id(),
            payload=payload,
            enqueued_at=now,
            priority=priority,
            group_id=group_id,
            headers=dict(headers or {}),
        )
        self._insert(queue, message, now + delay_seconds, now)
        if dedup is not None:
            queue.fifo_dedup[dedup] = (message.message_id, now)
        queue.counters.published += 1
        return message.message_id, False

    def _dedup_id(self, deduplication_id: str | None, idempotency_key: str | None) -> str | None:
        source = self.config.fifo_dedup_key
        if source == "deduplication_id":
            return deduplication_id
        if source == "idempotency_key":
            return idempotency_key
        return deduplication_id if deduplication_id is not None else idempotency_key

    def consume(
        self,
        queue_name: str,
        max_messages: int = 1,
        visibility_timeout: float | None = None,
        duplicate_rng: random.Random | None = None,
    ) -> list[tuple[Message, bool]]:
        """(message, is_duplicate) pairs: up to max_messages leased, read them before awaiting.

        With ``duplicate_rng`` one slot goes to a duplicate: a message leased to someone else
        or acked lately, handed out again without touching its lease.
        """
        cfg = self.config
        now = self.now()
        queue = self._target(queue_name)
        self._advance(queue, now)
        limit = min(max_messages, cfg.max_batch)
        lease = queue.visibility_timeout_default if visibility_timeout is None else visibility_timeout
        lease = min(lease, cfg.max_visibility_timeout)
        duplicate = None
        if duplicate_rng is not None:
            duplicate = self._pick_duplicate(queue, now, duplicate_rng)
            if duplicate is not None:
                limit -= 1
        picked = self._pick_fifo(queue, limit) if queue.fifo else self._pick_ready(queue, limit)
        out: list[tuple[Message, bool]] = []
        for message in picked:
            message.receive_count += 1
            queue.counters.deliveries += 1
            if message.receive_count > 1:
                queue.counters.redeliveries += 1
            self._lease(queue, message, now + lease)
            out.append((message, False))
        if duplicate is not None:
            out.append((duplicate, True))
        return out

    def _pick_ready(self, queue: Queue, limit: int) -> list[Message]:
        picked: list[Message] = []
        while queue.ready and len(picked) < limit:
            _, message_id, version = heapq.heappop(queue.ready)
            message = queue.messages.get(message_id)
            if message is not None and message.version == version:
                picked.append(message)
        return picked

    def _pick_fifo(self, queue: Queue, limit: int) -> list[Message]:
        # Strict order per group: a group whose oldest message is leased or delayed is blocked,
        # but one batch may carry several consecutive messages of an open group.
        blocked: set[str | None] = set()
        picked: list[Message] = []
        for message in queue.messages.values():
            if len(picked) >= limit:
                break
            if message.group_id in blocked:
                continue
            if message.state is not MessageState.VISIBLE:
                blocked.add(message.group_id)
                continue
            picked.append(message)
        return picked

    def _pick_duplicate(self, queue: Queue, now: float, rng: random.Random) -> Message | None:
        horizon = now - self.config.duplicate_recent_ack_seconds
        while queue.recent_acks and queue.recent_acks[0][0] < horizon:
            queue.recent_acks.popleft()
        candidates = [m for m in queue.messages.values() if m.state is MessageState.LEASED]
        candidates.extend(m for _, m in queue.recent_acks)
        if not candidates:
            return None
        queue.counters.duplicates_injected += 1
        return rng.choice(candidates)

    def _held(self, queue: Queue, message_id: str) -> Message | None:
        """The message an ack/nack names, or None when that answers acked:false."""
        cfg = self.config
        message = queue.messages.get(message_id)
        if message is None:
            if cfg.ack_unknown == "not_found":
                raise ApiError(
                    404, "MESSAGE_NOT_FOUND", f"message {message_id!r} is not in queue {queue.name!r}"
                )
            return None
        if message.state is not MessageState.LEASED and cfg.ack_expired == "reject":
            raise ApiError(
                409,
                "LEASE_EXPIRED",
                f"message {message_id!r} is not leased (its lease expired or it was never delivered)",
                "consume it again",
            )
        return message

    def ack(self, queue_name: str, message_id: str) -> bool:
        now = self.now()
        queue = self.get(queue_name)
        self._advance(queue, now)
        message = self._held(queue, message_id)
        if message is None:
            return False
        del queue.messages[message_id]
        message.version += 1
        queue.recent_acks.append((now, message))
        queue.counters.acked += 1
        return True

    def nack(self, queue_name: str, message_id: str, delay_seconds: float = 0.0) -> tuple[bool, bool]:
        """(nacked, dead_lettered)."""
        now = self.now()
        queue = self.get(queue_name)
        self._advance(queue, now)
        message = self._held(queue, message_id)
        if message is None:
            return False, False
        message.failures += 1
        queue.counters.nacked += 1
        if self._exhausted(queue, message):
            self._dead_letter(queue, message, now, now)
            return True, True
        self._schedule(queue, message, now + delay_seconds, now)
        return True, False

    def extend(self, queue_name: str, message_id: str, visibility_timeout: float) -> float:
        now = self.now()
        queue = self.get(queue_name)
        self._advance(queue, now)
        message = queue.messages.get(message_id)
        if message is None:
            raise ApiError(404, "MESSAGE_NOT_FOUND", f"message {message_id!r} is not in queue {queue.name!r}")
        if message.state is not MessageState.LEASED:
            raise ApiError(409, "LEASE_EXPIRED", f"message {message_id!r} is no longer leased")
        until = now + min(visibility_timeout, self.config.max_visibility_timeout)
        self._lease(queue, message, until)
        return until

    def redrive(self, path_name: str) -> tuple[str, int]:
        """Move dead-lettered messages back; the queue the path named and how many moved."""
        now = self.now()
        if self.config.redrive_target == "source":
            source = self.get(path_name)
            if source.dead_letter_queue is None:
                raise ApiError(400, "VALIDATION_ERROR", f"queue {path_name!r} has no dead_letter_queue")
            dlq = self.get(source.dead_letter_queue)
            self._advance(dlq, now)
            moves = [(m, source) for m in dlq.messages.values() if m.origin in (source.name, None)]
        else:
            dlq = self.get(path_name)
            self._advance(dlq, now)
            moves = [
                (m, self.queues[m.origin]) for m in dlq.messages.values() if m.origin in self.queues
            ]
        for message, target in moves:
            del dlq.messages[message.message_id]
            if self.config.redrive_resets_count:
                message.receive_count = message.failures = 0
            else:
                message.failures = message.failures_when_dead_lettered
            message.origin = None
            self._insert(target, message, now, now)
            target.counters.redriven += 1
        return path_name, len(moves)

    # -- time and movement -------------------------------------------------------------------

    def _exhausted(self, queue: Queue, message: Message) -> bool:
        if self.config.dlq_threshold == "reach":
            return message.failures >= queue.max_retries
        return message.failures > queue.max_retries

    def _dead_letter(self, queue: Queue, message: Message, at: float, now: float) -> None:
        del queue.messages[message.message_id]
        message.version += 1
        dlq = self.queues.get(queue.dead_letter_queue) if queue.dead_letter_queue else None
        if dlq is None:
            queue.counters.dropped += 1
            return
        message.origin = queue.name
        message.failures_when_dead_lettered = message.failures
        message.failures = 0
        self._insert(dlq, message, at, now)
        queue.counters.dead_lettered += 1

    def _insert(self, queue: Queue, message: Message, visible_at: float, now: float) -> None:
        message.seq = next(self._seq)
        queue.messages[message.message_id] = message
        queue.oldest_enqueued = min(queue.oldest_enqueued, message.enqueued_at)
        self._schedule(queue, message, visible_at, now)

    def _schedule(self, queue: Queue, message: Message, visible_at: float, now: float) -> None:
        if visible_at <= now:
            self._make_visible(queue, message, visible_at)
            return
        message.state = MessageState.DELAYED
        message.visible_at = visible_at
        message.version += 1
        heapq.heappush(queue.timers, (visible_at, next(self._tie), message.message_id, message.version))

    def _make_visible(self, queue: Queue, message: Message, at: float) -> None:
        message.state = MessageState.VISIBLE
        message.visible_at = at
        message.version += 1
        if queue.fifo:
            return
        rank = 0.0
        if queue.enable_priority:
            rank = -message.priority if self.config.priority_order == "higher_first" else message.priority
        # Oldest-visible first; seq breaks ties (and makes every key unique).
        heapq.heappush(queue.ready, ((rank, at, message.seq), message.message_id, message.version))

    def _lease(self, queue: Queue, message: Message, until: float) -> None:
        message.state = MessageState.LEASED
        message.leased_until = until
        message.version += 1
        heapq.heappush(queue.timers, (until, next(self._tie), message.message_id, message.version))

    def _advance(self, queue: Queue, now: float) -> None:
        retention = queue.message_retention_days * DAY
        if now >= queue.oldest_enqueued + retention:
            self._sweep_retention(queue, now, retention)
        timers = queue.timers
        while timers and timers[0][0] <= now:
            due, _, message_id, version = heapq.heappop(timers)
            message = queue.messages.get(message_id)
            if message is None or message.version != version:
                continue
            if message.state is MessageState.LEASED:
                queue.counters.lease_expiries += 1
                if self.config.expiry_counts_toward_max_retries:
                    message.failures += 1
                    if self._exhausted(queue, message):
                        self._dead_letter(queue, message, due, now)
                        continue
            self._make_visible(queue, message, due)

    def _sweep_retention(self, queue: Queue, now: float, retention: float) -> None:
        oldest = math.inf
        for message_id, message in list(queue.messages.items()):
            if message.enqueued_at + retention <= now:
                del queue.messages[message_id]
                message.version += 1
                queue.counters.retention_expired += 1
            else:
                oldest = min(oldest, message.enqueued_at)
        queue.oldest_enqueued = oldest

    # -- inspection --------------------------------------------------------------------------

    def settle(self) -> None:
        """Apply every timer due by now on every queue (inspection reads settled state)."""
        now = self.now()
        for queue in list(self.queues.values()):
            self._advance(queue, now)

    def stats(self) -> dict[str, dict[str, int]]:
        self.settle()
        out: dict[str, dict[str, int]] = {}
        for queue in self.queues.values():
            states = {state: 0 for state in MessageState}
            for message in queue.messages.values():
                states[message.state] += 1
            dlq = self.queues.get(queue.dead_letter_queue) if queue.dead_letter_queue else None
            parked = sum(1 for m in dlq.messages.values() if m.origin == queue.name) if dlq else 0
            out[queue.name] = {
                "visible": states[MessageState.VISIBLE],
                "delayed": states[MessageState.DELAYED],
                "leased": states[MessageState.LEASED],
                "dlq": parked,
                **dataclasses.asdict(queue.counters),
            }
        return out

