"""What the adaptive rate policy reads and writes: its configuration, its state (a small
frozen record that serialises to JSON, so a replica's row or a restart reads back the same
thing) and the events it is stepped with. The rules are in :mod:`supervisor.budget.policy`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from supervisor.budget.settings import LimitsConfig


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    ceiling: float
    floor: float
    headroom: float
    decrease_factor: float
    edge_trim: float
    recovery_s: float
    probe_s: float
    max_probe_s: float
    long_pause_s: float
    half_life_s: float
    # No pause ends later than this after it began (partner.max_retry_after_seconds).
    max_pause_s: float = 900.0

    @classmethod
    def from_limits(cls, limits: LimitsConfig, max_pause_s: float = 900.0) -> PolicyConfig:
        return cls(
            ceiling=limits.rate_per_second,
            floor=min(limits.floor_per_second, limits.rate_per_second),
            headroom=limits.headroom,
            decrease_factor=limits.decrease_factor,
            edge_trim=limits.edge_trim,
            recovery_s=limits.recovery_seconds,
            probe_s=limits.probe_seconds,
            max_probe_s=max(limits.probe_seconds, limits.max_probe_seconds),
            long_pause_s=limits.long_pause_seconds,
            half_life_s=limits.memory_half_life_seconds,
            max_pause_s=max_pause_s,
        )


@dataclass(frozen=True, slots=True)
class BudgetState:
    """Everything the policy knows. Times are wall-clock seconds; 0 means never."""

    rate: float
    w_max: float | None = None  # the learnt limit: the plateau of the recovery
    cut_to: float = 0.0
    cut_at: float = 0.0
    probe_s: float = 0.0
    strict: bool = False  # the partner refuses any early arrival: no catch-up bursts
    announced: float | None = None  # per-second limit from the partner's headers
    paused_until: float = 0.0
    pause_reason: str = ""
    learnt_at: float = 0.0  # when w_max was last confirmed or lowered
    blind: int = 0  # 429s in a row without a Retry-After: our own backoff doubles
    blind_since: float = 0.0  # when the first of them came (read only while blind > 0)
    last_cut: str = ""  # edge | top | lower | probe: what the last 429 was taken for
    verified: float | None = None  # a plateau that held for 2 x recovery_s: memory trusts it
    resumed_at: float = 0.0  # when an operator last lifted the pause: older holds are void
    quick: int = 0  # cuts in a row, each refused within QUICK_WITHIN_S of resuming
    # The highest level that held through a recovery period before a probe above it
    # failed: the limit lies between it and what failed, so a step down goes halfway to it.
    held: float | None = None
    # The run's first overload measures the partner's burst: when the first request left
    # (``began``), and the rate and seconds it ran at the top before the first 429.
    began: float = 0.0
    first_rate: float = 0.0
    first_s: float = 0.0
    estimate: float | None = None  # the limit the last failed probe measured
    # Refusals of the level ``kept_level`` kept as jitter since ``kept_since`` (when the
    # level was set): it is kept while they come no more often than jitter_hold says.
    kept: int = 0
    kept_level: float = 0.0
    kept_since: float = 0.0
    # Steps down for a refusal sooner than jitter_hold allows, not yet stepped back up,
    # and how long the level must hold to step back one (any other change resets them).
    steps: int = 0
    step_back_s: float = 0.0
    recover_s: float | None = None  # the recovery's length, when not recovery_s
    # A measured limit on trial: a level between it and the rate that failed is held
    # until ``trial_until``; refused by then, the partner is the bucket measured and the
    # level goes to ``trial_back``.
    trial_until: float = 0.0
    trial_back: float = 0.0
    # What a 429 without Retry-After cut, as it was: restored if the next request is
    # refused too with nothing accepted between (a storm, not a limit).
    uncut: dict[str, Any] | None = field(default=None, hash=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BudgetState:
        fields = set(cls.__dataclass_fields__)
        kept = {k: v for k, v in data.items() if k in fields}
        if not isinstance(kept.get("uncut"), dict | None):
            kept["uncut"] = None  # written by something else: nothing to undo
        return cls(**kept)


@dataclass(frozen=True, slots=True)
class Success:
    """A request the partner accepted (or answered 404), granted at ``sent_at`` (0: not
    known, taken as now)."""

    sent_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Throttle:
    """A 429 for a request granted at ``sent_at``, spaced at the rate read at ``paced_at``
    (0: then; slots reserved ahead follow the curve late: _measured)."""

    sent_at: float
    retry_after_s: float | None
    paced_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Announce:
    """The partner's per-second limit from its rate-limit headers (None: no short policy)."""

    rate: float | None


@dataclass(frozen=True, slots=True)
class Pause:
    """Hold every worker until ``until`` (a quota window, an operator, a restart)."""

    until: float
    reason: str


@dataclass(frozen=True, slots=True)
class Resume:
    """An operator lifts the pause; with ``forget_limit`` also what was learnt (the limit
    from 429s, the partner's announced one, strict pacing): the rate starts afresh."""

    forget_limit: bool = False


Event = Success | Throttle | Announce | Pause | Resume
