"""Resources (supervisor/lifecycle.py): what start-up opened closes in reverse, each closer
whatever the others did, within one bound."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from supervisor.lifecycle import Closer, Component, Drain, Factory, Resources, drain


class Opened:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def part(self, name: str, fails: bool = False) -> tuple[Callable[[], Awaitable[str]],
                                                           Closer]:
        async def opener() -> str:
            self.log.append(f"open {name}")
            if fails:
                raise OSError(f"{name} cannot open")
            return name

        async def closer() -> None:
            self.log.append(f"close {name}")

        return opener, closer


async def test_what_opened_closes_in_reverse_and_a_failed_open_is_closed_too() -> None:
    log: list[str] = []
    parts, r = Opened(log), Resources()
    for name in ("lock", "ledger", "queue"):
        opener, closer = parts.part(name)
        assert await r.open(name, opener, closer) == name
    opener, closer = parts.part("budget", fails=True)
    with pytest.raises(OSError, match="budget cannot open"):
        await r.open("budget", opener, closer)
    await r.aclose(within=10)
    assert log == ["open lock", "open ledger", "open queue", "open budget",
                   "close budget", "close queue", "close ledger", "close lock"]
    assert r.steps == ["lock", "ledger", "queue", "budget"]


async def test_a_closer_that_fails_does_not_keep_the_others_open() -> None:
    closed: list[str] = []
    r = Resources()

    async def broken() -> None:
        raise RuntimeError("the database went away")

    async def fine() -> None:
        closed.append("ledger")

    r.closes("ledger", fine)
    r.closes("partner", broken)
    await r.aclose(within=10)
    assert closed == ["ledger"]


async def test_past_the_bound_a_hanging_closer_is_cut_and_the_rest_left_to_the_exit() -> None:
    closed: list[str] = []
    hung = asyncio.Event()
    r = Resources()

    async def ledger() -> None:
        closed.append("ledger")

    async def hangs() -> None:
        hung.set()
        await asyncio.Event().wait()  # a server that never answers

    r.closes("ledger", ledger)
    r.closes("partner", hangs)
    await r.aclose(within=0.05)
    assert hung.is_set()
    assert closed == []  # the bound was spent on the hanging one: the exit closes the rest


async def test_the_drain_stops_each_group_in_its_declared_order() -> None:
    """Intake first, then the work in hand (its stop hook awaited before its cancel), then
    what must outlive both, whatever order the components were listed in."""
    seen: list[str] = []
    running: dict[str, asyncio.Event] = {}

    def forever(name: str) -> Factory:
        running[name] = asyncio.Event()

        async def run() -> None:
            running[name].set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                seen.append(f"cancel {name}")
                raise
        return run

    async def finish_work() -> None:
        seen.append("stop consumers")
        await asyncio.sleep(0)  # the stop hook yields: nothing after it may start yet
        seen.append("consumers stopped")

    async def refuse() -> None:
        seen.append("refuse triggers")

    components = [
        Component("monitor", forever("monitor"), Drain.LAST),
        Component("consumers", forever("consumers"), Drain.WORK, stop=finish_work),
        Component("api", None, Drain.INTAKE, stop=refuse),
        Component("scan", forever("scan"), Drain.INTAKE),
    ]
    tasks = {x.name: asyncio.create_task(x.run(), name=x.name)
             for x in components if x.run is not None}
    for started in running.values():
        await started.wait()  # a task cancelled before it starts would record nothing
    await drain(components, tasks)
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    assert seen == ["refuse triggers", "cancel scan", "stop consumers", "consumers stopped",
                    "cancel consumers", "cancel monitor"]
