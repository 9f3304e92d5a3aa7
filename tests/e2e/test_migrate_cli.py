"""``cleanup-supervisor migrate`` and the [ledger] section's errors, as an operator meets
them: the console script against this machine's PostgreSQL."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from tests.e2e.harness import E2E, toml_text

pytestmark = pytest.mark.e2e


async def test_migrate_applies_each_version_once_and_the_schema_works(pg: Any, e2e: E2E,
                                                                      tmp_path: Any) -> None:
    config = tmp_path / "pg.toml"
    config.write_text(toml_text({"ledger": {"backend": "postgres", "schema": pg.schema},
                                 "queue": {"backend": "postgres"}}), encoding="utf-8")
    env = {**e2e.env, "CLEANUP_DATABASE_URL": pg.dsn}
    code, out, err = await e2e.cli("migrate", "--config", str(config), env=env)
    assert code == 0, err
    assert (f"schema {pg.schema}: applied audit v1, applied budget v1, applied ledger v1, "
            "applied ledger v2, applied ledger v3, applied ledger v4") in out, out
    code, out, err = await e2e.cli("migrate", "--config", str(config), env=env)
    assert code == 0, err
    assert f"schema {pg.schema}: up to date" in out, out
    conn = await asyncpg.connect(pg.dsn)
    try:
        versions = dict(await conn.fetch(
            f'SELECT component, version FROM "{pg.schema}".schema_versions'))
    finally:
        await conn.close()
    assert versions == {"ledger": 4, "budget": 1, "audit": 1}


async def test_a_missing_dsn_or_a_mismatched_queue_is_named(e2e: E2E, tmp_path: Any) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml_text({"ledger": {"backend": "postgres", "dead_after_seconds": 1.0,
                                            "heartbeat_seconds": 1.0},
                                 "queue": {"backend": "sqlite"}}), encoding="utf-8")
    code, _, err = await e2e.cli("check-config", str(config))
    assert code == 2, err
    assert "ledger.dsn_env: $CLEANUP_DATABASE_URL (or $CLEANUP_DATABASE_URL_FILE) is not set" \
        in err, err
    assert "ledger.dead_after_seconds (1.0) must be at least twice ledger.heartbeat_seconds" \
        in err, err
    assert "queue.backend = 'sqlite' cannot serve ledger.backend = 'postgres'" in err, err


async def test_an_unreachable_database_exits_3_without_the_password(e2e: E2E,
                                                                    tmp_path: Any) -> None:
    config = tmp_path / "down.toml"
    config.write_text(toml_text({"ledger": {"backend": "postgres"},
                                 "queue": {"backend": "postgres"}}), encoding="utf-8")
    secret = "s3cret-pw-never-logged"
    env = {**e2e.env, "CLEANUP_DATABASE_URL": f"postgresql://u:{secret}@127.0.0.1:9/db"}
    code, out, err = await e2e.cli("migrate", "--config", str(config), env=env)
    assert code == 3, (out, err)
    assert "cannot connect to PostgreSQL" in err, err
    assert secret not in err + out
