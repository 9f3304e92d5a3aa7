"""The partner matrix: the shapes of rate limit a pacing benchmark is run against.

A :class:`Cell` is the partner's limiter shape and how it words its limits; the scenario
brings the rate (and its changes and pauses), so one scenario over the matrix is the same
workload against eight partners that enforce and announce "R per second" differently:

* ``bucket-10`` (the default cell): token bucket of 10 tokens, ``Retry-After`` in seconds;
* ``bucket-2``, ``bucket-1``: the same with almost no burst allowance;
* ``gcra-5-frac``: strict GCRA at 1 ms resolution (burst 5), ``Retry-After: 0.020``;
* ``gcra-5-none``: the same GCRA sending no ``Retry-After`` at all;
* ``sliding-1s``: at most R in any trailing second, ``Retry-After`` as an HTTP-date;
* ``second-xrl``: fixed one-second windows, ``X-RateLimit-*`` headers;
* ``minute-ietf``: a fixed minute of 60 x R, IETF ``RateLimit-Policy``/``RateLimit``.

The worst cell of a scenario is the service row with the highest ratio (then the highest
429 share); a row without a ratio (an error, nothing done) is worse than any.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scenario import Result


@dataclass(frozen=True, slots=True)
class Cell:
    name: str
    window: str = "bucket"  # bucket | gcra | sliding | second | minute
    burst: float = 10.0  # bucket and gcra only; the windows count R x their length
    window_seconds: float | None = None  # sliding only
    retry_after_format: str = "seconds"  # seconds | fractional | http-date | none
    # none | ietf | x-ratelimit | x-ratelimit-epoch | x-ratelimit-epoch-ms
    ratelimit_headers: str = "none"
    # "": the simulator limits; "nginx" / "nginx-retry-after": nginx's limit_req at R in
    # front of an unlimited simulator (gateway.py), the only limit the client meets.
    gateway: str = ""

    def sandbox_args(self) -> list[str]:
        """The partner simulator's flags for this shape (the rate comes from the scenario)."""
        args = ["--window", self.window, "--burst", f"{self.burst:g}",
                "--retry-after-format", self.retry_after_format,
                "--ratelimit-headers", self.ratelimit_headers]
        if self.window_seconds is not None:
            args += ["--window-seconds", f"{self.window_seconds:g}"]
        return args

    def describe(self) -> str:
        if self.gateway:
            ra = "a static Retry-After: 1" if self.gateway == "nginx-retry-after" else \
                "no Retry-After"
            return f"nginx limit_req, no burst, in front of the partner; {ra}"
        shape = {"bucket": f"token bucket, burst {self.burst:g}",
                 "gcra": f"GCRA at 1 ms, burst {self.burst:g}",
                 "sliding": f"sliding log of {self.window_seconds or 1:g} s",
                 "second": "fixed 1 s windows", "minute": "fixed 60 s windows"}[self.window]
        ra = ("no Retry-After" if self.retry_after_format == "none"
              else f"Retry-After {self.retry_after_format}")
        headers = "" if self.ratelimit_headers == "none" else f", {self.ratelimit_headers} headers"
        return f"{shape}; {ra}{headers}"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "window": self.window, "burst": self.burst,
                "window_seconds": self.window_seconds,
                "retry_after_format": self.retry_after_format,
                "ratelimit_headers": self.ratelimit_headers, "gateway": self.gateway}


CELLS: tuple[Cell, ...] = (
    Cell("bucket-10", "bucket", burst=10),
    Cell("bucket-2", "bucket", burst=2),
    Cell("bucket-1", "bucket", burst=1),
    Cell("gcra-5-frac", "gcra", burst=5, retry_after_format="fractional"),
    Cell("gcra-5-none", "gcra", burst=5, retry_after_format="none"),
    Cell("sliding-1s", "sliding", window_seconds=1.0, retry_after_format="http-date"),
    Cell("second-xrl", "second", ratelimit_headers="x-ratelimit"),
    Cell("minute-ietf", "minute", ratelimit_headers="ietf"),
)
DEFAULT_CELL = CELLS[0]
CELLS_BY_NAME = {c.name: c for c in CELLS}

# One partner, a fixed window of R per second, in every way partners word it: how long
# the wait is (X-RateLimit-Reset as seconds left, a Unix time in seconds or in
# milliseconds; the IETF RateLimit t=; Retry-After in seconds or as an HTTP-date). The
# dialects scenario runs over these, not the matrix.
DIALECT_CELLS: tuple[Cell, ...] = (
    Cell("xrl-seconds-left", "second", ratelimit_headers="x-ratelimit"),
    Cell("xrl-epoch-s", "second", ratelimit_headers="x-ratelimit-epoch"),
    Cell("xrl-epoch-ms", "second", ratelimit_headers="x-ratelimit-epoch-ms"),
    Cell("ietf-t", "second", ratelimit_headers="ietf"),
    Cell("retry-after-s", "second", retry_after_format="seconds"),
    Cell("retry-after-date", "second", retry_after_format="http-date"),
)


# Partners of the long runs (the article's 18,400 at 20/s, hidden): the strict bucket of
# one, and a real gateway in front of the partner in both ways its 429 is worded.
LONG_CELLS: tuple[Cell, ...] = (
    Cell("nginx", "bucket", burst=1, gateway="nginx"),
    Cell("nginx-retry-after", "bucket", burst=1, gateway="nginx-retry-after"),
)
# What ``--cells`` may name (the oracle measures any of them).
KNOWN_CELLS = {c.name: c for c in (*CELLS, *LONG_CELLS)}


def select_cells(spec: str | None) -> list[Cell]:
    """``a,b`` into cells, the matrix's in its order first; None or empty: the matrix."""
    if not spec:
        return list(CELLS)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in KNOWN_CELLS]
    if unknown:
        raise SystemExit(f"unknown cell(s) {unknown}; known: {', '.join(KNOWN_CELLS)}")
    return [c for c in KNOWN_CELLS.values() if c.name in names]


def severity(r: Result) -> tuple[float, float]:
    """Sort key, larger is worse: the ratio, then the 429 share; no ratio is the worst."""
    ratio = r.ratio if r.ratio is not None else math.inf
    share = r.share_429 if r.share_429 is not None else math.inf
    return (ratio, share)


def worst(results: Iterable[Result]) -> Result | None:
    rows = list(results)
    return max(rows, key=severity) if rows else None


def best(results: Iterable[Result]) -> Result | None:
    rows = [r for r in results if r.ratio is not None]
    return min(rows, key=severity) if rows else None


def peer_cells(selected: Sequence[Cell], service_rows: Sequence[Result],
               explicit: bool) -> list[Cell]:
    """Where the peers run for one scenario: the default cell and the service's worst.

    Without service rows (``--tools cron,celery``) the peers run over the cells asked for
    with ``--cells``, else over the default cell alone.
    """
    if not service_rows:
        return list(selected) if explicit else [DEFAULT_CELL]
    base = DEFAULT_CELL if DEFAULT_CELL in selected else selected[0]
    bad = worst(service_rows)
    cells = [base]
    if bad is not None and bad.cell in CELLS_BY_NAME and bad.cell != base.name:
        cells.append(CELLS_BY_NAME[bad.cell])
    return cells
