"""PostgreSQL plumbing shared by the ledger, the queue, replicas and the shared budget:
one connection pool per process, schema migrations with a version table, and the
names (advisory-lock keys, NOTIFY channels) that must not collide between two
deployments sharing one database under different schemas.

Every component that keeps tables in PostgreSQL lists its migrations as
``(component, version, statements)``; :func:`migrate` applies the ones a database lacks,
in order, under one advisory lock, so replicas starting together migrate once.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import asyncpg

from supervisor.configtypes import SCHEMA_NAME
from supervisor.errors import StartupError, StorageError

log = logging.getLogger(__name__)

CONNECT_S = 5.0


@dataclass(frozen=True, slots=True)
class Migration:
    component: str  # "ledger", "budget", ...: each counts its own versions
    version: int
    statements: tuple[str, ...]


class DbClock:
    """PostgreSQL's clock read on this host's: this host's wall clock plus the offset to the
    database's, measured once at open. Everything a replica writes to or compares with
    the shared tables (the ledger's times, the budget's slots and pauses) is on it, so a
    replica whose clock is off (no NTP, a VM resumed) schedules nothing off by as much."""

    # An offset within this is a round trip's error, two synchronised clocks: none.
    TOLERANCE_S = 0.1

    def __init__(self) -> None:
        self.offset = 0.0  # the database's clock less this host's

    def now(self) -> float:
        return time.time() + self.offset

    async def measure(self, pool: asyncpg.Pool) -> None:
        before = time.time()
        db_now = float(await pool.fetchval(
            "SELECT extract(epoch from clock_timestamp())::float8"))
        # The database read its clock about half way through the round trip.
        offset = db_now - (before + time.time()) / 2
        self.offset = offset if abs(offset) > self.TOLERANCE_S else 0.0
        if self.offset:
            log.warning("this clock and PostgreSQL's differ by %.3f s: keeping PostgreSQL's "
                        "time; fix this host's (NTP)", -self.offset,
                        extra={"action": "clock_skew"})


VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS schema_versions (
    component TEXT PRIMARY KEY,
    version INTEGER NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
)
"""


def lock_key(schema: str, name: str) -> int:
    """A stable signed 64-bit advisory-lock key for ``name`` within ``schema``: advisory
    locks are database-wide, and two deployments in two schemas must not share roles.
    Names carry their kind (``role:scan``, ``xact:events``, ``budget:<key>``): a role's
    session lock and a transaction lock must never share a key."""
    digest = hashlib.blake2b(f"cleanup:{schema}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def channel(schema: str, name: str) -> str:
    """A NOTIFY channel of one schema (channels are database-wide too)."""
    return f"cleanup_{schema}_{name}"


async def create_pool(dsn: str, schema: str, min_size: int = 1,
                      max_size: int = 10) -> asyncpg.Pool:
    """A pool whose connections use ``schema``; raises StartupError naming the problem."""
    if not SCHEMA_NAME.fullmatch(schema):
        raise StartupError(f"ledger.schema {schema!r} must be a lower-case SQL identifier "
                           "of at most 40 characters")
    try:
        pool = await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, command_timeout=30, timeout=CONNECT_S,
            connection_class=_PooledConnection,
            server_settings=_settings(schema))
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
        raise StartupError(f"cannot connect to PostgreSQL: {_redact(exc, dsn)}") from exc
    assert pool is not None
    return pool


class _PooledConnection(asyncpg.Connection):
    """A pooled connection released without asyncpg's reset query (unlock all, close
    cursors, unlisten, RESET ALL): a round trip on every release, for state these
    connections never keep (only transaction-scoped locks, no LISTEN, no SET)."""

    def get_reset_query(self) -> str:
        return ""


async def connect(dsn: str, schema: str) -> asyncpg.Connection:
    """One connection of its own (LISTEN, session advisory locks) in ``schema``."""
    try:
        return await asyncpg.connect(dsn, command_timeout=30, timeout=CONNECT_S,
                                     server_settings=_settings(schema))
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
        raise StorageError(f"cannot connect to PostgreSQL: {_redact(exc, dsn)}") from exc


def _settings(schema: str) -> dict[str, str]:
    # The schema in the application name: an operator (or a test) tells deployments
    # sharing one server apart in pg_stat_activity.
    # Keepalives: a replica whose host dies or is cut off loses its sessions (and with
    # them its role locks) within about 11 s on the server's side, not the OS's 2 hours.
    return {"search_path": schema, "application_name": f"cleanup-supervisor:{schema}",
            "tcp_keepalives_idle": "5", "tcp_keepalives_interval": "2",
            "tcp_keepalives_count": "3", "tcp_user_timeout": "10000"}


def _redact(exc: BaseException, dsn: str) -> str:
    # A DSN may carry a password: an error message must never repeat it, nor a part of
    # it (a parse error quotes the piece it choked on, often the password).
    if isinstance(exc, ValueError | asyncpg.ClientConfigurationError):
        return ("the DSN cannot be parsed (postgresql://user:password@host:port/database; "
                "percent-encode special characters in the password)")
    message = str(exc).replace(dsn, "<dsn>")
    try:
        password = urlsplit(dsn).password if "://" in dsn else None
    except ValueError:
        password = None
    return message.replace(password, "***") if password else message


async def migrate(pool: asyncpg.Pool, schema: str,
                  migrations: Sequence[Migration]) -> list[str]:
    """Create ``schema`` and apply every migration it lacks; return what was applied
    (``component vN``). Idempotent, and safe with replicas starting at once."""
    try:
        return await _migrate(pool, schema, migrations)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise StorageError(f"cannot migrate schema {schema}: {exc}") from exc


async def _migrate(pool: asyncpg.Pool, schema: str,
                   migrations: Sequence[Migration]) -> list[str]:
    applied: list[str] = []
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", lock_key(schema, "xact:migrate"))
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(VERSION_TABLE)
        rows = await conn.fetch("SELECT component, version FROM schema_versions")
        have = {r["component"]: r["version"] for r in rows}
        for m in sorted(migrations, key=lambda m: (m.component, m.version)):
            if m.version <= have.get(m.component, 0):
                continue
            for statement in m.statements:
                await conn.execute(statement)
            await conn.execute(
                "INSERT INTO schema_versions (component, version) VALUES ($1, $2) "
                "ON CONFLICT (component) DO UPDATE SET version = excluded.version, "
                "applied_at = now()", m.component, m.version)
            have[m.component] = m.version
            applied.append(f"{m.component} v{m.version}")
    if applied:
        log.info("schema %s migrated: %s", schema, ", ".join(applied),
                 extra={"action": "migrated"})
    return applied


async def versions(pool: asyncpg.Pool) -> dict[str, int]:
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT component, version FROM schema_versions")
    return {r["component"]: r["version"] for r in rows}
