"""The producer: pages each scanning run's candidate source into operations, and the
outbox publisher that hands discovered operations to the queue.

The two are separate on purpose: a page's operations and its cursor commit in one ledger
transaction, and only then are messages published. A crash between the two leaves
``discovered`` operations that the publisher finds and publishes on restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from supervisor import metrics
from supervisor.config import Config
from supervisor.errors import ScanConflict, SourceError
from supervisor.ledger.base import Ledger
from supervisor.model import Run
from supervisor.queue.base import Queue
from supervisor.queue.courier import Courier
from supervisor.sources import CandidateSource, source_for
from supervisor.states import RunState

log = logging.getLogger(__name__)

PUBLISH_BATCH = 500
SCAN_POLL_S = 5.0


class Scanner:
    """Scans every run in state ``scanning``, oldest first; sleeps until :meth:`wake`."""

    def __init__(self, config: Config, ledger: Ledger, wakeup: asyncio.Event,
                 on_page: asyncio.Event) -> None:
        self.config = config
        self.ledger = ledger
        self._wakeup = wakeup  # set when a run is opened
        self._on_page = on_page  # we set it when a page is committed
        self._session: aiohttp.ClientSession | None = None

    async def run(self) -> None:
        self._session = aiohttp.ClientSession()
        try:
            while True:
                self._wakeup.clear()
                for run in await self.ledger.runs_to_scan():
                    await self._scan(run)
                # The timeout is the fallback for a run another replica opened while
                # this one's LISTEN connection was down (a notification lost).
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(SCAN_POLL_S):
                        await self._wakeup.wait()
        finally:
            await self._session.close()

    def _source(self, run: Run) -> CandidateSource:
        assert self._session is not None  # opened by run(), before any scan
        try:
            return source_for(run.source, self.config.source, self._session)
        except SourceError as exc:
            raise SourceError(f"run {run.id}: {exc}") from None

    async def _scan(self, run: Run) -> None:
        c = self.config.source
        source = self._source(run)
        cursor = run.scan_cursor
        failures = 0
        log.info("scan of %s %s", run.id, "resumed" if cursor else "started",
                 extra={"run_id": run.id, "action": "scan_start"})
        while True:
            try:
                page = await source.page(cursor, c.page_size)
            except SourceError as exc:
                failures += 1
                metrics.SCAN_FAILURES.inc()
                give_up = failures > c.max_page_retries
                log.warning("scan of %s failed at cursor %r (%d/%d): %s", run.id, cursor,
                            failures, c.max_page_retries + 1, exc,
                            extra={"run_id": run.id, "action": "scan_failure"})
                await self.ledger.record_scan_failure(run.id, str(exc), give_up)
                if give_up:
                    return
                await asyncio.sleep(min(60.0, 0.5 * 2 ** failures))  # backoff, not sync
                continue
            failures = 0
            for reason, n in page.skipped.items():
                metrics.SCAN_SKIPPED.labels(reason).inc(n)
            try:
                result = await self.ledger.record_page(run.id, page.ids, page.next_cursor,
                                                       page.skipped.total(), resumed_from=cursor)
            except ScanConflict as exc:
                # Another replica took the scan over and moved on: this page is its now.
                log.warning("%s; leaving the scan to it", exc,
                            extra={"run_id": run.id, "action": "scan_conflict"})
                return
            self._on_page.set()
            cursor = page.next_cursor
            if result.run_state is not RunState.SCANNING:
                log.info("scan of %s finished", run.id,
                         extra={"run_id": run.id, "action": "scan_done"})
                return


class Publisher:
    """The outbox: publishes ``discovered`` operations and marks them ``queued``."""

    def __init__(self, ledger: Ledger, queue: Queue, wakeup: asyncio.Event) -> None:
        self.ledger = ledger
        self.courier = Courier(ledger, queue)
        self._wakeup = wakeup

    async def run(self) -> None:
        while True:
            self._wakeup.clear()
            while batch := await self.ledger.unpublished(PUBLISH_BATCH):
                await self.courier.publish(batch, outbox=True)
            with contextlib.suppress(TimeoutError):
                # The timeout is a safety net for writes made by another process.
                async with asyncio.timeout(SCAN_POLL_S):
                    await self._wakeup.wait()
