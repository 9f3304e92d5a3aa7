"""What the service's start-up, main loop and shutdown are made of: the components it
supervises, each declaring when it stops in the drain, and the resources start-up opened,
closed in reverse.

A component is a long-lived coroutine the supervisor restarts when it crashes. Its
:class:`Drain` group says when the drain cancels it: intake first (nothing new comes in),
then the work in hand (given the grace to finish), then what must outlive both (the
monitor that records closed runs, the ledger's writer, the events relay, the heartbeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

Factory = Callable[[], Coroutine[Any, Any, None]]
Closer = Callable[[], Awaitable[None]]
T = TypeVar("T")

# One closer gets this long: a database that does not answer must not hold the others.
CLOSE_S = 5.0


class Drain(enum.IntEnum):
    """When a component stops, in the order of the values."""

    INTAKE = 1  # triggers, scanning, publishing, redrive, reconciliation, ticks
    WORK = 2  # the consumer pool: its stop hook waits out the grace
    LAST = 3  # the monitor, the ledger's writer, the events relay, the heartbeat


@dataclass(frozen=True)
class Component:
    name: str
    # None: nothing to supervise, only a part in the drain (the API refusing triggers).
    run: Factory | None
    drain: Drain
    # Awaited when the drain reaches this component's group, before it is cancelled.
    stop: Closer | None = None
    # With replicas, one of them at a time runs it, holding this role; None: every
    # replica runs it.
    role: str | None = None


async def drain(components: Sequence[Component],
                tasks: Mapping[str, asyncio.Task[None]]) -> None:
    """Stop the components group by group, in :class:`Drain` order: each group's stop
    hooks are awaited together, then its tasks are cancelled, before the next group."""
    for group in Drain:
        members = [x for x in components if x.drain is group]
        await asyncio.gather(*(x.stop() for x in members if x.stop is not None))
        for x in members:
            if x.name in tasks:
                tasks[x.name].cancel()


class Resources:
    """What start-up opened, in one :class:`contextlib.AsyncExitStack`: each resource's
    closer is entered as it is opened, so a failure half-way through start-up closes what
    was opened before it, in reverse, and so does the shutdown.

    Each closer is bounded by ``CLOSE_S`` and all of them together by the ``within`` of
    :meth:`aclose`: what is not closed by then, the process's exit closes. :meth:`starting`
    is called before each step; it is the seam a test uses to make a step fail.
    """

    def __init__(self) -> None:
        self._stack = contextlib.AsyncExitStack()
        self._deadline: float | None = None
        self.steps: list[str] = []

    async def starting(self, step: str) -> None:
        """Called before each start-up step opens anything."""
        self.steps.append(step)

    async def open(self, step: str, opener: Callable[[], Awaitable[T]],
                   closer: Closer | None = None) -> T:
        """Run ``opener``, with ``closer`` entered first: a resource that fails half-way
        through opening is closed too (every closer here is safe on one never opened)."""
        await self.starting(step)
        if closer is not None:
            self.closes(step, closer)
        return await opener()

    def closes(self, name: str, closer: Closer) -> None:
        self._stack.push_async_callback(self._close, name, closer)

    async def _close(self, name: str, closer: Closer) -> None:
        bound = CLOSE_S
        if self._deadline is not None:
            bound = min(bound, self._deadline - asyncio.get_running_loop().time())
            if bound <= 0:
                log.warning("closing took too long; %s left unclosed", name,
                            extra={"action": "close_timeout"})
                return
        try:
            async with asyncio.timeout(bound):
                await closer()
        except TimeoutError:
            log.warning("closing %s took over %.1fs; left to the process's exit", name, bound,
                        extra={"action": "close_timeout"})
        except Exception as exc:  # the rest must still close; the next life copes
            log.warning("closing %s failed: %r", name, exc, extra={"action": "close_failed"})

    async def aclose(self, within: float) -> None:
        """Close everything, in reverse, within ``within`` seconds all told."""
        self._deadline = asyncio.get_running_loop().time() + within
        try:
            await self._stack.aclose()
        finally:
            self._deadline = None
