"""Static configuration of the partner API simulator, and the knobs that may change at runtime."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

Window = Literal["bucket", "gcra", "sliding", "second", "minute"]
RetryAfterFormat = Literal["seconds", "fractional", "http-date", "none"]
RateLimitHeaders = Literal[
    "none", "ietf", "x-ratelimit", "x-ratelimit-epoch", "x-ratelimit-epoch-ms"
]

WINDOWS: tuple[Window, ...] = ("bucket", "gcra", "sliding", "second", "minute")
RETRY_AFTER_FORMATS: tuple[RetryAfterFormat, ...] = ("seconds", "fractional", "http-date", "none")
BatchShape = Literal["", "per_item", "accepted", "job"]
BatchDuplicates = Literal["once", "error"]
BatchCost = Literal["request", "item"]
BatchVerdict = Literal["status", "success"]
BatchResultIds = Literal["always", "omit-on-error"]

BATCH_SHAPES: tuple[BatchShape, ...] = ("", "per_item", "accepted", "job")
BATCH_DUPLICATES: tuple[BatchDuplicates, ...] = ("once", "error")
BATCH_COSTS: tuple[BatchCost, ...] = ("request", "item")
BATCH_VERDICTS: tuple[BatchVerdict, ...] = ("status", "success")
BATCH_RESULT_IDS: tuple[BatchResultIds, ...] = ("always", "omit-on-error")
RATELIMIT_HEADER_STYLES: tuple[RateLimitHeaders, ...] = (
    "none",
    "ietf",
    "x-ratelimit",
    "x-ratelimit-epoch",
    "x-ratelimit-epoch-ms",
)


def check_probability(name: str, value: float) -> float:
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be within [0, 1], got {value!r}")
    return float(value)


def check_non_negative(name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_quotas(quotas: object) -> tuple[tuple[int, float], ...]:
    """Normalise (limit, window seconds) pairs; lists from JSON are accepted too."""
    if not isinstance(quotas, tuple | list):
        raise ValueError(f"quotas must be a sequence of (limit, window_seconds), got {quotas!r}")
    checked: list[tuple[int, float]] = []
    for entry in quotas:
        if not isinstance(entry, tuple | list) or len(entry) != 2:
            raise ValueError(f"quotas entries must be (limit, window_seconds), got {entry!r}")
        limit, window = entry
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"quotas limit must be an int >= 1, got {limit!r}")
        if not isinstance(window, int | float):
            raise ValueError(f"quotas window_seconds must be a number, got {window!r}")
        checked.append((limit, check_positive("quotas window_seconds", window)))
    return tuple(checked)


def parse_quota(spec: str) -> tuple[int, float]:
    """``LIMIT/SECONDS`` as the CLI takes it, e.g. ``3000/3600``."""
    limit_text, sep, window_text = spec.partition("/")
    try:
        if not sep:
            raise ValueError
        limit, window = int(limit_text), float(window_text)
    except ValueError:
        raise ValueError(f"quota must be LIMIT/SECONDS (e.g. 3000/3600), got {spec!r}") from None
    return check_quotas([(limit, window)])[0]


def check_rate(rate_per_second: float, burst: float) -> None:
    # rate <= 0 means "unlimited", so only NaN/inf are nonsense here.
    if not math.isfinite(rate_per_second):
        raise ValueError(f"rate_per_second must be finite, got {rate_per_second!r}")
    check_non_negative("burst", burst)
    if rate_per_second > 0 and burst < 1.0:
        # A bucket that can never hold a whole token would refuse every request forever.
        raise ValueError(f"burst must be >= 1 when rate limiting is enabled, got {burst!r}")


@dataclass(frozen=True, slots=True)
class SandboxConfig:
    """Everything that shapes one simulated partner. Same config and seed => same behaviour."""

    recipients: int = 3000
    absent_share: float = 0.05
    seed: int = 7
    # Kept out of repr so configs can be logged without leaking the credential.
    token: str | None = field(default=None, repr=False)
    rate_per_second: float = 100.0
    burst: float = 10.0
    window: Window = "bucket"
    # Length of the trailing window of the "sliding" limiter; the others ignore it.
    window_seconds: float = 1.0
    # (limit, window seconds): fixed windows aligned to the partner's start, on top of the
    # rate limiter, like the hourly and daily quotas of real APIs.
    quotas: tuple[tuple[int, float], ...] = ()
    retry_after_format: RetryAfterFormat = "seconds"
    # A bool is still accepted (True was the only style before there were several).
    ratelimit_headers: RateLimitHeaders = "none"
    honour_idempotency_keys: bool = True
    fault_5xx: float = 0.0
    fault_timeout_after_act: float = 0.0
    fault_reset_after_act: float = 0.0
    hang_seconds: float = 30.0
    latency_ms: float = 0.0
    # A partner that queues under load: each DELETE takes this much longer per other
    # DELETE it is already handling (20 ms alone, 2 s with 33 in hand at 60 ms each).
    latency_per_inflight_ms: float = 0.0
    page_delay_ms: float = 0.0
    garbage_share: float = 0.0
    # Batch endpoints (docs/batch.md; cleanup_sandbox.batch): "" answers them 404.
    batch_shape: BatchShape = ""
    # More ids than this in one batch: 413, nothing done.
    batch_max_items: int = 100
    # per_item: that share of items answers 429 (not deleted, fine to send again), drawn
    # per occurrence; that share of ids fails 422 for good (decided per id, so a resend
    # fails again). job: the same per-id failures make a job partial_success or failed.
    batch_item_throttle_share: float = 0.0
    batch_item_error_share: float = 0.0
    # accepted: that share of present ids is answered 204 but silently left in place.
    batch_silent_miss_share: float = 0.0
    # job: submissions beyond this many unfinished jobs answer 429; a job runs this long
    # on the state's clock, then its results are kept this long.
    batch_max_jobs: int = 4
    batch_job_seconds: float = 2.0
    batch_job_result_ttl_seconds: float = 3600.0
    # A batch holding an id that matches this regular expression is refused whole (400,
    # as HubSpot's legacy batch does); "" accepts every id.
    batch_bad_id_pattern: str = ""
    # An id twice in one batch: acted on once ("once") or the batch refused ("error").
    batch_duplicates: BatchDuplicates = "once"
    # What the limiter charges a batch: one token, or one per id.
    batch_cost: BatchCost = "request"
    # A second limit, on ids, on top of the one batch_cost sets: a token bucket refilling
    # this many ids a second (0: none), as partners charging both per request and per item
    # do (Klaviyo's bulk jobs, Google's batch where every inner call counts). Its capacity
    # is batch_items_burst ids, 0 meaning batch_max_items, so one full batch always fits.
    batch_items_per_second: float = 0.0
    batch_items_burst: float = 0.0
    # Each per-item result's verdict (per_item answers and a finished job's results): an
    # HTTP status ("status"), or Salesforce's DeleteResult ("success": success true, or
    # false with errors [{"statusCode"}]: ENTITY_IS_DELETED for an absent id,
    # REQUEST_LIMIT_EXCEEDED for a throttled one, INVALID_ID_FIELD for a failing one).
    batch_verdict: BatchVerdict = "status"
    # "omit-on-error": a result for an id not deleted carries "id": null, as Salesforce
    # leaves the id out of some failures; only matching results by position reads them.
    batch_result_ids: BatchResultIds = "always"

    @property
    def batch_items_capacity(self) -> float:
        """The ids the item limit holds at once."""
        return self.batch_items_burst or float(self.batch_max_items)

    def __post_init__(self) -> None:
        if isinstance(self.recipients, bool) or self.recipients < 0:
            raise ValueError(f"recipients must be an int >= 0, got {self.recipients!r}")
        check_probability("absent_share", self.absent_share)
        check_probability("fault_5xx", self.fault_5xx)
        check_probability("fault_timeout_after_act", self.fault_timeout_after_act)
        check_probability("fault_reset_after_act", self.fault_reset_after_act)
        check_non_negative("hang_seconds", self.hang_seconds)
        check_non_negative("latency_ms", self.latency_ms)
        check_non_negative("latency_per_inflight_ms", self.latency_per_inflight_ms)
        check_non_negative("page_delay_ms", self.page_delay_ms)
        check_non_negative("garbage_share", self.garbage_share)
        check_rate(self.rate_per_second, self.burst)
        if self.window not in WINDOWS:
            raise ValueError(f"window must be one of {WINDOWS}, got {self.window!r}")
        check_positive("window_seconds", self.window_seconds)
        object.__setattr__(self, "window_seconds", float(self.window_seconds))
        object.__setattr__(self, "quotas", check_quotas(self.quotas))
        headers: object = self.ratelimit_headers
        if isinstance(headers, bool):
            object.__setattr__(self, "ratelimit_headers", "ietf" if headers else "none")
        elif headers not in RATELIMIT_HEADER_STYLES:
            raise ValueError(
                f"ratelimit_headers must be one of {RATELIMIT_HEADER_STYLES}, got {headers!r}"
            )
        if self.retry_after_format not in RETRY_AFTER_FORMATS:
            raise ValueError(
                f"retry_after_format must be one of {RETRY_AFTER_FORMATS}, "
                f"got {self.retry_after_format!r}"
            )
        self._check_batch()
        if self.token is not None and not self.token:
            # An empty token would make "Authorization: Bearer " a valid credential.
            raise ValueError("token must be non-empty when set")

    def _check_batch(self) -> None:
        if self.batch_shape not in BATCH_SHAPES:
            raise ValueError(f"batch_shape must be one of {BATCH_SHAPES}, got {self.batch_shape!r}")
        for name in ("batch_max_items", "batch_max_jobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        check_probability("batch_item_throttle_share", self.batch_item_throttle_share)
        check_probability("batch_item_error_share", self.batch_item_error_share)
        check_probability("batch_silent_miss_share", self.batch_silent_miss_share)
        check_non_negative("batch_job_seconds", self.batch_job_seconds)
        check_non_negative("batch_job_result_ttl_seconds", self.batch_job_result_ttl_seconds)
        try:
            re.compile(self.batch_bad_id_pattern)
        except (re.error, TypeError) as exc:
            raise ValueError(f"batch_bad_id_pattern is not a regular expression: {exc}") from None
        if self.batch_duplicates not in BATCH_DUPLICATES:
            raise ValueError(
                f"batch_duplicates must be one of {BATCH_DUPLICATES}, got {self.batch_duplicates!r}"
            )
        cost: str = self.batch_cost
        # The service's [batch].cost spells them "requests" and "items"; both read alike.
        if cost in ("requests", "items"):
            object.__setattr__(self, "batch_cost", cost[:-1])
        elif cost not in BATCH_COSTS:
            raise ValueError(f"batch_cost must be one of {BATCH_COSTS}, got {cost!r}")
        if self.batch_verdict not in BATCH_VERDICTS:
            raise ValueError(
                f"batch_verdict must be one of {BATCH_VERDICTS}, got {self.batch_verdict!r}")
        if self.batch_result_ids not in BATCH_RESULT_IDS:
            raise ValueError(f"batch_result_ids must be one of {BATCH_RESULT_IDS}, "
                             f"got {self.batch_result_ids!r}")
        check_non_negative("batch_items_per_second", self.batch_items_per_second)
        check_non_negative("batch_items_burst", self.batch_items_burst)
        if 0.0 < self.batch_items_burst < 1.0:
            # A bucket that can never hold a whole id would refuse every batch forever.
            raise ValueError(
                f"batch_items_burst must be 0 (batch_max_items) or >= 1, "
                f"got {self.batch_items_burst!r}"
            )


@dataclass(slots=True)
class Tunables:
    """The subset of the config that POST /_sandbox/control may change while serving."""

    rate_per_second: float
    burst: float
    fault_5xx: float
    fault_timeout_after_act: float
    fault_reset_after_act: float
    latency_ms: float
    hang_seconds: float
    page_delay_ms: float

    @classmethod
    def from_config(cls, config: SandboxConfig) -> Tunables:
        return cls(
            rate_per_second=config.rate_per_second,
            burst=config.burst,
            fault_5xx=config.fault_5xx,
            fault_timeout_after_act=config.fault_timeout_after_act,
            fault_reset_after_act=config.fault_reset_after_act,
            latency_ms=config.latency_ms,
            hang_seconds=config.hang_seconds,
            page_delay_ms=config.page_delay_ms,
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "rate_per_second": self.rate_per_second,
            "burst": self.burst,
            "fault_5xx": self.fault_5xx,
            "fault_timeout_after_act": self.fault_timeout_after_act,
            "fault_reset_after_act": self.fault_reset_after_act,
            "latency_ms": self.latency_ms,
            "hang_seconds": self.hang_seconds,
            "page_delay_ms": self.page_delay_ms,
        }
