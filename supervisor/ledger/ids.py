"""The IDs the ledger hands out, the same in every backend: an operation's (the partner's
Idempotency-Key), a run's and an event's."""

from __future__ import annotations

import secrets
import time

_last_ms = 0
_seq = 0


def new_operation_id() -> str:
    """A new operation ID, and so the partner's Idempotency-Key: unique and time-ordered.

    Time-ordered (a millisecond timestamp, a counter within the millisecond, then 48
    random bits, like UUIDv7 with a monotonic counter) so a run's operations append to the
    ledger's indexes instead of landing at random places in them (discovery stays linear
    at a million candidates), and so paging by ID returns them in discovery order.
    Assigned once: the unique (run, recipient) row keeps the first ID even when a resumed
    scan reads a page again.
    """
    global _last_ms, _seq
    ms = time.time_ns() // 1_000_000
    if ms <= _last_ms:
        ms, _seq = _last_ms, _seq + 1
        if _seq > 0xFFFF:  # 65,536 in one millisecond: borrow the next one
            ms, _seq = ms + 1, 0
    else:
        _seq = 0
    _last_ms = ms
    return f"op_{ms:012x}{_seq:04x}{secrets.token_hex(6)}"


def new_run_id(now: float) -> str:
    return "run_" + time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + "_" + secrets.token_hex(3)


def new_event_id() -> str:
    """A stable event ID: assigned once, when the event is written, and sent unchanged on
    every delivery. Time-ordered and random like an operation ID, so it stays unique
    across ledger files and databases (a restored backup, a second deployment)."""
    return f"ev_{time.time_ns() // 1_000_000:012x}{secrets.token_hex(8)}"


def new_batch_id() -> str:
    """A batch's ID: the partner's Idempotency-Key for the batch request and a job's tag.
    Time-ordered like an operation's, so a ledger's batches list in the order sent."""
    return "bat_" + new_operation_id()[3:]
