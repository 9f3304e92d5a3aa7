"""How the simulated partner words its limits: Retry-After and the rate-limit header styles.

Pure functions of the wait and the wall-clock time, so every style is testable without a
server and the app only decides where the headers go.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import format_datetime

from cleanup_sandbox.config import RateLimitHeaders, RetryAfterFormat
from cleanup_sandbox.limits import ceil_seconds
from cleanup_sandbox.quotas import Policy, most_constraining

# Float noise must not push an exact 5 ms wait up to 6 ms.
_MS_EPSILON = 1e-6


@dataclass(frozen=True, slots=True)
class RetryAfter:
    value: str
    # How long the header tells the client to stay away, from the moment it was sent;
    # rounding up for the header's resolution makes this at least the real wait.
    announced_seconds: float


def retry_after(seconds: float, fmt: RetryAfterFormat, wall_now: float) -> RetryAfter | None:
    """The Retry-After header for a wait, or None when this partner sends none."""
    if fmt == "none":
        return None
    if fmt == "http-date":
        # HTTP-dates have one-second resolution: round the instant up so a client
        # honouring it never comes back before a token exists.
        at = math.ceil(wall_now + max(seconds, 1.0))
        date = format_datetime(datetime.fromtimestamp(at, tz=UTC), usegmt=True)
        return RetryAfter(date, at - wall_now)
    if fmt == "fractional":
        # Never "0.000": a zero wait invites a hot retry loop just like "0" does.
        millis = max(1, math.ceil(seconds * 1000.0 - _MS_EPSILON))
        return RetryAfter(f"{millis / 1000:.3f}", millis / 1000.0)
    whole = ceil_seconds(seconds)
    return RetryAfter(str(whole), float(whole))


def _sf_string(name: str) -> str:
    # Names are generated ("default", "hour", "10s"), but stay a valid sf-string anyway.
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def ratelimit_headers(
    style: RateLimitHeaders, policies: Sequence[Policy], wall_now: float
) -> dict[str, str]:
    """Headers for one response; ``policies`` lists the rate policy first, then the quotas."""
    chosen = most_constraining(policies)
    if style == "none" or chosen is None:
        return {}
    if style == "ietf":
        # draft-ietf-httpapi-ratelimit-headers-10: every policy in one List field, and the
        # state of the policy closest to refusing (the one a client must pace by).
        return {
            "RateLimit-Policy": ", ".join(
                f"{_sf_string(p.name)};q={p.quota.limit};w={p.quota.window_seconds}"
                for p in policies
            ),
            "RateLimit": (
                f"{_sf_string(chosen.name)};r={chosen.quota.remaining};"
                f"t={chosen.quota.reset_seconds}"
            ),
        }
    reset: float = chosen.quota.reset_seconds
    if style == "x-ratelimit-epoch":
        # GitHub style: the Unix second at which the window resets, rounded up so a client
        # waiting for it is never early.
        reset = math.ceil(wall_now + reset)
    elif style == "x-ratelimit-epoch-ms":
        # The same instant in Unix milliseconds, as other APIs send it.
        reset = math.ceil((wall_now + reset) * 1000.0 - _MS_EPSILON)
    return {
        "X-RateLimit-Limit": str(chosen.quota.limit),
        "X-RateLimit-Remaining": str(chosen.quota.remaining),
        "X-RateLimit-Reset": str(reset),
    }
