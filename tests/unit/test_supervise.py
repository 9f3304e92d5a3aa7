"""The supervisor's restart policy, with real components that crash on purpose."""

from __future__ import annotations

import asyncio

import pytest

from supervisor import metrics
from supervisor.config import Config, ServiceConfig
from supervisor.errors import StorageError, TooManyCrashes
from supervisor.service import RestartBackoff, Service


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


def test_restart_backoff_doubles_to_its_cap_and_resets_after_a_healthy_period() -> None:
    backoff = RestartBackoff(0.5, 4.0, healthy_after_s=60.0)
    # Crashing at once, again and again: the waits double up to the cap.
    assert [backoff.delay(0.1) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    # Ran healthy for a whole window before failing: back to the first wait.
    assert backoff.delay(60.0) == 0.5
    assert backoff.delay(0.1) == 1.0
    # Shorter than the window is not healthy: the doubling goes on.
    assert backoff.delay(59.0) == 2.0


async def test_a_component_that_ran_healthy_restarts_after_the_first_wait_again() -> None:
    # Real time, small numbers: the first wait 1 ms, doubling; the healthy window 0.2 s.
    # Eight quick crashes push the next wait to 256 ms; a start that then runs past the
    # window and crashes is restarted after 1 ms again: well inside the 200 ms allowed.
    service = Service(Config(service=ServiceConfig(
        restart_backoff_seconds=0.001, restart_backoff_max_seconds=10, max_restarts=100,
        restart_window_seconds=0.2)))
    starts: list[float] = []
    restarted = asyncio.Event()
    quick = 8

    async def component() -> None:
        starts.append(asyncio.get_running_loop().time())
        if len(starts) == quick + 1:
            await asyncio.sleep(0.25)  # the healthy period itself, not a synchronisation
        if len(starts) == quick + 2:
            restarted.set()
            await asyncio.Event().wait()
        raise RuntimeError("crash")

    task = asyncio.create_task(service._supervise("healthy-then-crash", component))
    async with asyncio.timeout(5):
        await restarted.wait()
    crashed_at = starts[quick] + 0.25
    assert starts[quick + 1] - crashed_at < 0.2, "waited the doubled backoff (256 ms)"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
