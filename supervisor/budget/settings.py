"""The ``[limits]`` section and its ``[[limits.quota]]`` entries: the partner's ceiling and
how the rate budget adapts under it (supervisor/budget/policy.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from supervisor.configtypes import _positive


@dataclass(frozen=True, slots=True)
class QuotaConfig:
    """A ``[[limits.quota]]`` entry: at most ``limit`` requests in any ``period_seconds``."""

    limit: int = 0
    period_seconds: float = 0.0
    name: str = ""

    def problems(self, key: str) -> list[str]:
        out = []
        if not self.limit > 0:
            out.append(f"{key}.limit must be > 0, got {self.limit}")
        if not self.period_seconds > 0:
            out.append(f"{key}.period_seconds must be > 0, got {self.period_seconds}")
        return out


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    # The documented partner limit: a ceiling the limiter never exceeds.
    rate_per_second: float = 20.0
    # The most requests in flight; the in-flight limit follows the partner's latency below it.
    concurrency: int = 8
    # Tokens the pacer may hold: a little over one, so a late departure is caught up
    # without ever sending two requests back to back (a bucket as large as the rate lets
    # about twice the limit through in one window: aiolimiter#298).
    burst: float = 1.25
    # Pace this fraction under a limit we know (the ceiling, an announced one).
    headroom: float = 0.01
    # On a 429 below the top: x this of the throttled rate (halved instead when refused
    # again within a second of resuming: the limit is far below).
    decrease_factor: float = 0.8
    # On a 429 at the known ceiling: trim the rate by this and pace strictly.
    edge_trim: float = 0.03
    # After a cut, back just below the throttled rate after this long; then a probe that
    # reaches the ceiling after probe_seconds, twice as long after each probe that fails at
    # the same level (at most max_probe_seconds). A per-minute window wants about 60.
    # The convex probe is at 90 % of the way after 97 % of probe_seconds, so a limit that
    # drops and comes back is followed within about recovery + probe of the last cut: 8 s
    # found a return in 9.6 s (bucket of 10) and 12.7 s (sliding second), three runs each,
    # where 12 s took 13.4 and 16.5. The price: a second halving of the gap inside a 30 s
    # first run against a hidden limit (bucket of 10: 1.161 x N/R, 1.126 at 12 s); over
    # 300 s the policy grid is unchanged (bench/policy_grid.py: mean 1.050, 1.049 at 12 s).
    recovery_seconds: float = 8.0
    probe_seconds: float = 8.0
    max_probe_seconds: float = 600.0
    floor_per_second: float = 0.5
    # A Retry-After this long or longer is a pause the partner imposes (maintenance, a
    # window, a storm), not a rate signal: every worker waits, the rate is not cut. A
    # whole-second Retry-After for a wait of a few milliseconds reads as 1 s (seconds) or
    # up to 2 s (HTTP-date), so anything past 2.5 s is a real wait. 0: every 429 cuts.
    long_pause_seconds: float = 2.5
    # What a run learnt (per partner base URL) drifts back towards the ceiling this fast.
    memory_half_life_seconds: float = 7 * 86400.0
    quota: tuple[QuotaConfig, ...] = ()

    @property
    def quotas(self) -> tuple[QuotaConfig, ...]:
        return tuple(q if q.name else dataclasses.replace(q, name=f"{q.period_seconds:g}s")
                     for q in self.quota)

    def problems(self) -> list[str]:
        out = _positive("limits", self, "rate_per_second", "concurrency", "floor_per_second",
                        "recovery_seconds", "probe_seconds", "max_probe_seconds",
                        "memory_half_life_seconds")
        if self.long_pause_seconds < 0:
            out.append(f"limits.long_pause_seconds must be >= 0, got {self.long_pause_seconds}")
        # Every acquisition takes one whole token: a bucket that can never hold one could
        # never grant anything.
        if not self.burst >= 1:
            out.append(f"limits.burst must be >= 1, got {self.burst}")
        for name in ("decrease_factor",):
            value = getattr(self, name)
            if not 0 < value < 1:
                out.append(f"limits.{name} must be > 0 and < 1, got {value}")
        for name in ("headroom", "edge_trim"):
            value = getattr(self, name)
            if not 0 <= value < 0.5:
                out.append(f"limits.{name} must be >= 0 and < 0.5, got {value}")
        if self.floor_per_second > self.rate_per_second > 0:
            out.append("limits.floor_per_second must be <= limits.rate_per_second, "
                       f"got {self.floor_per_second} > {self.rate_per_second}")
        names = [q.name for q in self.quotas]
        for i, q in enumerate(self.quota):
            out += q.problems(f"limits.quota[{i}]")
            if names.count(names[i]) > 1:
                out.append(f"limits.quota[{i}].name {names[i]!r} is used twice")
        return out
