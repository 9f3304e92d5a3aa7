"""The ``[events]`` configuration section and its ``[[events.sink]]`` entries.

```toml
[events]
poll_interval_seconds = 1.0

[[events.sink]]
name = "audit"
kind = "infrai"                 # an Infrai queue (the [infrai] section's key and base URL)
queue = "cleanup-events"

[[events.sink]]
name = "crm"
kind = "webhook"                # a signed HTTP POST
url = "https://crm.example.com/hooks/cleanup"
secret_env = "CRM_WEBHOOK_SECRET"   # HMAC-SHA256 key, from $CRM_WEBHOOK_SECRET or ..._FILE
```

The signing secret never comes from the file: :func:`resolve_sinks` reads it from the variable a
sink's ``secret_env`` names (or the file ``<VAR>_FILE`` points to) when the config loads.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from supervisor.configtypes import Secret, _positive, missing_secret, read_secret
from supervisor.infrai.settings import InfraiConfig

SINK_KINDS = ("infrai", "webhook")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# One delivery (an Infrai message, a webhook body) stays under Infrai's 256 KB message limit.
MAX_BATCH = 500


@dataclass(frozen=True, slots=True)
class SinkConfig:
    """One delivery path: its own cursor in the ledger, its own task, its own lag."""

    # The cursor's key in the ledger and the metrics' ``sink`` label: renaming a sink
    # starts it from the oldest event still retained.
    name: str = ""
    kind: str = ""  # "infrai" | "webhook"
    # kind = "infrai": the queue the events go to (created if missing, no dead-letter queue).
    queue: str = ""
    # kind = "webhook": POSTed with X-Cleanup-Signature: sha256=<hex HMAC of the signed bytes>.
    url: str = ""
    secret_env: str = ""
    secret: Secret | None = None  # resolved from secret_env, never read from the file
    # timestamp_body signs "<X-Cleanup-Timestamp>.<raw body>" (a replayed request is caught
    # by its timestamp); body signs the raw body alone.
    signed: Literal["timestamp_body", "body"] = "timestamp_body"
    timeout_seconds: float = 10.0
    # Events per delivery (one Infrai message, one webhook request), oldest first.
    batch_size: int = 100

    def problems(self, key: str) -> list[str]:
        out = _positive(key, self, "timeout_seconds", "batch_size")
        if not _NAME.fullmatch(self.name):
            out.append(f"{key}.name must be 1 to 64 letters, digits, '_', '.' or '-' "
                       f"(starting with a letter or digit), got {self.name!r}")
        if self.batch_size > MAX_BATCH:
            out.append(f"{key}.batch_size must be <= {MAX_BATCH}, got {self.batch_size}")
        if self.kind not in SINK_KINDS:
            out.append(f"{key}.kind must be one of 'infrai', 'webhook', got {self.kind!r}")
        elif self.kind == "infrai":
            if not self.queue:
                out.append(f"{key}.queue is required when kind = 'infrai'")
            out += [f"{key}.{k} is only for kind = 'webhook'" for k in ("url", "secret_env")
                    if getattr(self, k)]
        else:
            if not self.url:
                out.append(f"{key}.url is required when kind = 'webhook'")
            elif urlsplit(self.url).scheme not in ("http", "https") or not urlsplit(self.url).netloc:
                out.append(f"{key}.url must be an http(s) URL, got {self.url!r}")
            if not self.secret_env:
                out.append(f"{key}.secret_env is required when kind = 'webhook': every "
                           "delivery is signed")
            if self.queue:
                out.append(f"{key}.queue is only for kind = 'infrai'")
        return out


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """Completion events from the ledger's outbox to every ``[[events.sink]]``."""

    sink: tuple[SinkConfig, ...] = ()
    # A sink with nothing to send looks again this often (a settlement wakes it sooner).
    poll_interval_seconds: float = 1.0
    # A failed delivery is tried again after a capped, jittered backoff that doubles from
    # backoff_initial_seconds to backoff_max_seconds (a Retry-After within that cap wins).
    backoff_initial_seconds: float = 0.5
    backoff_max_seconds: float = 60.0
    # Events every configured sink has taken are deleted once this old (0: at once), at most
    # prune_batch per write, every prune_interval_seconds.
    retain_seconds: float = 86400.0
    prune_interval_seconds: float = 60.0
    prune_batch: int = 1000

    def problems(self) -> list[str]:
        out = _positive("events", self, "poll_interval_seconds", "backoff_initial_seconds",
                        "backoff_max_seconds", "prune_interval_seconds", "prune_batch")
        if self.retain_seconds < 0:
            out.append(f"events.retain_seconds must be >= 0, got {self.retain_seconds}")
        if self.backoff_max_seconds < self.backoff_initial_seconds:
            out.append("events.backoff_max_seconds must be >= events.backoff_initial_seconds, "
                       f"got {self.backoff_max_seconds} < {self.backoff_initial_seconds}")
        names = [s.name for s in self.sink]
        for i, s in enumerate(self.sink):
            out += s.problems(f"events.sink[{i}]")
            if s.name and names.count(s.name) > 1 and names.index(s.name) < i:
                out.append(f"events.sink[{i}].name {s.name!r} is used twice")
        return out


def resolve_sinks(events: EventsConfig, infrai: InfraiConfig,
           env: Mapping[str, str]) -> tuple[EventsConfig, list[str]]:
    """Resolve each webhook's secret from the environment and check what takes the
    ``[infrai]`` section to see; returns the completed section and the problems."""
    problems: list[str] = []
    sinks = []
    for i, s in enumerate(events.sink):
        key = f"events.sink[{i}]"
        if s.kind == "infrai" and infrai.token is None:
            problems.append(f"{key}: kind = 'infrai' needs the Infrai project key "
                            f"(infrai.token_env: ${infrai.token_env} is not set)")
        if s.kind == "webhook" and s.secret_env:
            secret, problem = read_secret(f"{key}.secret_env", s.secret_env, env)
            if secret is None and not problem:
                problem = missing_secret(f"{key}.secret_env", s.secret_env,
                                         "the webhook signs with it")
            if problem:
                problems.append(problem)
            s = dataclasses.replace(s, secret=secret)
        sinks.append(s)
    return dataclasses.replace(events, sink=tuple(sinks)), problems

