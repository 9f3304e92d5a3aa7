"""``cleanup-supervisor plan``: the article's decision as arithmetic.

N candidates at a partner's R requests per second need N / R seconds at the very least.
A cron provider that stops an invocation after its execution ceiling (900 s is common)
can do the job alone only when N / R fits well inside it; otherwise the drain needs a
queue and a paced worker: this service. The drain takes N / R times the overhead this
service measured against eight partner shapes (docs/bench-results.md), and the run must
end before the digest's cutoff.

A batch partner ([batch], docs/batch.md) changes what R counts. Charged per request, a
batch of K ids is one request: ceil(N / K) / R, unless every id of an accepted batch must
be probed, one request each. Charged per id, R is ids per second and N / R stands. A job
partner adds the jobs' own time, at most max_jobs_in_flight at once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import aiohttp

from supervisor.batchsettings import BatchConfig, Cost, Shape
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
class Batching:
    """A batch partner's numbers, as [batch] (or the command's flags) give them."""

    shape: Shape  # "per_item", "accepted" or "job" (no Batching at all: one DELETE each)
    size: int  # K, batch.max_items
    cost: Cost  # what R counts: "requests", or "items" (ids); "both": R and items_per_second
    # An accepted batch says nothing per id: each id is probed, unless
    # batch.settle_accepted_unprobed_risking_silent_misses.
    probe_accepted: bool = True
    max_jobs_in_flight: int = 4
    job_s: float | None = None  # how long one job takes at the partner; None: unknown
    poll_initial_s: float = 0.5
    poll_max_s: float = 30.0
    items_per_second: float = 0.0  # "both": the partner's limit on ids


def batching(cfg: BatchConfig, shape: Shape | None = None, size: int | None = None,
             cost: Cost | None = None, job_s: float | None = None,
             items_per_second: float | None = None) -> Batching | None:
    """[batch] with the command's overrides; None for one DELETE per recipient."""
    shape = cfg.shape if shape is None else shape
    if shape == "":
        return None
    return Batching(shape=shape, size=cfg.max_items if size is None else size,
                    cost=cfg.cost if cost is None else cost,
                    probe_accepted=not cfg.settle_accepted_unprobed_risking_silent_misses,
                    max_jobs_in_flight=cfg.max_jobs_in_flight, job_s=job_s,
                    poll_initial_s=cfg.poll_initial_seconds, poll_max_s=cfg.poll_max_seconds,
                    items_per_second=cfg.items_per_second if items_per_second is None
                    else items_per_second)


def polls_per_job(job_s: float, initial_s: float, max_s: float) -> int:
    """The status reads of one job that takes ``job_s``, as the job poller spaces them: the
    first ``initial_s`` after the submission, then each after as long as the job's age (its
    age doubles at every read) until that reaches ``max_s``, then every ``max_s``. The last
    read is the one that sees the job done."""
    polls, age = 1, initial_s
    while age < job_s:
        wait = min(max_s, max(initial_s, age))
        if wait >= max_s:  # counted, not looped: a job of days read every 30 s
            return polls + math.ceil((job_s - age) / max_s)
        polls, age = polls + 1, age + wait
    return polls


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
    batch: Batching | None = None  # None: one DELETE per recipient

    @property
    def shape(self) -> str:
        return "single" if self.batch is None else self.batch.shape

    @property
    def batches(self) -> int:
        """Requests that carry deletions: one per recipient, or ceil(N / K)."""
        b = self.batch
        return self.candidates if b is None else math.ceil(self.candidates / b.size)

    @property
    def probes(self) -> int:
        """An accepted batch's ids, each confirmed by a probe of its own."""
        b = self.batch
        return self.candidates if b and b.shape == "accepted" and b.probe_accepted else 0

    @property
    def polls(self) -> int | None:
        """Status reads of every job; None when the jobs' duration is not given."""
        b = self.batch
        if b is None or b.shape != "job":
            return 0
        if b.job_s is None:
            return None
        return self.batches * polls_per_job(b.job_s, b.poll_initial_s, b.poll_max_s)

    @property
    def requests(self) -> int:
        """Every request the drain sends (polls counted only when known)."""
        return self.batches + self.probes + (self.polls or 0)

    @property
    def units(self) -> int:
        """What R and the quotas count. Per request: every request. Per id: every id
        deleted or probed; a job's status read carries no id."""
        b = self.batch
        if b is None:
            return self.candidates
        if b.cost == "items":
            return self.candidates + self.probes
        return self.requests

    @property
    def items_s(self) -> float:
        """Under two limits, the least the ids' limit allows: every request takes at
        least one id's token (a probe, a poll) and a batch one per id."""
        b = self.batch
        if b is None or b.cost != "both" or b.items_per_second <= 0:
            return 0.0
        return (self.candidates + self.probes + (self.polls or 0)) / b.items_per_second

    @property
    def ideal_s(self) -> float:
        return max(self.units / self.rate, self.items_s)

    def quota_s(self, limit: int, period_s: float) -> float:
        """The least time ``limit`` units per ``period_s`` allow the drain in: every full
        allowance but the last waits out a period."""
        return (math.ceil(self.units / limit) - 1) * period_s

    @property
    def waves(self) -> int:
        """Rounds of jobs: at most max_jobs_in_flight run at once."""
        b = self.batch
        return 0 if b is None or b.shape != "job" else math.ceil(
            self.batches / b.max_jobs_in_flight)

    @property
    def job_floor_s(self) -> float | None:
        """The jobs' own time: each round takes one job's duration. None when unknown."""
        b = self.batch
        if b is None or b.shape != "job":
            return 0.0
        return None if b.job_s is None else self.waves * b.job_s

    @property
    def least_s(self) -> float:
        """The least any tool can take: N / R, or longer when a quota allows less or the
        jobs take longer (a job's unknown duration counts as none)."""
        return max([self.ideal_s, self.job_floor_s or 0.0,
                    *(self.quota_s(n, p) for _, n, p in self.quotas)])

    @property
    def cron_fits(self) -> bool | None:
        """None when jobs of an unknown duration decide it."""
        if self.job_floor_s is None:
            return None
        return self.least_s <= self.cron_ceiling_s * CRON_MARGIN

    @property
    def overhead(self) -> Overhead:
        return OVERHEADS[self.limit]

    @property
    def drain_s(self) -> tuple[float, float]:
        # The overhead is this service's pacing: the partner's job time carries none.
        floor = max([self.job_floor_s or 0.0, *(self.quota_s(n, p) for _, n, p in self.quotas)])
        return (max(self.ideal_s * self.overhead.typical, floor),
                max(self.ideal_s * self.overhead.worst, floor))

    @property
    def cutoff(self) -> float | None:
        return None if self.cutoff_s is None else self.start + self.cutoff_s

    @property
    def fits_cutoff(self) -> bool | None:
        """Judged on the worst case: the digest does not wait for a lucky partner. Jobs of
        an unknown duration can only miss it."""
        if self.cutoff is None:
            return None
        fits = self.start + self.drain_s[1] <= self.cutoff
        return None if fits and self.job_floor_s is None else fits

    def as_dict(self) -> dict[str, Any]:
        typical, worst = self.drain_s
        return {**dataclasses.asdict(self), "ideal_seconds": self.ideal_s,
                "least_seconds": self.least_s, "shape": self.shape, "batches": self.batches,
                "probes": self.probes, "polls": self.polls, "requests": self.requests,
                "units": self.units, "job_waves": self.waves,
                "job_floor_seconds": self.job_floor_s,
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


def _seconds(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _least_lines(p: Plan) -> list[str]:
    """Which shape the numbers are for, and the least time the rate allows."""
    b = p.batch
    if b is None:
        return ["shape            single: one DELETE per recipient (batch.shape = \"\")",
                f"N / R            = {duration(p.ideal_s)} ({p.ideal_s:,.0f} s): the least any "
                "tool can take"]
    unit = "ids" if b.cost == "items" else "requests"
    lines = [f"shape            batch {b.shape}: up to K = {b.size:,} ids a request; R counts "
             f"{unit} (batch.cost = \"{b.cost}\")",
             f"requests         ceil(N / K) = {p.batches:,} batch{'es' if p.batches > 1 else ''}"
             + (f" + {p.probes:,} probes" if p.probes else "")
             + (f" + {p.polls:,} polls" if p.polls else "")
             + (f" = {p.requests:,}" if p.requests != p.batches else "")]
    if b.cost == "items":
        formula = "(N + N probes) / R" if p.probes else "N / R"
    elif p.probes:
        formula = "(ceil(N / K) + N) / R"
    else:
        formula = "(ceil(N / K) + polls) / R" if p.polls else "ceil(N / K) / R"
    least = "the rate allows (the jobs' time aside)" if b.shape == "job" else "any tool can take"
    lines.append(f"{formula:<16} = {duration(p.ideal_s)} ({_seconds(p.ideal_s)} s): the least "
                 f"{least}")
    single_s = p.candidates / p.rate
    if b.cost == "both":
        binds = "the ids' limit binds" if p.items_s > p.requests / p.rate \
            else "the requests' limit binds"
        lines.append(f"two limits       {b.items_per_second:g} ids/s too (batch.items_per_second): "
                     f"(N + probes + polls) / {b.items_per_second:g} = {duration(p.items_s)}; "
                     f"{binds}")
    if b.cost == "items":
        lines.append(f"per id           R is ids per second: N / R ({duration(single_s)}) whatever "
                     f"K, batches do not speed it up; they send {p.batches:,} requests instead of "
                     f"{p.candidates:,}")
    if b.shape == "accepted" and p.probes:
        # Said outright: it is what makes an accepted partner no faster than singles.
        lines.append("probes           an accepted batch says nothing per id: each of the N ids is "
                     "probed, one request of the same budget, so an accepted partner costs "
                     + ("twice" if b.cost == "items" else "about as much as")
                     + f" one DELETE per recipient at the same rate (N / R = "
                     f"{duration(single_s)})")
    elif b.shape == "accepted":
        lines.append("probes           none: batch.settle_accepted_unprobed_risking_silent_misses "
                     "settles every id of an accepted batch deleted unprobed; a silent miss goes "
                     "unseen")
    if b.shape == "job":
        jobs = (f"jobs             {p.batches:,} submissions paced at R, at most "
                f"{b.max_jobs_in_flight} in flight (batch.max_jobs_in_flight): ")
        if b.job_s is None:
            lines.append(jobs + f"the floor is ceil({p.batches:,} / {b.max_jobs_in_flight}) x D = "
                         f"{p.waves:,} x D for jobs of D seconds each (--job-seconds D), plus "
                         "their polls, each one request of the budget")
        else:
            per_job = polls_per_job(b.job_s, b.poll_initial_s, b.poll_max_s)
            lines += [jobs + f"{p.waves:,} rounds x {duration(b.job_s)} = "
                      f"{duration(p.job_floor_s or 0.0)}",
                      f"polls            {per_job} a job (from {b.poll_initial_s:g} s, the wait "
                      f"doubling to {b.poll_max_s:g} s), {p.polls:,} in all, each one request of "
                      "the budget"
                      + (" (not counted: they carry no id)" if b.cost == "items" else "")]
    return lines


def _cron_line(p: Plan) -> str:
    ceiling = duration(p.cron_ceiling_s)
    share = p.least_s / p.cron_ceiling_s
    whole = f"one request takes all {p.candidates:,} ids (N <= K); " \
        if p.batch is not None and p.batches == 1 else ""
    if p.cron_fits is None:
        return ("cron alone       unknown: the jobs' own time decides (--job-seconds D); the "
                f"requests alone are {share:.0%} of the {ceiling} ceiling")
    if p.cron_fits:
        return (f"cron alone       fits: {whole}the least is {share:.0%} of the {ceiling} "
                "ceiling, with room for retries and 429 pauses")
    if share <= 1:
        return (f"cron alone       too tight: the least is {share:.0%} of the {ceiling} ceiling; "
                "one slow page or 429 pause and the invocation is killed mid-drain")
    return (f"cron alone       does not fit: the least is {share:.0%} of the {ceiling} ceiling, "
            "even at the partner's full rate")


def render(plan: Plan) -> str:
    p = plan
    typical, worst = p.drain_s
    counted = f" (counted from the source, {p.counted_pages} pages)" if p.counted_pages else ""
    unit = "ids" if p.batch is not None and p.batch.cost == "items" else ""
    lines = [
        f"candidates     N = {p.candidates:,}{counted}",
        f"partner rate   R = {p.rate:g}{' ' + unit if unit else ''}/s",
        *_least_lines(p),
    ]
    for name, limit, period in p.quotas:
        lines.append(f"quota {name or 'unnamed':<10} {limit:,} per {duration(period)}: N needs at "
                     f"least {duration(p.quota_s(limit, period))}")
    lines.append(_cron_line(p))
    drain = (f"drain here       {duration(typical)} typical (x{p.overhead.typical:.3f}), "
             f"{duration(worst)} worst (x{p.overhead.worst:.3f}): {p.overhead.label}")
    if p.job_floor_s is None:
        drain += "; plus the jobs' own time"
    elif p.job_floor_s and p.job_floor_s >= p.ideal_s * p.overhead.worst:
        drain += "; the jobs' own time, not the rate, bounds it"
    lines += [
        drain,
        f"start            {_when(p.start)}",
        f"finish           {_when(p.start + typical)} typical, {_when(p.start + worst)} worst",
    ]
    if p.cutoff is None:
        lines.append("digest cutoff    not set (schedule.digest_cutoff_seconds, or --cutoff-seconds)")
    else:
        slack = p.cutoff - (p.start + worst)
        if slack < 0:
            verdict = (f"MISSED by {duration(-slack)} in the worst case: raise the partner's "
                       "rate, start earlier, or let the digest exclude what is left "
                       "(GET /v1/exclusions)")
        elif p.fits_cutoff is None:
            verdict = (f"{duration(slack)} to spare before the jobs' own time, which decides "
                       "(--job-seconds D)")
        else:
            verdict = f"fits, {duration(slack)} to spare in the worst case"
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
