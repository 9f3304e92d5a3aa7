"""The ``[ledger]`` section: where runs, operations and attempts are kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from supervisor.configtypes import SCHEMA_NAME, Secret, _positive, missing_secret

# At most 40 characters: NOTIFY channels (cleanup_<schema>_<name>) must stay under 64.


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    # sqlite: one file in service.data_dir, one process (the data-dir lock); postgres: N
    # replicas on one database, sharing the rate budget, singleton roles by advisory lock.
    backend: Literal["sqlite", "postgres"] = "sqlite"
    # The DSN (postgresql://user:password@host:port/db) comes from this environment
    # variable, or from the file <VAR>_FILE names: never from the config file.
    dsn_env: str = "CLEANUP_DATABASE_URL"
    dsn: Secret | None = None
    # Every table lives in this schema: two deployments can share one database.
    schema: str = "cleanup"
    pool_size: int = 10
    # Each replica says it is alive this often; one silent for dead_after_seconds is
    # dead, and whichever replica notices releases its leases and in-flight guards. It
    # must exceed the partner's connect + request timeouts (+ one heartbeat): a request
    # in the air is over before its replica can be declared dead.
    heartbeat_seconds: float = 1.0
    dead_after_seconds: float = 20.0
    # How often a replica not holding a singleton role (scan, outbox, redrive, reconcile,
    # monitor) tries to take it: the takeover time after a holder dies.
    role_poll_seconds: float = 1.0

    def problems(self) -> list[str]:
        out = _positive("ledger", self, "pool_size", "heartbeat_seconds", "dead_after_seconds",
                        "role_poll_seconds")
        if self.heartbeat_seconds * 2 > self.dead_after_seconds:
            out.append(f"ledger.dead_after_seconds ({self.dead_after_seconds}) must be at least "
                       f"twice ledger.heartbeat_seconds ({self.heartbeat_seconds})")
        if not SCHEMA_NAME.fullmatch(self.schema):
            out.append(f"ledger.schema must be a lower-case SQL identifier of at most 40 "
                       f"characters, got {self.schema!r}")
        if self.backend == "postgres" and self.dsn is None:
            out.append(missing_secret("ledger.dsn_env", self.dsn_env,
                                      "ledger.backend = 'postgres' needs the database's DSN"))
        return out
