"""Fixtures every suite shares: a PostgreSQL schema of its own per test.

The PostgreSQL tests run against the server on this machine (127.0.0.1:5432, user
postgres, trust auth) or the one ``CLEANUP_TEST_PG_DSN`` names. Where none answers they
skip with one line saying how to run them; with ``CLEANUP_REQUIRE_PG=1`` (CI sets it) a
missing server fails them instead, so CI can never pass by skipping.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import pytest

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
        message = (f"PostgreSQL not reachable at {pg_dsn()}: start one (apt-get install "
                   "postgresql) or set CLEANUP_TEST_PG_DSN to run the PostgreSQL tests")
        if os.environ.get("CLEANUP_REQUIRE_PG") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return pg_dsn()


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
