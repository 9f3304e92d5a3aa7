"""What a tick may say, wherever it comes from: the trigger webhook, a pulled tick queue,
the configuration. One rule each, so a run one path accepts is one every other path (the
exclusions API above all) can name.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

# Visible ASCII without "@" and "#": those separate a tick key's parts (schedule@slot,
# schedule#key), so a name holding one could make two ticks' keys collide. No spaces or
# control characters either: the name goes into logs and into a query string.
SCHEDULE_NAME = r'^[!"$-?A-~]{1,100}$'
_SCHEDULE = re.compile(SCHEDULE_NAME)
SCHEDULE_RULE = "1 to 100 visible ASCII characters, without '@' or '#'"
# A tick's own key (the webhook's Idempotency-Key, a queued tick's "key"): visible ASCII
# only, as HTTP header values travel safely.
TICK_KEY = r"^[!-~]{1,200}$"


def check_schedule(value: object) -> str | None:
    """Why ``value`` is not a schedule name, or None when it is one."""
    if not isinstance(value, str) or not _SCHEDULE.fullmatch(value):
        return f"schedule must be a string of {SCHEDULE_RULE}"
    return None


def parse_slot(value: Any) -> datetime:
    """A tick's ``scheduled_for``: an ISO 8601 time with a UTC offset, or a Unix time,
    whose UTC instant exists (the tick key and the ledger use it). Raises ValueError
    naming the field."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, UTC)
        except (OverflowError, OSError, ValueError):
            raise ValueError("scheduled_for is out of range") from None
    if isinstance(value, str):
        try:
            slot = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError("scheduled_for must be an ISO 8601 time or a Unix time") from None
        if slot.tzinfo is None:
            raise ValueError("scheduled_for must carry a UTC offset")
        try:
            # Year 1..9999 in UTC: 0001-01-01T00:00+01:00 is not (astimezone overflows).
            slot.astimezone(UTC).timestamp()
        except (OverflowError, OSError, ValueError):
            raise ValueError("scheduled_for is out of range") from None
        return slot
    raise ValueError("scheduled_for must be an ISO 8601 time or a Unix time")
