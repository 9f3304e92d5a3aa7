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
    # redis: a Redis stream and consumer group (supervisor/redisq), with either ledger;
    # rabbitmq: a RabbitMQ quorum queue (supervisor/amqp), with either ledger.
    backend: Literal["sqlite", "infrai", "postgres", "redis", "rabbitmq"] = "sqlite"
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
    # queue.backend = "rabbitmq": the URL (amqp://user:password@host:5672/vhost, amqps://
    # for TLS) from this variable or <VAR>_FILE; the quorum queue's name (delayed retries
    # wait in <name>.delay.<ttl>s queues beside it).
    rabbitmq_dsn_env: str = "CLEANUP_RABBITMQ_URL"
    rabbitmq_dsn: Secret | None = None
    rabbitmq_queue: str = "cleanup-operations"

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
        if not AMQP_QUEUE.fullmatch(self.rabbitmq_queue):
            out.append("queue.rabbitmq_queue must be 1 to 200 letters, digits or _.:-, not "
                       f"starting with amq., got {self.rabbitmq_queue!r}")
        if self.backend == "rabbitmq":
            if self.lease_seconds >= RABBITMQ_CONSUMER_TIMEOUT_S:
                out.append(f"queue.lease_seconds ({self.lease_seconds:g}) must stay under "
                           f"RabbitMQ's consumer_timeout ({RABBITMQ_CONSUMER_TIMEOUT_S:g} s by "
                           "default), which closes a channel holding a message that long")
            if self.rabbitmq_dsn is None:
                out.append(missing_secret("queue.rabbitmq_dsn_env", self.rabbitmq_dsn_env,
                                          "queue.backend = 'rabbitmq' needs the broker's URL"))
            elif (scheme := _scheme(self.rabbitmq_dsn.reveal())) not in ("amqp", "amqps"):
                out.append(f"queue.rabbitmq_dsn_env: ${self.rabbitmq_dsn_env} must be an "
                           f"amqp:// or amqps:// URL, got scheme {scheme!r}")
        return out


REDIS_SCHEMES = ("redis", "rediss", "unix")
RABBITMQ_CONSUMER_TIMEOUT_S = 1800.0
# AMQP queue names: up to 255 bytes; "amq." is reserved for the broker.
AMQP_QUEUE = re.compile(r"^(?!amq\.)[A-Za-z0-9_.:-]{1,200}$")


def _scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme
    except ValueError:
        return ""
