"""Quotas longer than a second, and the named policies the rate-limit headers advertise.

A real API often has a per-second rate limiter *and* hourly or daily quotas; a request
passes only if all of them admit it. Each quota is a fixed window aligned to the
partner's start (``CountingWindow``), so its resets are predictable under test.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cleanup_sandbox.limits import CountingWindow, Quota

# Name of the rate limiter's policy; kept from when it was the only one so that headers
# of a partner without quotas read exactly as before.
RATE_POLICY = "default"

_WINDOW_NAMES = {1: "second", 60: "minute", 3600: "hour", 86400: "day", 604800: "week"}


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    quota: Quota


def quota_name(window_seconds: float) -> str:
    whole = round(window_seconds)
    if math.isclose(window_seconds, whole) and whole in _WINDOW_NAMES:
        return _WINDOW_NAMES[whole]
    return f"{window_seconds:g}s"


def policy_names(windows: Iterable[float]) -> list[str]:
    """One unique name per quota: "hour", "day", ... and "hour-2" for a second hourly one."""
    names: list[str] = []
    taken = {RATE_POLICY}
    for window in windows:
        base = quota_name(window)
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name)
        names.append(name)
    return names


class QuotaSet:
    """The configured quotas, all aligned to one origin."""

    def __init__(self, quotas: Sequence[tuple[int, float]], origin: float) -> None:
        self.windows = [CountingWindow(limit, window, origin) for limit, window in quotas]
        self.names = policy_names(window for _, window in quotas)

    def __len__(self) -> int:
        return len(self.windows)

    def peek(self, now: float) -> float | None:
        """None when every quota admits one more request, else the longest wait."""
        waits = [wait for w in self.windows if (wait := w.peek(now)) is not None]
        return max(waits) if waits else None

    def commit(self, now: float) -> None:
        for window in self.windows:
            window.commit(now)

    def policies(self, now: float) -> list[Policy]:
        return [
            Policy(name, quota)
            for name, window in zip(self.names, self.windows, strict=True)
            if (quota := window.quota(now)) is not None
        ]


def most_constraining(policies: Sequence[Policy]) -> Policy | None:
    """The policy with the least remaining relative to its limit; the longer reset on a tie.

    On a tie the longer reset wins because that is the wait a client must respect.
    """
    if not policies:
        return None
    return min(
        policies,
        key=lambda p: (p.quota.remaining / max(1, p.quota.limit), -p.quota.reset_seconds),
    )
