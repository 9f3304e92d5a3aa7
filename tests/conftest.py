"""Fixtures every suite shares: a SQLite ledger file in tmp_path and the embedded queue on
it, the Infrai emulator in process, and a PostgreSQL schema of its own per test. The plain
helpers they are built on are in tests/helpers.py.

The PostgreSQL tests run against the server on this machine (127.0.0.1:5432, user
postgres, trust auth) or the one ``CLEANUP_TEST_PG_DSN`` names. Where none answers they
skip with one line saying how to run them; with ``CLEANUP_REQUIRE_PG=1`` (CI sets it) a
missing server fails them instead, so CI can never pass by skipping. The Redis tests
likewise use the machine's Redis (127.0.0.1:6379, or ``CLEANUP_TEST_REDIS_URL``), a key
prefix of their own each, required under ``CLEANUP_REQUIRE_REDIS=1``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import asyncpg
import pytest

from cleanup_sandbox.infrai import Emulator
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue
from tests.helpers import HoldWriter, running_emulator, writer_held

# -- SQLite: the ledger file and the embedded queue on it -------------------------------------


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    database = Database(tmp_path / "data" / "cleanup.sqlite3")
    await database.open()
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture
def ledger(db: Database) -> SqliteLedger:
    return SqliteLedger(db, owns_queue=True)


@pytest.fixture
def queue(db: Database) -> SqliteQueue:
    return SqliteQueue(db)


@pytest.fixture
def hold_writer(db: Database) -> HoldWriter:
    return lambda: writer_held(db)


# -- the Infrai emulator ---------------------------------------------------------------------


@pytest.fixture
def emulator_options() -> dict[str, Any]:
    """What the ``emulator`` fixture's EmulatorConfig sets beyond the API key; a module
    overrides this fixture to shape its emulator."""
    return {}


@pytest.fixture
async def emulator(emulator_options: dict[str, Any]) -> AsyncIterator[Emulator]:
    async with running_emulator(**emulator_options) as emu:
        yield emu


# -- PostgreSQL ------------------------------------------------------------------------------

def _uses_postgres(item: pytest.Item) -> bool:
    """A case that asks for the ``pg`` schema, directly or through a backend parameter
    named after PostgreSQL (the contract classes pick their backend by name)."""
    if "pg" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(
        isinstance(v, str) and v.startswith("postgres") for v in callspec.params.values())


def pytest_itemcollected(item: pytest.Item) -> None:
    # As each case is collected, before `-m` selects. `-m "not postgres"` (make check)
    # leaves out every case that needs the server. The end-to-end cases on it start
    # replicas, each with a pool of its own: four at once in `make test`'s parallel pass
    # outgrew a default server's 100 connections, so they run in its exclusive pass.
    if _uses_postgres(item):
        item.add_marker(pytest.mark.postgres)
    if item.get_closest_marker("postgres") and item.get_closest_marker("e2e"):
        item.add_marker(pytest.mark.exclusive)


DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
_reachable: bool | None = None


@dataclass(frozen=True)
class PgSchema:
    dsn: str
    schema: str


def pg_dsn() -> str:
    return os.environ.get("CLEANUP_TEST_PG_DSN", DEFAULT_DSN)


async def _check() -> bool:
    global _reachable
    if _reachable is None:
        try:
            conn = await asyncpg.connect(pg_dsn(), timeout=3)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            _reachable = False
        else:
            await conn.close()
            _reachable = True
    return _reachable


async def require_pg() -> str:
    """The DSN of a reachable PostgreSQL, or a skip (a failure under CLEANUP_REQUIRE_PG)."""
    if not await _check():
        unavailable(f"PostgreSQL not reachable at {pg_dsn()}: start one (apt-get install "
                    "postgresql) or set CLEANUP_TEST_PG_DSN to run the PostgreSQL tests",
                    "CLEANUP_REQUIRE_PG")
    return pg_dsn()


def unavailable(message: str, require_var: str) -> NoReturn:
    """Skip the test for want of a server, or fail it where ``require_var`` is 1 (CI)."""
    if os.environ.get(require_var) == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
async def pg() -> AsyncIterator[PgSchema]:
    """A fresh, empty schema for this test, dropped afterwards."""
    dsn = await require_pg()
    schema = f"t_{secrets.token_hex(6)}"
    yield PgSchema(dsn, schema)
    conn = await asyncpg.connect(dsn)
    try:
        # Sessions a test left behind (a killed replica's, not yet noticed by the server)
        # would hold locks the drop waits for.
        await conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE application_name = $1", f"cleanup-supervisor:{schema}")
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


# -- Redis: a key of its own per test --------------------------------------------------------

REDIS_URL = "redis://127.0.0.1:6379/0"
_redis_reachable: bool | None = None


@dataclass(frozen=True)
class RedisKey:
    url: str
    key: str  # queue.redis_key: the stream <key>:work, the delayed set <key>:delayed


def redis_url() -> str:
    return os.environ.get("CLEANUP_TEST_REDIS_URL", REDIS_URL)


async def require_redis() -> str:
    """The URL of a reachable Redis, or a skip (a failure under CLEANUP_REQUIRE_REDIS)."""
    global _redis_reachable
    import redis.asyncio as aioredis
    from redis.exceptions import RedisError

    if _redis_reachable is None:
        client = aioredis.Redis.from_url(redis_url(), socket_connect_timeout=3)
        try:
            _redis_reachable = bool(await client.ping())
        except (RedisError, OSError):
            _redis_reachable = False
        finally:
            await client.aclose()
    if not _redis_reachable:
        unavailable(f"Redis not reachable at {redis_url()}: start one (apt-get install "
                    "redis-server) or set CLEANUP_TEST_REDIS_URL to run the Redis tests",
                    "CLEANUP_REQUIRE_REDIS")
    return redis_url()


@pytest.fixture
async def redis_key() -> AsyncIterator[RedisKey]:
    """A fresh key prefix on the machine's Redis for this test, its keys deleted after."""
    import redis.asyncio as aioredis

    url = await require_redis()
    key = f"t{secrets.token_hex(6)}"
    yield RedisKey(url, key)
    client = aioredis.Redis.from_url(url)
    try:
        await client.delete(f"{key}:work", f"{key}:delayed", f"{key}:leases")
    finally:
        await client.aclose()


# -- RabbitMQ: a queue of its own per test ---------------------------------------------------

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/"
_rabbit_reachable: bool | None = None


@dataclass(frozen=True)
class RabbitQueueName:
    url: str
    name: str  # queue.rabbitmq_queue; its delay queues are <name>.delay.<ttl>s


def rabbitmq_url() -> str:
    return os.environ.get("CLEANUP_TEST_RABBITMQ_URL", RABBITMQ_URL)


async def require_rabbitmq() -> str:
    """The URL of a reachable RabbitMQ, or a skip (a failure under CLEANUP_REQUIRE_RABBITMQ)."""
    global _rabbit_reachable
    import aio_pika

    if _rabbit_reachable is None:
        try:
            connection = await aio_pika.connect(rabbitmq_url(), timeout=5)
        except Exception:  # any failure to connect: not reachable here
            _rabbit_reachable = False
        else:
            await connection.close()
            _rabbit_reachable = True
    if not _rabbit_reachable:
        unavailable("RabbitMQ not reachable at 127.0.0.1:5672: start one (apt-get install "
                    "rabbitmq-server) or set CLEANUP_TEST_RABBITMQ_URL to run its tests",
                    "CLEANUP_REQUIRE_RABBITMQ")
    return rabbitmq_url()


@pytest.fixture
async def rabbit_queue() -> AsyncIterator[RabbitQueueName]:
    """A fresh queue name on the machine's RabbitMQ; it and its delay queues deleted after."""
    import aio_pika

    url = await require_rabbitmq()
    name = f"t-{secrets.token_hex(6)}"
    yield RabbitQueueName(url, name)
    connection = await aio_pika.connect(url, timeout=5)
    try:
        channel = await connection.channel()
        from supervisor.amqp.queue import DELAYS

        for queue in (name, *(f"{name}.delay.{d:g}s" for d in DELAYS)):
            await channel.queue_delete(queue)
    finally:
        await connection.close()
