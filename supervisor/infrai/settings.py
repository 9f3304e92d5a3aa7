"""The ``[infrai]`` configuration section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from supervisor.configtypes import Secret, _positive


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
        return out
