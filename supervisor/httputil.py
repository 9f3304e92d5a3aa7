"""What HTTP itself says, read once for every client (the partner, Infrai, the sinks)."""

from __future__ import annotations

import email.utils
import math
import re
from collections.abc import Callable

# RFC 9110 delay-seconds is 1*DIGIT; a decimal fraction is tolerated, nothing else.
_DELAY_SECONDS = re.compile(r"[0-9]+(\.[0-9]+)?")

# Ignored header values are reported here: (header, why). The partner client counts and
# logs them; other callers (Infrai's client, the sinks) need not.
Ignored = Callable[[str, str], None]


def report_ignored(on_ignored: Ignored | None, header: str, why: str) -> None:
    if on_ignored is not None:
        on_ignored(header, why)


def parse_retry_after(value: str | None, now: float, maximum: float,
                      on_ignored: Ignored | None = None) -> float | None:
    """Seconds to wait from a Retry-After (delay-seconds or HTTP-date, RFC 9110 §10.2.3).

    None when absent or unparseable (reported to ``on_ignored``); clamped to [0, maximum].
    """
    if value is None:
        return None
    value = value.strip()
    if _DELAY_SECONDS.fullmatch(value):
        seconds = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            when = None
        if when is None or when.tzinfo is None:  # RFC 9110 dates are GMT
            report_ignored(on_ignored, "Retry-After", "neither delay-seconds nor an HTTP-date")
            return None
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        report_ignored(on_ignored, "Retry-After", "not a finite number")
        return None
    return min(max(seconds, 0.0), maximum)
