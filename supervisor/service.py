"""The supervisor: hosts what the composition root (supervisor/composition.py) built,
serves HTTP, runs the components under one TaskGroup, restarts the ones that crash, and on
a signal drains them in the order they declared, then closes what start-up opened."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable

from aiohttp import web

from supervisor import metrics
from supervisor.composition import Assembly, assemble
from supervisor.config import Config
from supervisor.consumer import ConsumerPool
from supervisor.errors import (
    QueueBlocked,
    QueueError,
    StartupError,
    StorageError,
    TooManyCrashes,
)
from supervisor.http import create_app
from supervisor.lifecycle import Factory, Resources, drain

log = logging.getLogger(__name__)

# Each write after the drain (closing runs, the budget's memory) gets this long.
FINAL_WRITE_S = 3.0
# Closing everything after those writes (HTTP, partner, sinks, queue, ledger) gets this long.
CLOSE_TOTAL_S = 10.0


def max_stop_seconds(grace_s: float) -> float:
    """The longest a SIGTERM can take to exit: the drain's grace, the two final writes, the
    closing. A runtime's stop timeout (systemd, compose, podman/docker run) must exceed it,
    or the stop becomes a SIGKILL mid-drain."""
    return grace_s + 2 * FINAL_WRITE_S + CLOSE_TOTAL_S


class Service:
    """One process: HTTP, schedule, scan, outbox, consumer pool, monitor.

    :meth:`run` returns the process exit code once the service has drained. Call
    :meth:`request_stop` (signal handlers do) to begin the drain. Like uvicorn's
    ``Server``, a run is :meth:`startup`, :meth:`main_loop` and :meth:`shutdown`, over
    one :class:`~supervisor.lifecycle.Resources` (an ``AsyncExitStack``): whatever
    start-up opened is closed in reverse, however far it got.
    """

    def __init__(self, config: Config, resources: Resources | None = None) -> None:
        self.config = config
        # Events bind no loop until awaited (3.10+): safe to create here.
        self.stop_requested = asyncio.Event()
        self.started = asyncio.Event()
        self.fatal: BaseException | None = None
        self.url: str | None = None
        self.pool: ConsumerPool | None = None
        self.resources = resources or Resources()
        self._restarts: dict[str, deque[float]] = {}
        self._stopping = False
        self._storage_healthy: Callable[[], bool] = lambda: True

    def request_stop(self) -> None:
        self.stop_requested.set()

    async def run(self) -> int:
        """Start everything, serve until a stop is requested, drain, return the exit code.

        Raises StartupError when a component cannot start (port taken, data dir locked),
        having closed what had opened.
        """
        try:
            a = await self.startup()
            started_at = time.monotonic()
            await self.main_loop(a)
            await self._final_writes(a)
        finally:
            await self.shutdown()
        log.info("stopped after %.1fs: %d operations settled, %d workers, %d cut off at the "
                 "grace limit", time.monotonic() - started_at, a.pool.settled,
                 a.drained.get("workers", 0), a.drained.get("cut_off", 0),
                 extra={"action": "stopped"})
        return 1 if self.fatal is not None else 0

    async def startup(self) -> Assembly:
        c = self.config
        a = await assemble(c, self.resources)
        self.pool = a.pool
        self._storage_healthy = a.storage.storage_healthy
        await self._listen(a)
        log.info("listening on %s; %s; queue %s; %d workers at <= %g/s; %d leases "
                 "handed back", self.url, a.storage.describe, c.queue.backend,
                 c.limits.concurrency, c.limits.rate_per_second, a.storage.released,
                 extra={"action": "started"})
        return a

    async def _listen(self, a: Assembly) -> None:
        c = self.config
        # Every handler is answered by the time the runner is cleaned up (long-polls end at
        # the drain's start); the bound is for one that is not (a client reading slowly).
        runner = web.AppRunner(create_app(a.api), access_log=None, handle_signals=False,
                               shutdown_timeout=FINAL_WRITE_S)
        await self.resources.open("http", runner.setup)
        self.resources.closes("http", runner.cleanup)  # once set up: it cleans the app
        site = web.TCPSite(runner, c.service.host, c.service.port)
        try:
            await self.resources.open("listen", site.start)
        except OSError as exc:
            raise StartupError(f"cannot listen on {c.service.listen}: {exc.strerror}") from exc
        host, port = runner.addresses[0][0], runner.addresses[0][1]
        self.url = f"http://{host}:{port}"

    async def main_loop(self, a: Assembly) -> None:
        """Supervise every component until a stop is requested, then drain them group by
        group, in the order each component declared (supervisor/lifecycle.py)."""
        async with asyncio.TaskGroup() as tg:
            tasks = {x.name: tg.create_task(self._supervise(x.name, x.run), name=x.name)
                     for x in a.components if x.run is not None}
            self.started.set()
            await self.stop_requested.wait()
            self._stopping = True
            c = self.config
            log.info("stopping: triggers refused, intake stopped, draining %d workers "
                     "(grace %gs)", c.limits.concurrency, c.service.shutdown_grace_seconds,
                     extra={"action": "stopping"})
            await drain(a.components, tasks)

    async def _final_writes(self, a: Assembly) -> None:
        # Bounded: a database that does not answer must not hold the process past the
        # runtime's stop timeout (what is not written here, the next life finds).
        for write in a.final_writes:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(FINAL_WRITE_S):
                    await write()

    async def shutdown(self) -> None:
        """Close what start-up opened, in reverse (HTTP, ticks, sinks, partner, budget,
        queue, the ledger last: it flushes pending writes), all within one bound: what is
        not closed by then, the process's exit closes."""
        await self.resources.aclose(within=CLOSE_TOTAL_S)

    async def _supervise(self, name: str, factory: Factory) -> None:
        """Run a component; restart it with backoff when it crashes.

        Too many crashes within ``restart_window_seconds`` stop the whole service with a
        non-zero exit, so the container's restart policy takes over.
        """
        s = self.config.service
        backoff = RestartBackoff(s.restart_backoff_seconds, s.restart_backoff_max_seconds,
                                 healthy_after_s=s.restart_window_seconds)
        crashes = self._restarts.setdefault(name, deque())
        while True:
            began = time.monotonic()
            try:
                await factory()
                if self._stopping:
                    return
                raise RuntimeError(f"component {name} returned unexpectedly")
            except asyncio.CancelledError:
                raise
            except (StorageError, QueueError) as exc:
                # The ledger cannot commit (disk full, locked, read-only), or the queue
                # transport refuses or fails us. Not the component's fault: wait for the
                # fault to clear without escalating.
                if self._stopping:
                    return
                # A failed commit was said once already ("ledger cannot commit"), a
                # refusing transport too: each component waiting on it is a detail.
                reported = not self._storage_healthy() or isinstance(exc, QueueBlocked)
                log.log(logging.DEBUG if reported else logging.WARNING,
                        "component %s paused: %s", name, exc,
                        extra={"action": "component_storage_wait"})
            except Exception as exc:
                if self._stopping:
                    return
                now = time.monotonic()
                crashes.append(now)
                while crashes and crashes[0] < now - s.restart_window_seconds:
                    crashes.popleft()
                metrics.COMPONENT_RESTARTS.labels(name).inc()
                log.error("component %s crashed (%d in %gs): %r", name, len(crashes),
                          s.restart_window_seconds, exc, exc_info=exc,
                          extra={"action": "component_crash"})
                if len(crashes) > s.max_restarts:
                    self.fatal = TooManyCrashes(f"{name} crashed {len(crashes)} times")
                    log.critical("component %s keeps crashing; stopping the service", name,
                                 extra={"action": "escalate"})
                    self.request_stop()
                    return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff.delay(time.monotonic() - began)):
                    await self.stop_requested.wait()
            if self.stop_requested.is_set():
                return


class RestartBackoff:
    """Doubling waits between restarts, from ``first`` up to ``cap``; a component that ran
    healthy for ``healthy_after_s`` before failing starts again from ``first``: one fault
    a week must not wait the cap because of last week's."""

    def __init__(self, first: float, cap: float, healthy_after_s: float) -> None:
        self.first = first
        self.cap = cap
        self.healthy_after_s = healthy_after_s
        self._next = first

    def delay(self, ran_for_s: float) -> float:
        """The wait before the next start, given how long the last start ran."""
        if ran_for_s >= self.healthy_after_s:
            self._next = self.first
        wait = self._next
        self._next = min(self._next * 2, self.cap)
        return wait


def install_signal_handlers(service: Service) -> Callable[[], None]:
    """SIGTERM/SIGINT begin the drain; a second one exits at once. Returns an undo."""
    loop = asyncio.get_running_loop()
    count = 0

    def handle(signum: int) -> None:
        nonlocal count
        count += 1
        if count == 1:
            log.info("received %s; draining (send again to exit at once)",
                     signal.Signals(signum).name, extra={"action": "signal"})
            service.request_stop()
        else:
            # Everything committed is already durable in the ledger; what was not
            # committed is redelivered from the queue after restart.
            log.warning("second %s: exiting now", signal.Signals(signum).name,
                        extra={"action": "signal_forced"})
            logging.shutdown()
            os._exit(1)

    signals = (signal.SIGTERM, signal.SIGINT)
    # What was there before (Python's KeyboardInterrupt for SIGINT, a test runner's or an
    # embedding program's handler): the loop's removal would leave the default instead.
    previous = {sig: signal.getsignal(sig) for sig in signals}
    for sig in signals:
        loop.add_signal_handler(sig, handle, sig)

    def undo() -> None:
        for sig in signals:
            loop.remove_signal_handler(sig)
            before = previous[sig]
            if before is not None:  # None: set outside Python; nothing to restore to
                signal.signal(sig, before)

    return undo
