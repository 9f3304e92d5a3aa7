"""``cleanup-supervisor plan``: the article's decision as arithmetic.

N candidates at a partner's R requests per second need N / R seconds at the very least.
A cron provider that stops an invocation after its execution ceiling (900 s is common)
can do the job alone only when N / R fits well inside it; otherwise the drain needs a
queue and a paced worker: this service. The drain takes N / R times the overhead this
service measured against eight partner shapes (docs/bench-results.md), and the run must
end before the digest's cutoff.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import aiohttp

from supervisor.config import Config
from supervisor.errors import SourceError
from supervisor.schedule import next_slot
from supervisor.sources import source_for

# Cron alone is "fits" only with this share of the ceiling to spare: a retry, a 429 pause
# or a slow page eats into it, and the provider kills the invocation at the ceiling.
CRON_MARGIN = 0.5


@dataclass(frozen=True, slots=True)
class Overhead:
    """Drain time / (N / R) as bench/run.py measured it: the median and the worst of eight
    partner shapes (token buckets of 10, 2 and 1, GCRA with and without fractional
    Retry-After, a sliding window, X-RateLimit and IETF headers)."""

    label: str
    typical: float
    worst: float


# Commit 953e7d7 (docs/bench-results.md), N = 1,500 at 50/s on a 2-core VM; longer runs
# come closer to 1 (18,400 at 20/s through Infrai: 1.010).
OVERHEADS: dict[str, Overhead] = {
    "known": Overhead("limits.rate_per_second is the partner's limit", 1.012, 1.134),
    "learnt": Overhead("the limit is learnt from 429s (a first run)", 1.090, 1.505),
    "remembered": Overhead("the limit was learnt by an earlier run", 1.013, 1.104),
}
Limit = Literal["known", "learnt", "remembered"]


@dataclass(frozen=True, slots=True)
class Plan:
    candidates: int
    rate: float
    cron_ceiling_s: float
    limit: Limit
    start: float  # Unix time the run opens
    cutoff_s: float | None  # digest cutoff, seconds after the start
    counted_pages: int | None = None  # when N was counted from the source
    # Quotas longer than a second ([[limits.quota]]): (name, limit, period in seconds).
    quotas: tuple[tuple[str, int, float], ...] = ()

    @property
    def ideal_s(self) -> float:
        return self.candidates / self.rate

    def quota_s(self, limit: int, period_s: float) -> float:
        """The least time ``limit`` requests per ``period_s`` allow N in: every full
        allowance but the last waits out a period."""
        return (math.ceil(self.candidates / limit) - 1) * period_s

    @property
    def least_s(self) -> float:
        """The least any tool can take: N / R, or longer when a quota allows less."""
        return max([self.ideal_s, *(self.quota_s(n, p) for _, n, p in self.quotas)])

    @property
    def cron_fits(self) -> bool:
        return self.least_s <= self.cron_ceiling_s * CRON_MARGIN

    @property
    def overhead(self) -> Overhead:
        return OVERHEADS[self.limit]

    @property
    def drain_s(self) -> tuple[float, float]:
        quota = max([0.0, *(self.quota_s(n, p) for _, n, p in self.quotas)])
        return (max(self.ideal_s * self.overhead.typical, quota),
                max(self.ideal_s * self.overhead.worst, quota))

    @property
    def cutoff(self) -> float | None:
        return None if self.cutoff_s is None else self.start + self.cutoff_s

    @property
    def fits_cutoff(self) -> bool | None:
        """Judged on the worst case: the digest does not wait for a lucky partner."""
        return None if self.cutoff is None else self.start + self.drain_s[1] <= self.cutoff

    def as_dict(self) -> dict[str, Any]:
        typical, worst = self.drain_s
        return {**dataclasses.asdict(self), "ideal_seconds": self.ideal_s,
                "least_seconds": self.least_s,
                "cron_alone_fits": self.cron_fits, "overhead": dataclasses.asdict(self.overhead),
                "drain_seconds": {"typical": typical, "worst": worst},
                "finish": {"typical": self.start + typical, "worst": self.start + worst},
                "digest_cutoff": self.cutoff, "fits_digest_cutoff": self.fits_cutoff}


def duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    parts = [f"{h} h" if h else "", f"{m} min" if m else "", f"{s} s" if s or not (h or m) else ""]
    return " ".join(p for p in parts if p)


def _when(ts: float) -> str:
    try:
        return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):  # a drain of centuries: no calendar date
        return "beyond any date"


def render(plan: Plan) -> str:
    p = plan
    typical, worst = p.drain_s
    counted = f" (counted from the source, {p.counted_pages} pages)" if p.counted_pages else ""
    lines = [
        f"candidates     N = {p.candidates:,}{counted}",
        f"partner rate   R = {p.rate:g}/s",
        f"N / R            = {duration(p.ideal_s)} ({p.ideal_s:,.0f} s): the least any tool "
        "can take",
    ]
    for name, limit, period in p.quotas:
        lines.append(f"quota {name or 'unnamed':<10} {limit:,} per {duration(period)}: N needs at "
                     f"least {duration(p.quota_s(limit, period))}")
    share = p.least_s / p.cron_ceiling_s
    if p.cron_fits:
        lines.append(f"cron alone       fits: the least is {share:.0%} of the "
                     f"{duration(p.cron_ceiling_s)} ceiling, with room for retries and 429 pauses")
    elif share <= 1:
        lines.append(f"cron alone       too tight: the least is {share:.0%} of the "
                     f"{duration(p.cron_ceiling_s)} ceiling; one slow page or 429 pause and the "
                     "invocation is killed mid-drain")
    else:
        lines.append(f"cron alone       does not fit: the least is {share:.0%} of the "
                     f"{duration(p.cron_ceiling_s)} ceiling, even at the partner's full rate")
    lines += [
        f"drain here       {duration(typical)} typical (x{p.overhead.typical:.3f}), "
        f"{duration(worst)} worst (x{p.overhead.worst:.3f}): {p.overhead.label}",
        f"start            {_when(p.start)}",
        f"finish           {_when(p.start + typical)} typical, {_when(p.start + worst)} worst",
    ]
    if p.cutoff is None:
        lines.append("digest cutoff    not set (schedule.digest_cutoff_seconds, or --cutoff-seconds)")
    else:
        slack = p.cutoff - (p.start + worst)
        verdict = (f"fits, {duration(slack)} to spare in the worst case" if slack >= 0 else
                   f"MISSED by {duration(-slack)} in the worst case: raise the partner's rate, "
                   "start earlier, or let the digest exclude what is left (GET /v1/exclusions)")
        lines.append(f"digest cutoff    {_when(p.cutoff)}: {verdict}")
    return "\n".join(lines)


def start_time(config: Config, now: datetime) -> float:
    """The next scheduled slot when the schedule has a cron expression, else now."""
    s = config.schedule
    if s.cron is None:
        return now.timestamp()
    return next_slot(s.cron, s.timezone, now).timestamp()


async def count_source(config: Config) -> tuple[int, int]:
    """Distinct candidate IDs in the configured source and the pages read. Raises
    SourceError (the scan's own errors) when a page cannot be read."""
    c = config.source
    async with aiohttp.ClientSession() as session:
        if c.kind == "inline":
            raise SourceError("source.kind is 'inline': the IDs come with each tick; "
                              "give --candidates N")
        source = source_for({"kind": c.kind}, c, session)
        seen: set[str] = set()
        cursor: str | None = None
        pages = 0
        while True:
            page = await source.page(cursor, c.page_size)
            pages += 1
            seen.update(page.ids)
            if page.next_cursor is None:
                return len(seen), pages
            cursor = page.next_cursor
