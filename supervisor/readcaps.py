"""Caps on the reads a client can hold open: long-polls (``GET /v1/runs/{id}?wait=done``)
and exclusions reads (``GET /v1/exclusions``, paged or streamed).

Each held read costs a connection and, for exclusions, ledger reads for as long as it
lasts; nothing else bounds how many a token holder (a digest builder, a dashboard) opens.
Past a cap, in total or for the one token, the request is answered 429 with Retry-After.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Literal

from supervisor import metrics

Kind = Literal["long_poll", "exclusions"]
# When a refused client asks again: a held read lasts seconds (a page, a stream) up to a
# long-poll's timeout, so sooner would mostly be refused again.
RETRY_AFTER_S = 5


class CapReached(Exception):
    def __init__(self, kind: Kind, cap: Literal["total", "per_token"], limit: int) -> None:
        what = "long-polls" if kind == "long_poll" else "exclusions reads"
        scope = "in all" if cap == "total" else "for this token"
        super().__init__(f"too many {what} held open ({limit} {scope}); "
                         f"ask again after {RETRY_AFTER_S} s")
        self.kind = kind
        self.cap = cap


class ReadCap:
    """At most ``total`` reads of one kind held at once, and ``per_token`` by one holder."""

    def __init__(self, kind: Kind, total: int, per_token: int) -> None:
        self.kind = kind
        self.total = total
        self.per_token = per_token
        self._held: dict[str, int] = {}
        self._count = 0

    @property
    def held(self) -> int:
        return self._count

    @contextlib.contextmanager
    def hold(self, holder: str) -> Iterator[None]:
        """Hold one read for ``holder`` while the block runs; raises CapReached (before
        the block) when a cap is reached."""
        if self._count >= self.total:
            metrics.READS_REFUSED.labels(self.kind, "total").inc()
            raise CapReached(self.kind, "total", self.total)
        if self._held.get(holder, 0) >= self.per_token:
            metrics.READS_REFUSED.labels(self.kind, "per_token").inc()
            raise CapReached(self.kind, "per_token", self.per_token)
        self._count += 1
        self._held[holder] = self._held.get(holder, 0) + 1
        metrics.READS_HELD.labels(self.kind).set(self._count)
        try:
            yield
        finally:
            self._count -= 1
            left = self._held[holder] - 1
            if left:
                self._held[holder] = left
            else:
                del self._held[holder]  # the map holds only holders with reads open
            metrics.READS_HELD.labels(self.kind).set(self._count)


def holder_of(authorization: str) -> str:
    """Who holds a read: a digest of the bearer credential the request authenticated
    with (one of the few configured tokens: never kept as such, even in memory)."""
    credential = authorization.partition(" ")[2].strip()
    return hashlib.sha256(credential.encode("utf-8", "surrogateescape")).hexdigest()[:16]
