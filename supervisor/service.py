"""The supervisor: builds the components, runs them under one TaskGroup, restarts the ones
that crash, reports readiness, and drains in a fixed order on a signal."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from supervisor import metrics
from supervisor.backends import Backends, open_backends
from supervisor.config import Config
from supervisor.consumer import ConsumerPool
from supervisor.errors import (
    QueueBlocked,
    QueueError,
    StartupError,
    StorageError,
    TooManyCrashes,
)
from supervisor.events.relay import EventRelay
from supervisor.http import ApiState, create_app
from supervisor.infrai.push import push_settings
from supervisor.monitor import Monitor
from supervisor.partner import PartnerClient
from supervisor.push import PushedQueue, PushEntry, PushReceiver
from supervisor.queue.base import Queue
from supervisor.queue.infrai import InfraiQueue
from supervisor.reconcile import Reconciler
from supervisor.redrive import Redriver
from supervisor.runs import RunOpener, RunWatch
from supervisor.scan import Publisher, Scanner
from supervisor.schedule import Scheduler
from supervisor.ticks import TickPuller

log = logging.getLogger(__name__)

Factory = Callable[[], Coroutine[Any, Any, None]]
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
    :meth:`request_stop` (signal handlers do) to begin the drain.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        # Events bind no loop until awaited (3.10+): safe to create here.
        self.stop_requested = asyncio.Event()
        self.started = asyncio.Event()
        self.fatal: BaseException | None = None
        self.url: str | None = None
        self.pool: ConsumerPool | None = None
        self._restarts: dict[str, deque[float]] = {}
        self._stopping = False
        self._backends: Backends | None = None

    def request_stop(self) -> None:
        self.stop_requested.set()

    async def run(self) -> int:
        """Start everything, serve until a stop is requested, drain, return the exit code.

        Raises StartupError when a component cannot start (port taken, data dir locked).
        """
        c = self.config
        backends = self._backends = await open_backends(c)
        ledger, queue, budget, roles = (backends.ledger, backends.queue, backends.budget,
                                        backends.roles)
        partner = PartnerClient(c.partner, c.limits.concurrency)
        await partner.start()
        runs_changed = RunWatch()
        scan_wakeup = backends.wakeups["runs"]
        publish_wakeup = backends.wakeups["outbox"]
        monitor = Monitor(ledger, queue, budget, runs_changed, c.schedule.digest_cutoff_seconds,
                          finishes=lambda: roles.holds("monitor"),
                          settled=backends.wakeups["finished"],
                          finish_every_s=backends.finish_every_s,
                          readiness=lambda: ready())  # below: it reads the pool
        scanner = Scanner(c, ledger, scan_wakeup, publish_wakeup)
        publisher = Publisher(ledger, queue, publish_wakeup)
        opener = RunOpener(c, ledger, scan_wakeup)
        reconciler = Reconciler(c.partner, ledger, queue, budget, partner)
        relay = EventRelay(c.events, c.infrai, ledger)

        def settled() -> None:
            monitor.settled.set()
            relay.notify()  # the events just written go out now, not at the next poll

        # Pushed: the pool works what Infrai POSTs to /v1/push/{queue}, answering instead
        # of acking; its fetcher finds nothing to pull. Everything else publishes to Infrai.
        pushed = push_settings(c.infrai) if c.infrai.delivery == "push" else None
        pushed_queue = (None if pushed is None else
                        PushedQueue(pushed.visibility_timeout_s, pushed.max_wait_s))
        pool_queue: Queue = queue if pushed_queue is None else pushed_queue
        pool = self.pool = ConsumerPool(c, ledger, pool_queue, budget, partner,
                                        on_settled=settled)
        push = None if pushed is None or pushed_queue is None else \
            PushReceiver(pushed, {c.infrai.queue: PushEntry(pool, pushed_queue)})
        redriver = Redriver(c.queue, ledger, queue, horizon=pool.redrive_horizon)

        def ready() -> tuple[bool, dict[str, bool]]:
            checks = {"ledger": backends.storage_healthy(), "queue": queue.healthy,
                      "workers": pool.running, "accepting": api.accepting}
            ok = all(checks.values())
            metrics.READY.set(1 if ok else 0)
            return ok, checks

        api = ApiState(config=c, ledger=ledger, opener=opener, reconciler=reconciler, ready=ready,
                       runs_changed=runs_changed, current_rate=lambda: budget.snapshot().rate,
                       projected_finish=lambda n, now: budget.snapshot().projected_finish(n, now),
                       ledger_stats=lambda: monitor.last_stats,
                       push=push, budget=budget)
        # Every handler is answered by the time the runner is cleaned up (long-polls end at
        # the drain's start); the bound is for one that is not (a client reading slowly).
        runner = web.AppRunner(create_app(api), access_log=None, handle_signals=False,
                               shutdown_timeout=FINAL_WRITE_S)
        await runner.setup()
        try:
            site = web.TCPSite(runner, c.service.host, c.service.port)
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            await partner.close()
            await backends.close()
            raise StartupError(f"cannot listen on {c.service.listen}: {exc.strerror}") from exc
        sockets = runner.addresses
        host, port = sockets[0][0], sockets[0][1]
        self.url = f"http://{host}:{port}"
        log.info("listening on %s; %s; queue %s; %d workers at <= %g/s; %d leases "
                 "handed back", self.url, backends.describe, c.queue.backend,
                 c.limits.concurrency, c.limits.rate_per_second, backends.released,
                 extra={"action": "started"})

        def singleton(name: str, factory: Factory) -> Factory:
            # With replicas, one of them at a time runs it; alone, this process does.
            return lambda: roles.run(name, factory)

        components: list[tuple[str, Factory]] = [
            ("monitor", monitor.run),
            ("finisher", singleton("monitor", _forever)),
            ("publisher", singleton("publisher", publisher.run)),
            ("scan", singleton("scan", scanner.run)),
            ("consumers", pool.run),
            ("redrive", singleton("redrive", redriver.run)),
        ]
        components += backends.components
        if backends.membership is not None:
            components.append(("heartbeat", backends.membership.run))
        # One component per events sink (a sink that is down delays only itself) and one
        # for their lag gauges and the outbox's retention.
        await relay.start()
        components += [(name, singleton(name, factory)) for name, factory in relay.components()]
        if c.partner.probe_path:
            components.append(("reconcile", singleton("reconcile", reconciler.run)))
        if c.schedule.cron is not None and c.schedule.clock == "embedded":
            components.append(("schedule", Scheduler(c.schedule, opener).run))
        tick_queue: InfraiQueue | None = None
        if c.infrai.tick_queue:
            tick_queue = InfraiQueue(dataclasses.replace(
                c.infrai, queue=c.infrai.tick_queue, dead_letter_queue=""))
            await tick_queue.start()
            components.append(("ticks", TickPuller(tick_queue, opener, c.schedule.name,
                                                   c.infrai.tick_poll_seconds).run))
        intake = {"publisher", "scan", "schedule", "redrive", "reconcile", "ticks"}
        summary: dict[str, int] = {}
        started_at = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            tasks = {name: tg.create_task(self._supervise(name, factory), name=name)
                     for name, factory in components}
            self.started.set()
            await self.stop_requested.wait()
            self._stopping = True
            log.info("stopping: triggers refused, intake stopped, draining %d workers "
                     "(grace %gs)", c.limits.concurrency, c.service.shutdown_grace_seconds,
                     extra={"action": "stopping"})
            # 1. stop intake: no new runs, no scanning, no publishing
            api.accepting = False
            runs_changed.notify()  # long-polls answer now, not at their timeout
            for name in intake & tasks.keys():
                tasks[name].cancel()
            # 2. let requests in the air finish within the grace; hand back every lease
            summary = await pool.stop(c.service.shutdown_grace_seconds)
            tasks["consumers"].cancel()
            # 3. the monitor last, after a final pass so closed runs are recorded
            for name in ("monitor", "finisher", "heartbeat", *(n for n, _ in backends.components)):
                if name in tasks:
                    tasks[name].cancel()
            for name in relay.names:  # undelivered events wait in the outbox for the next life
                tasks[name].cancel()
        # Bounded: a database that does not answer must not hold the process past the
        # runtime's stop timeout (what is not written here, the next life finds).
        with contextlib.suppress(Exception):
            async with asyncio.timeout(FINAL_WRITE_S):
                await ledger.finish_runs()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(FINAL_WRITE_S):
                await budget.save()  # a pause in force, a limit learnt: the next life starts there
        # 4. close outward connections, then the ledger (it flushes pending writes), all
        # within one bound: what is not closed by then, the process's exit closes (and the
        # next life finds what was not written).
        try:
            async with asyncio.timeout(CLOSE_TOTAL_S):
                await runner.cleanup()
                await partner.close()
                await relay.close()
                if tick_queue is not None:
                    await tick_queue.close()
                await backends.close()
        except TimeoutError:
            log.warning("closing took over %gs; exiting with the rest unclosed", CLOSE_TOTAL_S,
                        extra={"action": "close_timeout"})
        log.info("stopped after %.1fs: %d operations settled, %d workers, %d cut off at the "
                 "grace limit", time.monotonic() - started_at, pool.settled,
                 summary.get("workers", 0), summary.get("cut_off", 0),
                 extra={"action": "stopped"})
        if self.fatal is not None:
            return 1
        return 0

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
                reported = (self._backends is not None
                            and not self._backends.storage_healthy()) or \
                    isinstance(exc, QueueBlocked)
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


async def _forever() -> None:
    """A role held for its own sake (the monitor's run finishing asks who holds it)."""
    await asyncio.Event().wait()


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
