"""Forming batches: ids gather per partition and leave together when K are in, when the
next would pass the byte cap, or a short linger after the first, whichever comes first
(the size-or-timeout rule of Oban's chunks, BullMQ's batches and Inngest's).

K is not fixed. A 413 teaches the partner's real cap (kept). Under a per-item cost (or
when the ids' limit of two refused it) a whole batch refused with 429 halves K, so the
next refusal costs fewer ids, and each batch answered grows it back by a quarter; under
a per-request cost K stays at its maximum, since a request is what the limit counts."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from supervisor.batchsettings import BatchConfig

T = TypeVar("T")

# What a JSON array or comma list adds per id besides the id itself.
_SEPARATOR_BYTES = 3
_ENVELOPE_BYTES = 32


def id_bytes(recipient_id: str) -> int:
    return len(recipient_id.encode()) + _SEPARATOR_BYTES


@dataclass(slots=True)
class _Open(Generic[T]):
    items: list[T]
    ids: set[str]
    size: int
    timer: asyncio.TimerHandle | None = None


class Chunker(Generic[T]):
    """Hands each formed batch to ``flush`` (called on the event loop, never awaited)."""

    def __init__(self, config: BatchConfig, flush: Callable[[list[T]], None],
                 recipient: Callable[[T], str], linger: bool = True) -> None:
        self.config = config
        # False: a partial batch never leaves on its own (a job partner's batch waits for
        # a job slot anyway: :meth:`flush_oldest` sends the oldest when one is free).
        self._linger = linger
        self._flush = flush
        self._recipient = recipient
        self._pattern = re.compile(config.partition_pattern) if config.partition_pattern \
            else None
        self._open: dict[str, _Open[T]] = {}
        self.cap = config.max_items  # the most the partner takes (a 413 lowers it)
        self.k = config.max_items  # the most sent now (a per-item 429 lowers it)

    def partition(self, recipient_id: str) -> str:
        if self._pattern is None:
            return ""
        m = self._pattern.search(recipient_id)
        if m is None:
            return ""
        return m.group(1) if m.groups() and m.group(1) is not None else m.group(0)

    @property
    def pending(self) -> int:
        return sum(len(o.items) for o in self._open.values())

    def add(self, item: T) -> None:
        rid = self._recipient(item)
        key = self.partition(rid)
        size = id_bytes(rid)
        batch = self._open.get(key)
        # One recipient twice in one batch is a quirk partners answer differently (an
        # error, one result, two): it never happens; the second waits for the next batch.
        if batch is not None and (rid in batch.ids or batch.size + size
                                  > self.config.max_bytes):
            self._leave(key)
            batch = None
        if batch is None:
            batch = _Open([], set(), _ENVELOPE_BYTES)
            self._open[key] = batch
            if self._linger:
                batch.timer = asyncio.get_running_loop().call_later(
                    self.config.linger_seconds, self._leave, key)
        batch.items.append(item)
        batch.ids.add(rid)
        batch.size += size
        if len(batch.items) >= min(self.k, self.cap):
            self._leave(key)

    def drop_all(self) -> None:
        """Shutdown: the batches not yet formed are not sent (their workers hand their
        messages back)."""
        for batch in self._open.values():
            if batch.timer is not None:
                batch.timer.cancel()
        self._open.clear()

    def flush_oldest(self) -> bool:
        """Send the partial batch that has waited longest (dicts keep insertion order);
        False when none is open."""
        for key in self._open:
            self._leave(key)
            return True
        return False

    def flush_all(self) -> None:
        for key in list(self._open):
            self._leave(key)

    def _leave(self, key: str) -> None:
        batch = self._open.pop(key, None)
        if batch is None:
            return
        if batch.timer is not None:
            batch.timer.cancel()
        if batch.items:
            self._flush(batch.items)

    def refused_too_large(self, size: int) -> None:
        """The partner refused a batch of ``size`` as too large (413)."""
        self.cap = max(1, min(self.cap, size // 2))
        self.k = min(self.k, self.cap)

    def throttled(self, ids: bool) -> None:
        """A whole batch was refused with 429; ``ids``: by a limit that counts ids."""
        if ids:
            self.k = max(1, self.k // 2)

    def answered(self) -> None:
        """A batch was answered (not refused whole)."""
        if self.k < self.cap:
            self.k = min(self.cap, self.k + max(1, self.k // 4))
