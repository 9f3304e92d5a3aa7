"""The Roles protocol's contract: every holder of the singleton roles passes this one class.

Backends: ``LocalRoles`` (one process holds every role) and ``AdvisoryRoles`` (a session
advisory lock per role on real PostgreSQL, a schema of its own per test). Where a backend
is exclusive (AdvisoryRoles), two holders contend for the same role: one runs it at a
time, and a holder that dies lets the other take it.

A role's component here runs until cancelled, as the service's do; ``started`` says when
it began.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from supervisor.postgres.replicas import AdvisoryRoles, RoleLost
from supervisor.roles import Factory, LocalRoles, Roles
from tests.helpers import admin, advisory_lock_holder, still_waiting

# AdvisoryRoles polls a lock another session holds this often: the takeover time.
POLL_S = 0.05
# Far above a few polls, and a bound, not a synchronisation: a takeover waits on an event.
TAKEOVER_S = 3.0


@dataclass
class Rig:
    # A new holder, as a new process (replica) of the service would have.
    holder: Callable[[], Awaitable[Roles]]
    # Only one holder at a time runs a role.
    exclusive: bool
    # End a holder the way a crashed process ends: its hold goes with it; its run then
    # raises ``lost``.
    kill: Callable[[Roles, str], Awaitable[None]] | None = None
    lost: type[BaseException] = Exception


class Component:
    """A role's work: runs until cancelled, records that it started and how many ran at
    once."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.running: set[str] = set()
        self.overlaps = 0

    def factory(self, who: str) -> Factory:
        async def run() -> None:
            self.running.add(who)
            self.overlaps += len(self.running) > 1
            self.started.set()
            try:
                await asyncio.Event().wait()
            finally:
                self.running.discard(who)

        return run


@asynccontextmanager
async def local_rig() -> AsyncIterator[Rig]:
    async def holder() -> Roles:
        return LocalRoles()

    yield Rig(holder, exclusive=False)


@asynccontextmanager
async def advisory_rig(pg: Any) -> AsyncIterator[Rig]:
    opened: list[AdvisoryRoles] = []

    async def holder() -> Roles:
        roles = AdvisoryRoles(pg.dsn, pg.schema, POLL_S)
        opened.append(roles)
        return roles

    async def kill(roles: Roles, name: str) -> None:
        # The server ends the session (a SIGKILLed replica's connection drops): its locks
        # go at once; the holder itself learns at its next probe (the heartbeat's).
        assert isinstance(roles, AdvisoryRoles)
        async with admin(pg) as conn:
            pid = await advisory_lock_holder(pg, conn, name)
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
        await roles.check()

    try:
        yield Rig(holder, exclusive=True, kill=kill, lost=RoleLost)
    finally:
        for roles in opened:
            await roles.close()


@pytest.fixture(params=["local", "postgres-advisory"])
def backend(request: pytest.FixtureRequest) -> tuple[str, Any]:
    """The backend's name, and the PostgreSQL schema where it needs one (only there: a
    machine without PostgreSQL still runs the others)."""
    name = str(request.param)
    return name, request.getfixturevalue("pg") if name.startswith("postgres") else None


@pytest.fixture
async def rig(backend: tuple[str, Any]) -> AsyncIterator[Rig]:
    name, pg = backend
    async with local_rig() if name == "local" else advisory_rig(pg) as r:
        yield r


@asynccontextmanager
async def running(roles: Roles, name: str, factory: Factory) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(roles.run(name, factory))
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class TestRolesContract:
    async def test_run_runs_the_factory_while_holding_and_returns_what_it_returns(
            self, rig: Rig) -> None:
        roles = await rig.holder()
        held_inside: list[bool] = []

        async def work() -> None:
            held_inside.append(roles.holds("scan"))

        await asyncio.wait_for(roles.run("scan", work), TAKEOVER_S)
        assert held_inside == [True]

    async def test_a_crash_comes_out_of_run_and_the_role_can_be_taken_again(
            self, rig: Rig) -> None:
        first, second = await rig.holder(), await rig.holder()

        async def crash() -> None:
            raise ValueError("component crashed")

        with pytest.raises(ValueError, match="component crashed"):
            await asyncio.wait_for(first.run("scan", crash), TAKEOVER_S)
        component = Component()
        async with running(second, "scan", component.factory("second")):
            await asyncio.wait_for(component.started.wait(), TAKEOVER_S)
            assert second.holds("scan")

    async def test_holds_tells_the_truth_before_during_and_after(self, rig: Rig) -> None:
        roles = await rig.holder()
        component = Component()
        # An exclusive holder holds nothing it has not taken; a lone process holds all.
        assert roles.holds("scan") == (not rig.exclusive)
        async with running(roles, "scan", component.factory("a")):
            await asyncio.wait_for(component.started.wait(), TAKEOVER_S)
            assert roles.holds("scan")
        assert roles.holds("scan") == (not rig.exclusive)  # let go once run ended

    async def test_one_holder_at_a_time_and_the_role_moves_when_it_stops(
            self, rig: Rig) -> None:
        if not rig.exclusive:
            pytest.skip("one process holds every role")
        a, b = await rig.holder(), await rig.holder()
        component = Component()
        async with running(a, "scan", component.factory("a")) as first:
            await asyncio.wait_for(component.started.wait(), TAKEOVER_S)
            async with running(b, "scan", component.factory("b")) as second:
                # Several of b's polls go by: it does not run the role meanwhile.
                assert await still_waiting(second, 10 * POLL_S)
                assert (a.holds("scan"), b.holds("scan")) == (True, False)
                assert component.running == {"a"}
                # A role of another name is not held by the first: both run at once.
                other = Component()
                async with running(b, "redrive", other.factory("b")):
                    await asyncio.wait_for(other.started.wait(), TAKEOVER_S)
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
                assert not a.holds("scan")
                await eventually_running(component, "b")
                assert b.holds("scan")
        assert component.overlaps == 0

    async def test_a_holder_that_dies_lets_another_take_the_role(self, rig: Rig) -> None:
        if rig.kill is None:
            pytest.skip("one process holds every role")
        a, b = await rig.holder(), await rig.holder()
        component = Component()
        async with running(a, "scan", component.factory("a")) as first:
            await asyncio.wait_for(component.started.wait(), TAKEOVER_S)
            async with running(b, "scan", component.factory("b")) as second:
                assert await still_waiting(second, 10 * POLL_S)
                await rig.kill(a, "scan")
                # The dead holder's component stops (its run raises), and it holds nothing.
                with pytest.raises(rig.lost):
                    await asyncio.wait_for(first, TAKEOVER_S)
                assert not a.holds("scan")
                await eventually_running(component, "b")
                assert b.holds("scan")
        # No overlap count here: a terminated session frees its lock on the server before
        # its client hears of it, so the next holder may start a moment before the dead
        # one's component is cancelled. That window is what the ledger's fence (checked
        # before every request) is for; live holders never overlap (the test above).


async def eventually_running(component: Component, who: str) -> None:
    """``who``'s component runs within a takeover's bound (a few role polls)."""
    component.started.clear()
    if who not in component.running:
        await asyncio.wait_for(component.started.wait(), TAKEOVER_S)
    assert component.running == {who}
