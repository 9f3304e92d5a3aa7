"""The ``[api]`` section: bounds on the reads a client holds open (supervisor/readcaps.py)."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.configtypes import _positive


@dataclass(frozen=True, slots=True)
class ApiConfig:
    # Long-polls (GET /v1/runs/{id}?wait=done) and exclusions reads (GET /v1/exclusions,
    # paged or streamed) held at once, in total and per token. Past a cap the request is
    # answered 429 with Retry-After.
    max_long_polls: int = 1000
    max_long_polls_per_token: int = 500
    max_exclusion_reads: int = 32
    max_exclusion_reads_per_token: int = 20

    def problems(self) -> list[str]:
        out = _positive("api", self, "max_long_polls", "max_long_polls_per_token",
                        "max_exclusion_reads", "max_exclusion_reads_per_token")
        for cap in ("max_long_polls", "max_exclusion_reads"):
            total, per_token = getattr(self, cap), getattr(self, f"{cap}_per_token")
            if per_token > total:
                out.append(f"api.{cap}_per_token must be <= api.{cap}, "
                           f"got {per_token} > {total}")
        return out
