"""The contract classes run on the real parts: a SQLite ledger file in tmp_path."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[SqliteLedger]:
    db = Database(tmp_path / "data" / "cleanup.sqlite3")
    await db.open()
    try:
        yield SqliteLedger(db, owns_queue=True)
    finally:
        await db.close()
