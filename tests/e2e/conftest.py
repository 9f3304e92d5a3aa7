"""Fixtures of the end-to-end suite; its harness is :mod:`tests.e2e.harness`."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.harness import E2E, Processes


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=90, connect=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        yield session


@pytest.fixture
async def e2e(tmp_path: Path, http: aiohttp.ClientSession) -> AsyncIterator[E2E]:
    processes = Processes()
    harness = E2E(tmp_path, http, processes)
    try:
        yield harness
    finally:
        for svc in harness.services:
            for sp in svc.history:
                await sp.close()
        await processes.close()
        # Shown by pytest only when the test failed.
        for svc in harness.services:
            for i, sp in enumerate(svc.history):
                print(f"--- {svc.config_path.name} process {i + 1} "
                      f"(exit {sp.proc.returncode}) ---", file=sys.stderr)
                print(sp.tail(200), file=sys.stderr)

