"""The rate budget's gauges, published from one snapshot: the budget knows its own state,
the metrics module only declares the series."""

from __future__ import annotations

from supervisor import metrics
from supervisor.budget.base import Snapshot

# The policies that have a quota series now: one no longer in the budget's snapshot (a
# partner-named policy evicted, or whose reset passed) loses its series, so the labels
# stay as bounded as the budget's own memory of them (review L4).
_quota_series: set[str] = set()


def publish_budget(snapshot: Snapshot) -> None:
    """The rate budget's gauges, from one snapshot (the monitor calls this every second)."""
    state = snapshot.state
    metrics.LIMITER_RATE.set(state.rate)
    metrics.LIMITER_CEILING.set(snapshot.ceiling)
    metrics.LIMITER_PAUSED_UNTIL.set(state.paused_until)
    metrics.LIMITER_LEARNT.set(state.w_max or 0.0)
    metrics.LIMITER_ANNOUNCED.set(state.announced or 0.0)
    metrics.LIMITER_CONCURRENCY.set(snapshot.concurrency_limit)
    metrics.LIMITER_CONCURRENCY_BOUND.set(1 if snapshot.concurrency_bound else 0)
    for quota in snapshot.quotas:
        metrics.LIMITER_QUOTA_REMAINING.labels(quota.name).set(quota.remaining)
        metrics.LIMITER_QUOTA_RESET.labels(quota.name).set(quota.resets_at)
    names = {quota.name for quota in snapshot.quotas}
    for gone in _quota_series - names:
        metrics.LIMITER_QUOTA_REMAINING.remove(gone)
        metrics.LIMITER_QUOTA_RESET.remove(gone)
    _quota_series.intersection_update(names)
    _quota_series.update(names)


def publish_items(snapshot: Snapshot) -> None:
    """The ids' budget's rate and learnt limit, where a partner counts both
    (supervisor/budget/pair.py)."""
    metrics.LIMITER_ITEMS_RATE.set(snapshot.state.rate)
    metrics.LIMITER_ITEMS_LEARNT.set(snapshot.state.w_max or 0.0)
