"""Configuration of the Infrai queue emulator.

Every point that shared/reference/infrai-api.md (section 7) leaves UNKNOWN and that changes
what a queue client sees is a field here, so a test can flip it and show the adapter copes
with either answer. Each default is the answer judged most likely or, failing evidence, the
one that is kindest to an adapter that follows only the documented contract; the reason sits
in the field's ``doc``, which the CLI also prints as ``--help``. Unknown -> fields:

1 consume shape and limits: consume_shape, message_extras, max_batch, max_visibility_timeout,
  default_visibility_timeout (long polling is not modelled: consume answers at once)
2 ack semantics: ack_unknown, ack_expired (acks are keyed by message_id; no receipts)
3 nack: nack_route; 4 extend: extend_route; 6 expiries as failures: expiry_counts_toward_max_retries
5 redrive: redrive_target, redrive_resets_count (every parked message moves; no DLQ listing)
7 queue.create defaults and re-creation: default_max_retries, default_retention_days,
  default_visibility_timeout, create_existing, timestamp_format
8 auto-creation: auto_create (list/delete/stats/purge/batch routes answer 404)
9 priority and FIFO: priority_order, fifo_dedup_key (FIFO order is per message_group_id)
10 size accounting: payload_size_accounting, max_payload_bytes
16 auth errors: auth_failure, auth_status, auth_code
17 rate limits: rate_limit_next, rate_limit_share, retry_after, retry_after_format
18 idempotency: dedup_window_seconds, key_reuse, idempotency_precedence, require_create_keys
and the reading of max_retries ("nacks a message may take before it is moved"): dlq_threshold.
Cron (unknowns 12-15) has the ``cron_*`` fields; cron.py lists what is decided without one.
Push subscriptions (unknown 11) are outside this emulator.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from cleanup_sandbox.config import RETRY_AFTER_FORMATS, RetryAfterFormat

AuthFailure = Literal["unauthorized", "forbidden"]
CreateExisting = Literal["ok", "conflict"]
ConsumeShape = Literal["messages", "bare"]
AckUnknown = Literal["ok", "not_found"]
AckExpired = Literal["accept", "reject"]
DlqThreshold = Literal["reach", "exceed"]
RedriveTarget = Literal["source", "dlq"]
IdempotencyPrecedence = Literal["body", "header"]
KeyReuse = Literal["replay", "conflict"]
SizeAccounting = Literal["payload", "request"]
FifoDedupKey = Literal["either", "deduplication_id", "idempotency_key"]
PriorityOrder = Literal["higher_first", "lower_first"]
TimestampFormat = Literal["iso", "epoch"]
CronExtendedSyntax = Literal["reject", "accept", "store"]
CronCreateExisting = Literal["new", "conflict", "existing", "replace"]

__all__ = ["FAULT_FIELDS", "RETRY_AFTER_FORMATS", "EmulatorConfig", "FieldSpec", "field_specs"]

# Routes the emulator always serves; a configured nack/extend route may not shadow them.
BUILTIN_PATHS = frozenset(
    {
        "/v1/queue/create",
        "/v1/queue/publish",
        "/v1/queue/consume",
        "/v1/queue/ack",
        "/v1/discovery",
    }
)
# The cron routes the emulator always serves (cron_routes.py): literal paths, and prefixes
# followed by a job id. Configurable routes may shadow none of them.
CRON_PATHS = frozenset(
    {
        "/v1/cron/create",
        "/v1/cron/list",
        "/v1/scheduling/cron",
        "/v1/scheduling/cron/create",
        "/v1/scheduling/cron/list",
    }
)
CRON_ID_PREFIXES = ("/v1/cron/pause/", "/v1/cron/trigger/", "/v1/cron/delete/", "/v1/cron/runs/list/")
# Infrai's documented ceiling of one run (section 4.4, three 3P articles).
CRON_RUN_CEILING = 900.0


def _doc(doc: str, *, lo: float | None = None, hi: float | None = None) -> dict[str, Any]:
    return {"doc": doc, "lo": lo, "hi": hi}


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """Everything that shapes one emulated Infrai account. Same config and seed, same answers.

    Frozen so a running emulator is reconfigured by swapping the whole object
    (``dataclasses.replace``), which re-runs the validation below.
    """

    # -- auth --------------------------------------------------------------------------
    api_key: str = field(repr=False, metadata={"doc": "the project key clients must send as a Bearer token"})
    control_key: str | None = field(
        default=None,
        repr=False,
        metadata={"doc": "X-Emulator-Control key for /_emulator/*; None disables that surface"},
    )
    auth_failure: AuthFailure = field(
        default="unauthorized",
        metadata=_doc(
            "status of a bad or missing key (unknown 16): 'unauthorized' = 401 UNAUTHORIZED, the "
            "usual meaning of a bad bearer token; 'forbidden' = 403 FORBIDDEN"
        ),
    )
    auth_status: int | None = field(
        default=None, metadata=_doc("overrides the HTTP status auth_failure picks", lo=400, hi=499)
    )
    auth_code: str | None = field(default=None, metadata=_doc("overrides the error code auth_failure picks"))

    # -- envelope ------------------------------------------------------------------------
    cost_usd: float = field(
        default=0.0001, metadata=_doc("metadata.cost_usd of every answer (a fixed test value)", lo=0)
    )
    vendor: str = field(default="emulator", metadata=_doc("metadata.vendor of every answer"))
    strict_canonical: bool = field(
        default=False,
        metadata=_doc(
            "log whether each body was canonical JSON (sorted keys, compact, newline); bodies are "
            "accepted either way, as the conventions page only asks for canonical form"
        ),
    )

    # -- limits --------------------------------------------------------------------------
    max_payload_bytes: int = field(
        default=262144,
        metadata=_doc("largest accepted message: 256 KB, the third-party figure (section 5)", lo=1),
    )
    payload_size_accounting: SizeAccounting = field(
        default="payload",
        metadata=_doc(
            "what max_payload_bytes measures (unknown 10): 'payload' = the payload's compact UTF-8 "
            "JSON, as SQS counts the body only; 'request' = the whole raw request body"
        ),
    )
    max_delay_seconds: float = field(
        default=604800.0, metadata=_doc("largest delay_seconds: 7 days (section 5)", lo=0)
    )
    max_batch: int = field(
        default=10,
        metadata=_doc("consume max_messages is clamped to this (unknown 1): clients use 1-10", lo=1),
    )
    max_visibility_timeout: float = field(
        default=43200.0,
        metadata=_doc("visibility timeouts are clamped to this (unknown 1): 12 h, as SQS", lo=0),
    )
    default_visibility_timeout: float = field(
        default=30.0,
        metadata=_doc("lease of a queue created without visibility_timeout_default (unknown 1)", lo=0),
    )
    default_max_retries: int = field(
        default=3,
        metadata=_doc(
            "max_retries of a queue created without one (unknown 7): the SDK's retry default", lo=0
        ),
    )
    default_retention_days: float = field(
        default=4.0,
        metadata=_doc("message_retention_days of a queue created without one (unknown 7): SQS's 4", lo=0),
    )
    max_retention_days: float = field(
        default=30.0, metadata=_doc("largest message_retention_days (section 5)", lo=0)
    )
    fifo_dedup_window_seconds: float = field(
        default=300.0, metadata=_doc("FIFO deduplication window: 5 min", lo=0)
    )
    fifo_dedup_key: FifoDedupKey = field(
        default="either",
        metadata=_doc(
            "which publish field drives FIFO dedup (unknown 9): 'either' = deduplication_id, else "
            "idempotency_key, as the reference's 8.3 says"
        ),
    )
    priority_order: PriorityOrder = field(
        default="higher_first",
        metadata=_doc(
            "delivery order on enable_priority queues (unknown 9); the reference assumes higher "
            "first. FIFO queues ignore priority: their order is arrival per message group"
        ),
    )
    timestamp_format: TimestampFormat = field(
        default="iso",
        metadata=_doc(
            "created_at / visible_at / enqueued_at as ISO-8601 UTC (like cron's run_at) or epoch "
            "seconds (unknown 1 and 7)"
        ),
    )

    # -- queue semantics (unknowns 1-8) ----------------------------------------------------
    auto_create: bool = field(
        default=False,
        metadata=_doc(
            "publish/consume on an unknown queue creates it instead of answering 404 (unknown 8); "
            "off so an adapter that forgets queue.create is caught"
        ),
    )
    create_existing: CreateExisting = field(
        default="ok",
        metadata=_doc("queue.create on an existing name: 'ok' returns it (idempotent), 'conflict' = 409"),
    )
    consume_shape: ConsumeShape = field(
        default="messages",
        metadata=_doc("consume data as {messages: [...]} (3P majority) or a bare list (one client)"),
    )
    message_extras: bool = field(
        default=False,
        metadata=_doc(
            "add receive_count, enqueued_at, headers, message_group_id to consumed messages; off "
            "because the reference documents only message_id and payload"
        ),
    )
    ack_unknown: AckUnknown = field(
        default="ok",
        metadata=_doc(
            "ack/nack of an unknown or already-acked id (unknown 2): 'ok' answers acked:false, as "
            "clients ignore ack results; 'not_found' = 404 MESSAGE_NOT_FOUND"
        ),
    )
    ack_expired: AckExpired = field(
        default="accept",
        metadata=_doc(
            "ack/nack of a message whose lease ran out (unknown 2): 'accept' deletes it anyway, "
            "as a message_id-keyed ack cannot tell consumers apart; 'reject' = 409 LEASE_EXPIRED"
        ),
    )
    nack_route: str | None = field(
        default=None,
        metadata=_doc("path of the nack call (unknown 3), e.g. /v1/queue/nack; None = no nack (404)"),
    )
    extend_route: str | None = field(
        default=None,
        metadata=_doc("path of a lease extension (unknown 4), e.g. /v1/queue/extend; None = none (404)"),
    )
    dlq_threshold: DlqThreshold = field(
        default="reach",
        metadata=_doc(
            "when failures dead-letter a message: 'reach' = at max_retries failures (queue.create's "
            "'nacks a message may take before it is moved', the reference's 8.6), 'exceed' = one more"
        ),
    )
    expiry_counts_toward_max_retries: bool = field(
        default=False,
        metadata=_doc("lease expiries count as failures too (unknown 6); off because the docs count nacks"),
    )
    redrive_target: RedriveTarget = field(
        default="source",
        metadata=_doc(
            "which queue the redrive path names (unknown 5): 'source' (the queue whose DLQ is "
            "drained, as the samples pass their work queue) or 'dlq'"
        ),
    )
    redrive_resets_count: bool = field(
        default=True,
        metadata=_doc(
            "redrive resets receive and failure counts (unknown 5), so a redriven message gets a "
            "fresh max_retries budget; off = its next failure dead-letters it again"
        ),
    )
    duplicate_recent_ack_seconds: float = field(
        default=60.0, metadata=_doc("how long an acked message stays a candidate for duplicate_share", lo=0)
    )

    # -- idempotency (unknowns 18, section 1.3) -------------------------------------------
    dedup_window_seconds: float = field(
        default=86400.0,
        metadata=_doc("how long an idempotency key replays (unknown 18): 24 h, the common figure", lo=0),
    )
    idempotency_precedence: IdempotencyPrecedence = field(
        default="body", metadata=_doc("which key counts when body idempotency_key and Idempotency-Key differ")
    )
    key_reuse: KeyReuse = field(
        default="replay",
        metadata=_doc(
            "same key, different body (unknown 18): 'replay' the first answer (the docs' wording), "
            "or 'conflict' = 409 IDEMPOTENCY_CONFLICT"
        ),
    )
    require_create_keys: bool = field(
        default=False,
        metadata=_doc(
            "queue.create without an idempotency key = 400 (conventions page) instead of accepted "
            "(the parameter table lists the key as optional)"
        ),
    )

    # -- faults (mutable at runtime; see FAULT_FIELDS) --------------------------------------
    seed: int = field(default=7, metadata=_doc("seeds every random fault draw and the generated ids"))
    credit_exhausted: bool = field(
        default=False, metadata=_doc("every billable call answers 402 INSUFFICIENT_CREDIT")
    )
    unauthorized: bool = field(
        default=False, metadata=_doc("every call fails auth as if the key were revoked")
    )
    rate_limit_next: int = field(default=0, metadata=_doc("the next N calls answer 429 RATE_LIMITED", lo=0))
    rate_limit_share: float = field(default=0.0, metadata=_doc("fraction of calls answering 429", lo=0, hi=1))
    retry_after: float = field(default=1.0, metadata=_doc("seconds announced by a 429's Retry-After", lo=0))
    retry_after_format: RetryAfterFormat = field(
        default="seconds",
        metadata=_doc(
            "Retry-After as whole seconds (what every client assumes), fractional "
            "seconds, an HTTP-date, or absent (unknown 17)"
        ),
    )
    error_next: int = field(
        default=0, metadata=_doc("the next N calls answer error_status with a valid envelope", lo=0)
    )
    error_share: float = field(
        default=0.0, metadata=_doc("fraction of calls answering error_status", lo=0, hi=1)
    )
    error_status: int = field(default=503, metadata=_doc("status of injected errors", lo=500, hi=599))
    error_ok_false_200_share: float = field(
        default=0.0, metadata=_doc("fraction of calls answering HTTP 200 with ok:false INTERNAL", lo=0, hi=1)
    )
    garbage_share: float = field(
        default=0.0,
        metadata=_doc("fraction of calls answering 200 with a non-JSON or non-envelope body", lo=0, hi=1),
    )
    reset_share: float = field(
        default=0.0,
        metadata=_doc("fraction of calls whose connection is reset before anything happens", lo=0, hi=1),
    )
    reset_after_share: float = field(
        default=0.0,
        metadata=_doc("fraction of calls that take effect, then reset the connection unanswered", lo=0, hi=1),
    )
    latency_ms: float = field(default=0.0, metadata=_doc("added to every /v1 call", lo=0))
    duplicate_share: float = field(
        default=0.0,
        metadata=_doc(
            "fraction of consumes that also hand out a message leased elsewhere or just acked "
            "(at-least-once delivery made observable)",
            lo=0,
            hi=1,
        ),
    )

    # -- cron / scheduling (section 4, unknowns 12-15) ---------------------------------------
    cron_allow_private_targets: bool = field(default=False, metadata=_doc(
        "accept http:// and private, loopback or single-label hosts as cron targets; off because "
        "Infrai only calls public https URLs (3P), which catches an adapter aiming a job at "
        "localhost. Tests and the demo turn it on for http://127.0.0.1"))
    cron_poll_seconds: float = field(default=0.05, metadata=_doc(
        "real seconds between scheduler steps; moving the clock (Emulator.advance, POST "
        "/_emulator/clock) and POST /_emulator/cron/tick step at once too. 0 = only those", lo=0))
    cron_timeout_seconds: float = field(default=CRON_RUN_CEILING, metadata=_doc(
        "ceiling of one attempt in real seconds (the network is not on the emulator clock): 900, "
        "Infrai's run ceiling (3P); smaller in tests. A job's timeout_seconds is clamped to it "
        "(and refused above 900)", lo=0.001, hi=CRON_RUN_CEILING))
    cron_default_timeout_seconds: float = field(default=300.0, metadata=_doc(
        "timeout_seconds of a job created without one: the older SDK's 300", lo=0.001, hi=CRON_RUN_CEILING))
    cron_default_retries: int = field(default=3, metadata=_doc(
        "retries of a job created without retries/retry: the SDK's 3", lo=0))
    cron_max_retries: int = field(default=10, metadata=_doc(
        "largest retries a job may ask for (the real limit is UNKNOWN)", lo=0))
    cron_retry_backoff_seconds: float = field(default=0.0, metadata=_doc(
        "emulator-clock seconds from a failed attempt to its retry (unknown 12); 0 = at once", lo=0))
    cron_jitter_seconds: float = field(default=0.0, metadata=_doc(
        "slots fire up to this many emulator seconds late (seeded; Infrai jitters by seconds, 3P); "
        "0 for deterministic tests. scheduled_for is the slot either way", lo=0))
    cron_extended_syntax: CronExtendedSyntax = field(default="reject", metadata=_doc(
        "schedules beyond 5 plain fields: L, W, #, ?, a seconds or year field, @macros (unknown "
        "14). 'reject' = 400 VALIDATION_ERROR, as the docs show only 5 fields and an article warns "
        "against L (fail at create, not by never firing); 'accept' = evaluated by croniter (6/7 "
        "fields seconds first, as Quartz); 'store' = kept, never fires"))
    cron_resume_route: str | None = field(default="/v1/cron/resume/{id}", metadata=_doc(
        "POST route of cron.resume (unknown 13); '{id}' = the job id, else read from the body's "
        "cron_id/id/job_id. The default mirrors /v1/cron/pause/{id}; None = no resume (404)"))
    cron_update_route: str | None = field(default=None, metadata=_doc(
        "POST route of an ASSUMED cron.update (unknown 13), e.g. /v1/cron/update/{id}: the create "
        "fields sent replace the job's, next_run_at from now; None = none (404)"))
    cron_get_route: str | None = field(default=None, metadata=_doc(
        "GET route of an ASSUMED cron.get (unknown 13), e.g. /v1/cron/get/{id}; None = none (404)"))
    cron_create_existing_name: CronCreateExisting = field(default="new", metadata=_doc(
        "cron.create with an existing job's name (UNKNOWN): 'new' = another job, as the id is the "
        "identity and dedup is by idempotency_key (an apply that re-creates blindly shows up as "
        "duplicates); 'conflict' = 409 CRON_EXISTS; 'existing' = the old job as is; 'replace' = "
        "the old job, id kept, given the new fields"))
    cron_output_limit_bytes: int = field(default=4096, metadata=_doc(
        "bytes of a target's answer kept as a run's output: Infrai's 4 KB (3P)", lo=0))
    cron_runs_kept: int = field(default=1000, metadata=_doc(
        "run records kept per job, oldest dropped first (run retention is unknown 13)", lo=1))
    cron_signature_header: str | None = field(default=None, metadata=_doc(
        "header with hex HMAC-SHA256(job secret, raw body) on the POSTs of jobs created with a "
        "secret (unknown 12), e.g. X-Infrai-Signature; None = unsigned, as no source signs them"))
    cron_signature_prefix: str = field(default="", metadata=_doc(
        "prefix of the signature value: '' or 'sha256=' (inconsistency #16)"))

    # -- observability -------------------------------------------------------------------
    log_limit: int = field(default=100_000, metadata=_doc("most recent /v1 calls kept by the call log", lo=1))

    def __post_init__(self) -> None:
        for spec in field_specs().values():
            value = spec.check(getattr(self, spec.name))
            object.__setattr__(self, spec.name, value)
        if not self.api_key:
            # An empty key would make "Authorization: Bearer " a valid credential.
            raise ValueError("api_key must be non-empty")
        if self.control_key is not None and not self.control_key:
            raise ValueError("control_key must be non-empty when set")
        if self.max_retention_days > 30:
            raise ValueError("max_retention_days cannot exceed Infrai's 30")
        if not 0 < self.default_retention_days <= self.max_retention_days:
            raise ValueError("default_retention_days must be within (0, max_retention_days]")
        if self.default_visibility_timeout > self.max_visibility_timeout:
            raise ValueError("default_visibility_timeout exceeds max_visibility_timeout")
        routes = [r for r in (self.nack_route, self.extend_route) if r is not None]
        for route in routes:
            if not route.startswith("/v1/") or route in BUILTIN_PATHS or "{" in route:
                raise ValueError(f"route {route!r} must be a fresh literal path under /v1/")
            if route.startswith(("/v1/queue/dlq/redrive/", "/v1/discovery/")):
                raise ValueError(f"route {route!r} shadows a built-in route")
        if len(routes) == 2 and routes[0] == routes[1]:
            raise ValueError("nack_route and extend_route must differ")
        for route in routes:
            if route in CRON_PATHS or route.startswith(CRON_ID_PREFIXES):
                raise ValueError(f"route {route!r} shadows a cron route")
        self._check_cron()

    def _check_cron(self) -> None:
        if self.cron_default_retries > self.cron_max_retries:
            raise ValueError("cron_default_retries exceeds cron_max_retries")
        if self.cron_signature_header is not None and not self.cron_signature_header.strip():
            raise ValueError("cron_signature_header must be a header name when set")
        queue_routes = {self.nack_route, self.extend_route}
        cron_routes = [r for r in (self.cron_resume_route, self.cron_update_route, self.cron_get_route)
                       if r is not None]
        for route in cron_routes:
            head, _, tail = route.partition("{id}")
            if (
                not route.startswith("/v1/")
                or route.count("{id}") > 1
                or ("{id}" in route and not head.endswith("/"))
                or (tail and not tail.startswith("/"))
                or "{" in head + tail
                or "}" in head + tail
            ):
                raise ValueError(f"cron route {route!r} must be a path under /v1/ with at most one "
                                 "'{id}' segment")
            shadowed = (*CRON_ID_PREFIXES, "/v1/queue/dlq/redrive/", "/v1/discovery")
            if route in BUILTIN_PATHS | CRON_PATHS | queue_routes or head.startswith(shadowed):
                raise ValueError(f"cron route {route!r} shadows a built-in route")
        if len(set(cron_routes)) != len(cron_routes):
            raise ValueError("cron_resume_route, cron_update_route and cron_get_route must differ")

    @property
    def auth_failure_status(self) -> int:
        default = 403 if self.auth_failure == "forbidden" else 401
        return self.auth_status if self.auth_status is not None else default

    @property
    def auth_failure_code(self) -> str:
        default = "FORBIDDEN" if self.auth_failure == "forbidden" else "UNAUTHORIZED"
        return self.auth_code if self.auth_code is not None else default

    def faults(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in FAULT_FIELDS}


# What POST /_emulator/faults and Emulator.set_faults may change; the rest is set at start
# (or by swapping the whole config in-process).
FAULT_FIELDS: tuple[str, ...] = (
    "credit_exhausted",
    "unauthorized",
    "rate_limit_next",
    "rate_limit_share",
    "retry_after",
    "retry_after_format",
    "error_next",
    "error_share",
    "error_status",
    "error_ok_false_200_share",
    "garbage_share",
    "reset_share",
    "reset_after_share",
    "latency_ms",
    "duplicate_share",
)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One config field as the validator and the CLI see it."""

    name: str
    kind: Literal["bool", "int", "float", "str", "choice"]
    optional: bool
    choices: tuple[str, ...]
    default: object
    doc: str
    lo: float | None
    hi: float | None

    def check(self, value: object) -> object:
        """The value normalised (ints become floats for float fields), or ValueError."""
        if value is None and self.optional:
            return None
        checked: object
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"{self.name} must be a boolean, got {value!r}")
            return value
        if self.kind == "str" or self.kind == "choice":
            if not isinstance(value, str):
                raise ValueError(f"{self.name} must be a string, got {value!r}")
            if self.kind == "choice" and value not in self.choices:
                raise ValueError(f"{self.name} must be one of {self.choices}, got {value!r}")
            return value
        # bool is an int subclass, and {"error_next": true} is a typo rather than 1.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{self.name} must be a number, got {value!r}")
        if self.kind == "int":
            if not isinstance(value, int):
                raise ValueError(f"{self.name} must be an integer, got {value!r}")
            checked = value
        else:
            if not math.isfinite(value):
                raise ValueError(f"{self.name} must be finite, got {value!r}")
            checked = float(value)
        if self.lo is not None and value < self.lo:
            raise ValueError(f"{self.name} must be >= {self.lo:g}, got {value!r}")
        if self.hi is not None and value > self.hi:
            raise ValueError(f"{self.name} must be <= {self.hi:g}, got {value!r}")
        return checked


def _spec(name: str, hint: Any, default: object, metadata: typing.Mapping[str, Any]) -> FieldSpec:
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    kinds: dict[object, Literal["bool", "int", "float", "str"]] = {
        bool: "bool",
        int: "int",
        float: "float",
        str: "str",
    }
    if typing.get_origin(hint) is Literal:
        kind: Literal["bool", "int", "float", "str", "choice"] = "choice"
        choices = tuple(str(c) for c in typing.get_args(hint))
    else:
        kind, choices = kinds[hint], ()
    return FieldSpec(
        name=name,
        kind=kind,
        optional=optional,
        choices=choices,
        default=default,
        doc=str(metadata.get("doc", "")),
        lo=metadata.get("lo"),
        hi=metadata.get("hi"),
    )


@functools.cache
def field_specs() -> dict[str, FieldSpec]:
    """Field name -> spec, read once from the annotations (they are strings under PEP 563)."""
    hints = typing.get_type_hints(EmulatorConfig)
    return {f.name: _spec(f.name, hints[f.name], f.default, f.metadata) for f in fields(EmulatorConfig)}
