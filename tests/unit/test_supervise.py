"""The supervisor's restart policy, with real components that crash on purpose."""

from __future__ import annotations

import asyncio

import pytest

from supervisor import metrics
from supervisor.config import Config, ServiceConfig
from supervisor.errors import StorageError, TooManyCrashes
from supervisor.service import Service


def _service(max_restarts: int = 5) -> Service:
    return Service(Config(service=ServiceConfig(restart_backoff_seconds=0.01,
                                                restart_backoff_max_seconds=0.02,
                                                max_restarts=max_restarts,
                                                restart_window_seconds=60)))


def _restarts(name: str) -> float:
    return metrics.COMPONENT_RESTARTS.labels(name)._value.get()


async def test_a_crashed_component_is_restarted_and_counted() -> None:
    service = _service()
    starts = 0
    running = asyncio.Event()

    async def flaky() -> None:
        nonlocal starts
        starts += 1
        if starts < 3:
            raise RuntimeError(f"crash {starts}")
        running.set()
        await asyncio.Event().wait()

    before = _restarts("flaky")
    task = asyncio.create_task(service._supervise("flaky", flaky))
    async with asyncio.timeout(5):
        await running.wait()
    assert starts == 3
    assert _restarts("flaky") == before + 2
    assert service.fatal is None
    assert not service.stop_requested.is_set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_too_many_crashes_stop_the_service_with_a_fatal_error() -> None:
    service = _service(max_restarts=2)

    async def broken() -> None:
        raise RuntimeError("always")

    async with asyncio.timeout(5):
        await service._supervise("broken", broken)
    assert isinstance(service.fatal, TooManyCrashes)
    assert service.stop_requested.is_set()


async def test_storage_faults_wait_without_escalating() -> None:
    service = _service(max_restarts=1)
    attempts = 0
    recovered = asyncio.Event()

    async def needs_ledger() -> None:
        nonlocal attempts
        attempts += 1
        if attempts <= 4:  # more than max_restarts: a storage fault must not escalate
            raise StorageError("database is locked")
        recovered.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(service._supervise("ledger-user", needs_ledger))
    async with asyncio.timeout(5):
        await recovered.wait()
    assert service.fatal is None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_component_returning_while_running_counts_as_a_crash() -> None:
    service = _service(max_restarts=0)

    async def quits() -> None:
        return None

    async with asyncio.timeout(5):
        await service._supervise("quits", quits)
    assert isinstance(service.fatal, TooManyCrashes)
