"""What the HTTP handlers (supervisor/http.py, the status page, the budget API) share:
the service's parts they read and the caps on their costly reads. Its own module so the
status page and the budget API need not import the application that mounts them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from supervisor.budget.base import RateBudget
from supervisor.config import Config
from supervisor.ledger.base import Ledger
from supervisor.model import LedgerStats
from supervisor.push import PushReceiver
from supervisor.readcaps import ReadCap
from supervisor.reconcile import Reconciler
from supervisor.runs import RunOpener, RunWatch


@dataclass
class ApiState:
    """What the handlers need from the service. ``accepting`` turns False at shutdown."""

    config: Config
    ledger: Ledger
    opener: RunOpener
    reconciler: Reconciler
    ready: Callable[[], tuple[bool, dict[str, bool]]]
    runs_changed: RunWatch
    current_rate: Callable[[], float]
    # When n more requests will have been sent (the budget's view: rate, a pause in force,
    # quotas); None: n / current_rate.
    projected_finish: Callable[[int, float], float] | None = None
    # The monitor's last count of the ledger (None before its first): what the status
    # page shows, rather than a second count of the same rows every second.
    ledger_stats: Callable[[], LedgerStats | None] = lambda: None
    accepting: bool = True
    # Push delivery (POST /v1/push/{queue}); None: not configured, the route answers 404.
    push: PushReceiver | None = None
    # The rate budget, for GET /v1/budget and its resume (supervisor/budget_api.py).
    budget: RateBudget | None = None
    long_polls: ReadCap = field(init=False)
    exclusion_reads: ReadCap = field(init=False)
    # One exclusions page read at a time (supervisor/exclusions.py batches).
    exclusion_pages: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        s = self.config.api
        self.long_polls = ReadCap("long_poll", s.max_long_polls, s.max_long_polls_per_token)
        self.exclusion_reads = ReadCap("exclusions", s.max_exclusion_reads,
                                       s.max_exclusion_reads_per_token)
