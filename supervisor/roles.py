"""Singleton roles (the scan, the outbox publisher, redrive, reconcile, the run monitor,
each events sink): the protocol, and the one-process holder of every role. The replicas'
holder, a session advisory lock each, is ``postgres.replicas.AdvisoryRoles``."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from supervisor import metrics

Factory = Callable[[], Coroutine[Any, Any, None]]


class Roles(Protocol):
    async def run(self, name: str, factory: Factory) -> None:
        """Run ``factory`` while this process holds role ``name``; wait for it otherwise.
        Returns or raises what the factory does; the role is let go either way."""

    def holds(self, name: str) -> bool: ...



class LocalRoles:
    """One process: it holds every role."""

    async def run(self, name: str, factory: Factory) -> None:
        metrics.ROLE_HELD.labels(name).set(1)
        await factory()

    def holds(self, name: str) -> bool:
        return True
