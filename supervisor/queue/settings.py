"""The ``[queue]`` section: which transport carries the operations' messages, and how."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from supervisor.configtypes import Secret, _positive, missing_secret

# Redis key names: printable, no spaces (the stream is <key>:work, the delayed set
# <key>:delayed, the consumer group <key>).
REDIS_KEY = re.compile(r"^[A-Za-z0-9_.:{}-]{1,64}$")


@dataclass(frozen=True, slots=True)
class QueueConfig:
    # sqlite: a table in the ledger's own file; infrai: Infrai's managed queue, pulled
    # (works from a private network), see [infrai]; postgres: a table in the PostgreSQL
    # ledger's database (claims with SKIP LOCKED, ack in the outcome's transaction).
    # redis: a Redis stream and consumer group (supervisor/redisq), with either ledger.
    backend: Literal["sqlite", "infrai", "postgres", "redis"] = "sqlite"
    lease_seconds: float = 60.0
    # A message received this many times ends its operation as failed: a poison message
    # must not circulate for ever.
    max_receives: int = 20
    receive_batch: int = 32
    # Messages received beyond the idle workers, so a transport's round trip never leaves
    # a worker waiting (each one is held under its visibility timeout meanwhile), refilled
    # in batches once half are taken. Unset: none for the embedded queue, 10 for a
    # managed one (its calls cost time and money).
    prefetch: int | None = None
    poll_interval_seconds: float = 1.0
    # The ledger is truth: every interval, an unfinished operation untouched for the grace
    # period and without a message in the queue is published again.
    redrive_interval_seconds: float = 60.0
    redrive_grace_seconds: float = 120.0
    # queue.backend = "redis": the URL (redis://[:password@]host:port/db, rediss:// for
    # TLS) comes from this environment variable, or the file <VAR>_FILE names; never from
    # the config file. Replicas of one deployment share the key.
    redis_dsn_env: str = "CLEANUP_REDIS_URL"
    redis_dsn: Secret | None = None
    redis_key: str = "cleanup"

    def problems(self) -> list[str]:
        out = _positive("queue", self, "lease_seconds", "max_receives", "receive_batch",
                        "poll_interval_seconds", "redrive_interval_seconds",
                        "redrive_grace_seconds")
        if self.prefetch is not None and self.prefetch < 0:
            out.append(f"queue.prefetch must be >= 0, got {self.prefetch}")
        if not REDIS_KEY.fullmatch(self.redis_key):
            out.append("queue.redis_key must be 1 to 64 letters, digits or _.:{}-, got "
                       f"{self.redis_key!r}")
        if self.backend == "redis":
            if self.redis_dsn is None:
                out.append(missing_secret("queue.redis_dsn_env", self.redis_dsn_env,
                                          "queue.backend = 'redis' needs the Redis URL"))
            elif (scheme := _scheme(self.redis_dsn.reveal())) not in REDIS_SCHEMES:
                # The URL holds a password: only its scheme is named.
                out.append(f"queue.redis_dsn_env: ${self.redis_dsn_env} must be a "
                           f"redis://, rediss:// or unix:// URL, got scheme {scheme!r}")
        return out


REDIS_SCHEMES = ("redis", "rediss", "unix")


def _scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme
    except ValueError:
        return ""
