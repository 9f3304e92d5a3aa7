"""Every Prometheus metric, defined once. Names are an interface: dashboards depend on them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

QUEUE_OLDEST_AGE = Gauge(
    "cleanup_queue_oldest_message_age_seconds",
    "Age of the oldest claimable message (not counting delayed retries): the paging signal.")
QUEUE_DEPTH = Gauge("cleanup_queue_depth", "Messages claimable now.")
QUEUE_PARKED = Gauge("cleanup_queue_parked_messages", "Messages waiting for a delayed retry.")
QUEUE_LEASED = Gauge("cleanup_queue_leased_messages", "Messages held by a consumer.")

QUEUE_REPOSTS = Counter(
    "cleanup_queue_reposts",
    "Messages published again with a delay because the transport has no nack or extend.")
QUEUE_DROPPED = Counter(
    "cleanup_queue_dropped_deliveries",
    "Deliveries acked without work: settled or unknown operations, malformed bodies.", ["reason"])
QUEUE_DUPLICATES = Counter(
    "cleanup_queue_duplicate_deliveries",
    "Deliveries of a message this process already holds (left to their lease).")
ATTEMPTS_NOT_SENT = Counter(
    "cleanup_attempts_not_sent",
    "Attempts written but not sent because they were no longer this worker's when their "
    "token came (hold lost, superseded, replica fenced).")
TRANSPORT_CALLS = Counter(
    "cleanup_transport_requests", "Calls to a managed queue's API, by call and result.",
    ["call", "result"])
TRANSPORT_BLOCKED = Gauge(
    "cleanup_transport_blocked",
    "1 while the queue transport refuses us (bad key, no credit): consumption stopped.",
    ["reason"])

LIMITER_PAUSED_UNTIL = Gauge(
    "cleanup_limiter_paused_until_timestamp_seconds",
    "Unix time until which a Retry-After (or the limiter's own backoff after a 429) holds "
    "every worker: the last pause's end, in the past once it is over; 0 if none since start.")
LIMITER_PAUSED_SECONDS = Counter(
    "cleanup_limiter_paused_seconds",
    "Seconds a pause (a Retry-After, a spent announced quota) held every worker, added up "
    "each second by the monitor: increase() over a window is how much of it was paused.")
LIMITER_RATE = Gauge("cleanup_limiter_rate_per_second", "The current adaptive rate.")
LIMITER_CEILING = Gauge("cleanup_limiter_ceiling_per_second", "The configured ceiling.")
LIMITER_LEARNT = Gauge(
    "cleanup_limiter_learnt_rate_per_second",
    "The partner's limit the limiter learnt from 429s (its plateau); 0 when none.")
LIMITER_ITEMS_RATE = Gauge(
    "cleanup_limiter_items_rate_per_second",
    "Under batch.cost = \"both\": the ids' adaptive rate (0 without a limit on ids).")
LIMITER_ITEMS_LEARNT = Gauge(
    "cleanup_limiter_items_learnt_rate_per_second",
    "Under batch.cost = \"both\": the partner's limit on ids learnt from 429s; 0 when none.")
LIMITER_ANNOUNCED = Gauge(
    "cleanup_limiter_announced_rate_per_second",
    "The per-second limit the partner announces in its rate-limit headers; 0 when none.")
LIMITER_QUOTA_REMAINING = Gauge(
    "cleanup_limiter_quota_remaining",
    "Requests left in a quota longer than a second (configured or announced).", ["policy"])
LIMITER_QUOTA_RESET = Gauge(
    "cleanup_limiter_quota_reset_timestamp_seconds",
    "Unix time when a quota's oldest use leaves its window.", ["policy"])
LIMITER_CONCURRENCY = Gauge(
    "cleanup_limiter_concurrency_limit", "Requests allowed in flight now (follows latency).")
LIMITER_CONCURRENCY_BOUND = Gauge(
    "cleanup_limiter_concurrency_bound",
    "1 when limits.concurrency, not the rate, bounds the pace (rate x latency > it).")

OPERATIONS = Counter(
    "cleanup_operations",
    "Operations that reached a terminal outcome (deleted, already_absent, failed), each once.",
    ["outcome"])
AMBIGUOUS_ENTERED = Counter(
    "cleanup_operations_ambiguous",
    "Operations that became ambiguous (their later resolution counts in cleanup_operations).")
PARTNER_RESPONSES = Counter(
    "cleanup_partner_responses", "Partner answers by HTTP status (or 'error').", ["status"])
# Exported at 0 from the start: a labelled series is born with its first increment, and
# increase()/rate() see no rise in a series whose first sample already counts it (the first
# failure, the first 429 would be missed by the alerts and read low on the dashboard).
for _outcome in ("deleted", "already_absent", "failed"):
    OPERATIONS.labels(_outcome)
PARTNER_RESPONSES.labels("429")
PARTNER_HEADER_IGNORED = Counter(
    "cleanup_partner_header_ignored",
    "Rate-limit header values the partner sent that were ignored (unparseable, negative or "
    "not finite), by header: pacing by them falls back to 429s.", ["header"])
PARTNER_DURATION = Histogram(
    "cleanup_partner_request_duration_seconds", "Partner DELETE latency.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

WORKERS_BUSY = Gauge("cleanup_workers_busy", "Workers holding a message.")
WORKERS = Gauge("cleanup_workers", "Workers in the pool.")

RUN_DISCOVERED = Gauge("cleanup_run_discovered_operations", "Operations the current run found.")
RUN_UNFINISHED = Gauge(
    "cleanup_run_unfinished_operations",
    "Operations of the current run not yet deleted, already_absent or failed.")
RUN_PROJECTED_FINISH = Gauge(
    "cleanup_run_projected_finish_timestamp_seconds",
    "When the current run's drain will end at the current rate; 0 when done.")
DIGEST_CUTOFF = Gauge(
    "cleanup_digest_cutoff_timestamp_seconds",
    "When the current run must be drained by (schedule.digest_cutoff_seconds); 0 when unset.")
AMBIGUOUS = Gauge("cleanup_ambiguous_operations", "Operations waiting for reconciliation.")
INCONCLUSIVE = Gauge(
    "cleanup_reconcile_inconclusive_operations",
    "Ambiguous operations whose last probe was inconclusive: each is probed again later and "
    "later (capped), and may need an operator's decision.")
REDRIVEN = Counter(
    "cleanup_redriven_operations", "Unfinished operations found without a message and published again.")
PROBES = Counter("cleanup_probes", "Reconciliation probes, by finding.", ["finding"])
SCAN_FAILURES = Counter("cleanup_scan_failures", "Candidate pages that could not be read.")
SCAN_SKIPPED = Counter(
    "cleanup_scan_skipped_candidates", "Candidates rejected as malformed.", ["reason"])
LAST_TICK = Gauge("cleanup_last_tick_timestamp_seconds", "Unix time of the last run opened.")
TICKS = Counter("cleanup_ticks", "Ticks received, by result.", ["result"])

READS_HELD = Gauge(
    "cleanup_api_held_reads",
    "Reads a client holds open now: long-polls (?wait=done) and exclusions reads.", ["kind"])
READS_REFUSED = Counter(
    "cleanup_api_refused_reads",
    "Long-polls and exclusions reads answered 429 at a cap (in total or per token).",
    ["kind", "cap"])

COMPONENT_RESTARTS = Counter(
    "cleanup_component_restarts", "Components restarted after a crash.", ["component"])
LEDGER_HEALTHY = Gauge("cleanup_ledger_healthy", "1 when the ledger commits, 0 on a fault.")
QUEUE_CALLS = Counter(
    "cleanup_queue_calls",
    "Round trips to the queue's broker (Redis commands, scripts and pipelines; AMQP "
    "methods), by call: what one operation costs the broker.", ["call"])
QUEUE_HEALTHY = Gauge(
    "cleanup_queue_healthy",
    "1 while the queue transport answers (a broker connected, Infrai accepting us), 0 not.")
READY = Gauge("cleanup_ready", "1 when /readyz answers 200.")
# Replicas (ledger.backend = "postgres"): one series per process, told apart by instance.
ROLE_HELD = Gauge("cleanup_role_held", "1 while this process holds a singleton role.", ["role"])
REPLICAS_REAPED = Counter(
    "cleanup_replicas_reaped", "Replicas this one found dead and released the work of.")
LIVE_REPLICAS = Gauge("cleanup_replicas_live", "Replicas heartbeating in the registry.")


BATCH_REQUESTS = Counter(
    "cleanup_batch_requests", "Batch requests sent, by shape and answer.", ["shape", "answer"])
BATCH_ITEMS = Counter(
    "cleanup_batch_items", "Items of batches settled, by their own verdict.", ["verdict"])
BATCH_JOBS_IN_FLIGHT = Gauge(
    "cleanup_batch_jobs_in_flight", "Batch jobs submitted and not finished (every replica's).")
BATCH_JOBS_OVERDUE = Gauge(
    "cleanup_batch_jobs_overdue",
    "Batch jobs unfinished longer than batch.job_deadline_seconds after submission.")
BATCH_JOB_POLLS = Counter(
    "cleanup_batch_job_polls", "Job status reads, by what they found.", ["found"])


def count_settled(target: str) -> None:
    """The one rule for the outcome counters: a terminal outcome once per operation, an
    entry into ambiguous in its own counter (never both under one name)."""
    if target == "ambiguous":
        AMBIGUOUS_ENTERED.inc()
    elif target in ("deleted", "already_absent", "failed"):
        OPERATIONS.labels(target).inc()


PUSH_DELIVERIES = Counter(
    "cleanup_push_deliveries",
    "Infrai push deliveries to /v1/push/{queue}, by answer: accepted (2xx, after the commit); "
    "retry, held, busy, unavailable (non-2xx with Retry-After: delivered again later); "
    "replayed (a copy of a delivery seen before, answered as that one was, nothing written); "
    "unsigned, bad_signature, stale, malformed, unknown_queue (refused, nothing written).",
    ["result"])
PUSH_REPLAY_EVICTIONS = Counter(
    "cleanup_push_replay_evictions",
    "Push deliveries forgotten by the replay cache before their signature expired because "
    "it was full (infrai.push_replay_cache_entries): a copy of one would be worked again.")

# Who calls (supervisor/apiauth.py): route is the route template, never the client's text.
AUTH_FAILURES = Counter(
    "cleanup_auth_failures",
    "Wrong credentials presented (a Bearer token on the API or /metrics, a token typed into "
    "the status page's login), by route template.", ["route"])
AUTH_THROTTLED = Counter(
    "cleanup_auth_throttled",
    "Requests answered 429 without looking at their credentials: their client, or every "
    "client, failed too often in the last minute.", ["route"])

# Completion events (supervisor/events/): one series per configured sink.
EVENTS_LAG = Gauge(
    "cleanup_events_sink_lag_events",
    "Events in the outbox a sink has not acknowledged yet.", ["sink"])
EVENTS_LAG_SECONDS = Gauge(
    "cleanup_events_sink_lag_seconds",
    "Age of the oldest event a sink has not acknowledged; 0 when it is caught up.", ["sink"])
EVENTS_DELIVERED = Counter(
    "cleanup_events_delivered",
    "Events a sink acknowledged (a batch sent again after a restart counts again).", ["sink"])
EVENTS_FAILURES = Counter(
    "cleanup_events_sink_failures",
    "Deliveries to a sink that failed (each try of a batch), retried with backoff.", ["sink"])
EVENTS_PRUNED = Counter(
    "cleanup_events_pruned", "Events every sink had taken, removed from the outbox.")

# The digest rule (supervisor/exclusions.py): what GET /v1/exclusions answers, counted.
DIGEST_EXCLUSIONS = Gauge(
    "cleanup_digest_exclusions",
    "Recipients of the current run the digest must exclude, by reason (deletion_pending, "
    "deletion_in_flight, deletion_unconfirmed, deleted, absent_at_partner, deletion_failed); "
    "read at cleanup_digest_cutoff_timestamp_seconds it is the count at the cutoff.",
    ["reason"])
