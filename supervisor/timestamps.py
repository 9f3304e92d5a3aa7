"""Unix times as partners and Infrai send them: in seconds or in milliseconds, told apart
by magnitude, once for every reader (push timestamps, rate-limit resets)."""

from __future__ import annotations

# Past this a Unix time is in milliseconds: in seconds it would be the year 5138.
MILLIS_FROM = 1e11


def epoch_seconds(value: float) -> float:
    """``value``, a Unix time in seconds or in milliseconds, in seconds."""
    return value / 1000.0 if value >= MILLIS_FROM else value
