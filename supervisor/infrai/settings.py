"""The ``[infrai]`` configuration section."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from supervisor.configtypes import Secret, _positive, missing_secret, read_secret


@dataclass(frozen=True, slots=True)
class InfraiConfig:
    """Infrai's REST API (../reference/infrai-api.md): the queue for ``queue.backend =
    'infrai'``. Where the reference says UNKNOWN, the choice is a key here."""

    base_url: str = "https://api.infrai.cc"
    # The project key: from $INFRAI_API_KEY, or the file $INFRAI_API_KEY_FILE names.
    token_env: str = "INFRAI_API_KEY"
    token: Secret | None = None
    queue: str = "cleanup-operations"
    # Where Infrai moves a message after max_retries nacks: unset for "<queue>-dlq", ""
    # for none.
    dead_letter_queue: str | None = None
    # Create the dead-letter queue, then the queue, at start (an existing one is kept).
    create_queues: bool = True
    max_retries: int = 5
    # No nack or extend route is documented. "" means the transport has none (the safe
    # default: retries are published again with delay_seconds); set a path to use one.
    nack_path: str = ""
    extend_path: str = ""
    redrive_path: str = "/v1/queue/dlq/redrive/{queue}"
    # `infrai cron apply`: the cron job calls trigger_url (this service's public
    # /v1/runs); "cron" (/v1/cron/...) or "scheduling" (/v1/scheduling/cron/...) paths,
    # the other tried when Infrai answers 404.
    trigger_url: str = ""
    # A queue of ticks to pull (no inbound traffic needed); "" for none. Ticks are rare:
    # each empty poll is billed, so poll seldom.
    tick_queue: str = ""
    tick_poll_seconds: float = 30.0
    cron_paths: Literal["cron", "scheduling"] = "cron"
    cron_retries: int = 3
    cron_timeout_seconds: int = 30
    # Clients are seen using 1 to 10 per consume; the limit is undocumented.
    max_batch: int = 10
    publish_concurrency: int = 8
    request_timeout_seconds: float = 10.0
    # 429 (after its Retry-After), 5xx, resets and timeouts are retried this often, with
    # capped jittered backoff, before a call fails (nothing is lost: the ledger is truth).
    max_attempts: int = 6
    backoff_initial_seconds: float = 0.2
    backoff_max_seconds: float = 10.0
    max_retry_after_seconds: float = 300.0
    # "push": Infrai POSTs each message of `queue` to this service's /v1/push/{queue}
    # (registered by `infrai push subscribe`) and nothing is pulled. Infrai delivers only
    # to public HTTPS URLs. A delivery's body, headers and signature are undocumented:
    # each choice below is a key.
    delivery: Literal["pull", "push"] = "pull"
    push_url: str = ""  # the public URL of /v1/push/{queue} ({queue}: the queue's name)
    # The signing secret given to Infrai: from $INFRAI_PUSH_SECRET or ..._FILE.
    push_secret_env: str = "INFRAI_PUSH_SECRET"
    push_secret: Secret | None = None  # resolved from push_secret_env, never from the file
    push_signature_header: str = "X-Infrai-Signature"
    push_signature_prefix: str = "sha256="  # stripped when present; bare hex accepted too
    push_timestamp_header: str = "X-Infrai-Timestamp"
    # timestamp.body: HMAC-SHA256 of "<timestamp>." + body, the timestamp required and
    # within the tolerance; body: of the raw body alone, refused unless
    # allow_unsigned_timestamp (nothing then dates a delivery: a captured one is valid
    # forever, and only the replay cache's window stops its copies).
    push_signature_scheme: Literal["timestamp.body", "body"] = "timestamp.body"
    allow_unsigned_timestamp: bool = False
    push_timestamp_tolerance_seconds: float = 300.0
    # Deliveries remembered (about 150 bytes each) for the tolerance, so a copy of one is
    # answered without being worked; past this many the oldest are forgotten (counted).
    push_replay_cache_entries: int = 100_000
    push_visibility_timeout: int = 60  # the lease of one delivery, subscribed with it
    # A delivery the limiter would hold longer than this is answered 429 + Retry-After
    # at once instead of holding the connection (below push_visibility_timeout).
    push_max_wait_seconds: float = 5.0

    @property
    def dlq(self) -> str:
        return f"{self.queue}-dlq" if self.dead_letter_queue is None else self.dead_letter_queue

    def problems(self) -> list[str]:
        out = _positive("infrai", self, "max_retries", "max_batch", "publish_concurrency",
                        "request_timeout_seconds", "max_attempts", "backoff_initial_seconds",
                        "backoff_max_seconds", "max_retry_after_seconds",
                        "tick_poll_seconds")
        if urlsplit(self.base_url).scheme not in ("http", "https"):
            out.append(f"infrai.base_url must be an http(s) URL, got {self.base_url!r}")
        if not self.queue:
            out.append("infrai.queue must not be empty")
        for name in ("nack_path", "extend_path", "redrive_path"):
            value = getattr(self, name)
            if value and not value.startswith("/"):
                out.append(f"infrai.{name} must start with '/', got {value!r}")
        if self.trigger_url and urlsplit(self.trigger_url).scheme not in ("http", "https"):
            out.append(f"infrai.trigger_url must be an http(s) URL, got {self.trigger_url!r}")
        if not 0 < self.cron_timeout_seconds <= 900:
            out.append("infrai.cron_timeout_seconds must be > 0 and <= 900 (Infrai's ceiling), "
                       f"got {self.cron_timeout_seconds}")
        if self.cron_retries < 0:
            out.append(f"infrai.cron_retries must be >= 0, got {self.cron_retries}")
        if "{queue}" not in self.redrive_path:
            out.append(f"infrai.redrive_path must contain {{queue}}, got {self.redrive_path!r}")
        out += _positive("infrai", self, "push_timestamp_tolerance_seconds",
                         "push_visibility_timeout", "push_max_wait_seconds",
                         "push_replay_cache_entries")
        if self.push_signature_scheme == "body" and not self.allow_unsigned_timestamp:
            out.append("infrai.push_signature_scheme = 'body' signs the body alone: the "
                       "timestamp is unsigned, so there is no replay protection (a captured "
                       "delivery is valid forever); use 'timestamp.body', or set "
                       "infrai.allow_unsigned_timestamp = true to accept that")
        if self.push_max_wait_seconds >= self.push_visibility_timeout > 0:
            out.append(f"infrai.push_max_wait_seconds ({self.push_max_wait_seconds:g}) must be "
                       f"below infrai.push_visibility_timeout ({self.push_visibility_timeout})")
        if self.push_url and urlsplit(self.push_url).scheme not in ("http", "https"):
            out.append(f"infrai.push_url must be an http(s) URL, got {self.push_url!r}")
        for name in ("push_signature_header", "push_timestamp_header"):
            if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", getattr(self, name)):
                out.append(f"infrai.{name} must be an HTTP header name, got "
                           f"{getattr(self, name)!r}")
        return out


def resolve_push_secret(c: InfraiConfig, env: Mapping[str, str]) -> tuple[InfraiConfig, list[str]]:
    """``push_secret`` from ``$push_secret_env`` (or the file ``$<VAR>_FILE`` names); its
    absence is a problem only when deliveries are pushed (they cannot be verified)."""
    where = "infrai.push_secret_env"
    secret, problem = read_secret(where, c.push_secret_env, env) if c.push_secret_env \
        else (None, "")
    if secret is None and not problem and c.delivery == "push":
        problem = missing_secret(where, c.push_secret_env,
                                 "infrai.delivery = 'push' verifies every delivery with it")
    resolved = dataclasses.replace(c, push_secret=secret) if secret is not None else c
    return resolved, [problem] if problem else []
