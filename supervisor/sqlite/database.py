"""One SQLite file in WAL mode: a single writer with group commit, and a reader.

Every write is a small coroutine run by the writer task. The writer takes whatever writes
are waiting, runs them in one transaction and commits once, so a hundred workers settling
at the same moment cost one fsync. A write that raises is rolled back to its own savepoint
and only its caller sees the error; a commit that fails fails every write in the batch and
marks the database unhealthy until a later commit succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite

from supervisor.errors import StorageError
from supervisor.sqlite import sql

log = logging.getLogger(__name__)

T = TypeVar("T")
Write = tuple[Callable[[aiosqlite.Connection], Awaitable[Any]], bool]

MAX_BATCH = 512


class Database:
    """Owns the SQLite connections. ``open()`` connects and starts the writer task."""

    def __init__(self, path: Path, recover_after_s: float = 0.0) -> None:
        self.path = path
        # After a failed commit the ledger counts as healthy again only at a commit this
        # long after the last failure: a nearly full disk lets small commits through
        # between failing ones, and readiness (and the one log line) must not flap.
        self.recover_after_s = recover_after_s
        self._failed_at = 0.0
        self._writer: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        # The API's long listings (exclusions pages and streams, operation pages) read on
        # a connection (and a thread) of their own: the consumer's reads never queue
        # behind a thousand-row page.
        self._lister: aiosqlite.Connection | None = None
        self._pending: asyncio.Queue[tuple[Write, asyncio.Future[Any]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.healthy = False
        self.last_error: str | None = None
        self.commits = 0
        self.reads = 0  # statements run on the reader: what a read path costs, in tests too
        self._corrupt = False
        # Why the writer task ended, while it is down: writes fail at once instead of
        # waiting in a queue nobody serves; :meth:`watch` starts a new writer.
        self._writer_died: BaseException | None = None
        self._writer_ended = asyncio.Event()
        self._closing = False

    async def open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            writer = await self._connect()
            await writer.executescript(sql.SCHEMA)
            await self._migrate(writer)
        except (OSError, sqlite3.Error) as exc:
            await self.close()
            raise StorageError(f"cannot open ledger {self.path}: {exc}") from exc
        self.healthy = True
        self._closing = False
        self._start_writer()

    def _start_writer(self) -> None:
        self._writer_died = None
        self._writer_ended.clear()
        self._task = asyncio.create_task(self._write_loop(), name="ledger-writer")
        self._task.add_done_callback(self._on_writer_end)

    def _on_writer_end(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            # close() cancels it after the last write; anything queued since fails.
            self._fail_pending(StorageError("ledger is closed"))
            return
        exc = task.exception()
        if exc is None:
            exc = RuntimeError("ledger writer returned")
        self._writer_died = exc
        self._mark_unhealthy(exc)
        # Its transaction may still be open on the writer connection: the next writer
        # starts on fresh connections (closing the old one rolls it back).
        self._corrupt = True
        # Nobody serves the queue now: every write waiting in it fails instead of hanging.
        self._fail_pending(StorageError(f"ledger writer stopped: {exc!r}"))
        self._writer_ended.set()

    def _fail_pending(self, error: StorageError) -> None:
        while not self._pending.empty():
            _, fut = self._pending.get_nowait()
            self._pending.task_done()
            if not fut.done():
                fut.set_exception(error)

    async def watch(self) -> None:
        """The writer as a supervised component: returns never; when the writer task dies
        it starts a new one and raises, so the supervisor counts the crash (and stops the
        service when it keeps crashing) like any other component's."""
        while True:
            await self._writer_ended.wait()
            exc = self._writer_died
            if self._task is None or exc is None or self._closing:  # closed meanwhile
                self._writer_ended.clear()
                continue
            self._start_writer()
            raise RuntimeError(f"ledger writer crashed and was restarted: {exc!r}") from exc

    @staticmethod
    async def _migrate(conn: aiosqlite.Connection) -> None:
        """Add the columns a ledger file written by an earlier release lacks."""
        added: set[str] = set()
        for table, column, decl in sql.ADDED_COLUMNS:
            rows = await conn.execute_fetchall(f"PRAGMA table_info({table})")
            if column not in {r[1] for r in rows}:
                await conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
                added.add(table)
        if "operations" in added:
            await conn.execute(sql.BACKFILL_DUE)
        if "runs" in added:
            await conn.execute(sql.BACKFILL_SOURCE_KIND)
        await conn.execute(sql.ACTIVE_INDEX)
        await conn.execute(sql.BATCH_INDEX)

    async def _connect(self) -> aiosqlite.Connection:
        """Connect the writer, the reader and the lister; returns the writer."""
        # aiosqlite stops its worker thread on a failed connect without waiting for it, and
        # the thread's last answer can then land on a loop that has closed (a traceback at
        # exit, after a clean start-up failure): open the file once first, with no worker.
        await asyncio.to_thread(_try_open, self.path)
        self._writer = await aiosqlite.connect(self.path, isolation_level=None)
        for pragma in sql.PRAGMAS:
            await self._writer.execute(pragma)
        self._reader = await aiosqlite.connect(self.path, isolation_level=None)
        await self._reader.execute("PRAGMA busy_timeout=5000")
        self._lister = await aiosqlite.connect(self.path, isolation_level=None)
        await self._lister.execute("PRAGMA busy_timeout=5000")
        return self._writer

    async def _reconnect(self) -> None:
        """Fresh connections after a corrupt-page error: the old ones may keep the bad page
        in their cache after the file was repaired underneath them."""
        for conn in (self._lister, self._reader, self._writer):
            if conn is not None:
                with contextlib.suppress(sqlite3.Error, ValueError):
                    await conn.close()
        self._lister = self._reader = self._writer = None
        try:
            await self._connect()
        except sqlite3.Error as exc:
            self._mark_unhealthy(exc)

    async def close(self) -> None:
        """Finish every queued write, then close. Safe to call twice; a write asked for
        meanwhile fails at once, and a writer that died is not waited for."""
        self._closing = True
        task, self._task = self._task, None
        try:
            if task is not None:
                if not task.done():
                    await self._pending.join()
                    task.cancel()
                    await asyncio.wait([task])
                elif not task.cancelled():
                    task.exception()  # retrieved: the death was reported when it happened
                self._fail_pending(StorageError("ledger is closed"))
        finally:
            for conn in (self._lister, self._reader, self._writer):
                if conn is not None:
                    with contextlib.suppress(sqlite3.Error, ValueError):
                        await conn.close()
            self._lister = self._reader = self._writer = None

    async def write(self, fn: Callable[[aiosqlite.Connection], Awaitable[T]],
                    savepoint: bool = True) -> T:
        """Run ``fn`` inside the next group commit; return its result once committed.

        If ``fn`` raises, what it wrote is rolled back to a savepoint and only this caller
        sees the error. ``savepoint=False`` skips the savepoint (two statements fewer) for a
        write that can only raise before it has written anything.

        The write is queued before this coroutine first suspends, so cancelling the caller
        does not tear it: it commits (or fails) with its batch all the same.
        """
        if self._task is None or self._closing:
            raise StorageError("ledger is not open" if self._task is None else "ledger is closing")
        if self._writer_died is not None:
            raise StorageError(f"ledger writer stopped: {self._writer_died!r}")
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending.put_nowait(((fn, savepoint), fut))
        return await asyncio.shield(fut)

    async def read(self, query: str, params: Any = (), listing: bool = False,
                   ) -> list[sqlite3.Row]:
        """``listing``: a long listing for the API, read on its own connection."""
        conn = self._lister if listing else self._reader
        if conn is None:
            raise StorageError("ledger is not open")
        self.reads += 1
        try:
            # One round trip to the reader's thread, not three (execute, fetch, close).
            return list(await conn.execute_fetchall(query, params))
        except (sqlite3.Error, ValueError) as exc:  # ValueError: reconnecting meanwhile
            raise StorageError(f"ledger read failed: {exc}") from exc

    async def read_one(self, query: str, params: Any = ()) -> sqlite3.Row | None:
        rows = await self.read(query, params)
        return rows[0] if rows else None

    async def _write_loop(self) -> None:
        while True:
            batch = [await self._pending.get()]
            while len(batch) < MAX_BATCH and not self._pending.empty():
                batch.append(self._pending.get_nowait())
            try:
                if self._corrupt or self._writer is None:
                    self._corrupt = False
                    await self._reconnect()
                if self._writer is None:
                    self._fail(batch, StorageError(f"ledger {self.path} cannot be opened"))
                    continue
                await self._commit(self._writer, batch)
            except BaseException as exc:
                # A fault outside the commit's own handling (or a cancellation): the
                # batch's callers learn now rather than wait on futures nobody will set.
                self._fail(batch, StorageError(f"ledger writer stopped: {exc!r}"))
                raise
            finally:
                for _ in batch:
                    self._pending.task_done()

    async def _commit(self, conn: aiosqlite.Connection,
                      batch: list[tuple[Write, asyncio.Future[Any]]]) -> None:
        results: list[tuple[bool, Any]] = []
        try:
            await conn.execute("BEGIN IMMEDIATE")
            for (fn, savepoint), _ in batch:
                if savepoint:
                    await conn.execute("SAVEPOINT w")
                try:
                    results.append((True, await fn(conn)))
                except sqlite3.IntegrityError as exc:
                    # A constraint the write broke (foreign key, unique, not null) is the
                    # caller's error, not the storage's: it must not fail the batch or
                    # mark the ledger unhealthy. The failed statement undid itself.
                    if savepoint:
                        await conn.execute("ROLLBACK TO w")
                    results.append((False, exc))
                except (sqlite3.OperationalError, sqlite3.DatabaseError):
                    raise  # storage trouble: the whole batch fails below
                except Exception as exc:  # the caller's own error: only its write undone
                    if savepoint:
                        await conn.execute("ROLLBACK TO w")
                    results.append((False, exc))
                if savepoint:
                    await conn.execute("RELEASE w")
            await conn.execute("COMMIT")
        except (sqlite3.Error, ValueError) as exc:  # ValueError: the connection is gone
            with contextlib.suppress(sqlite3.Error, ValueError):
                await conn.execute("ROLLBACK")
            self._mark_unhealthy(exc)
            # Locked, full or read-only clears by itself; a malformed page is only repaired
            # from outside, and then only fresh connections see the repair.
            self._corrupt = isinstance(exc, sqlite3.DatabaseError) and \
                not isinstance(exc, sqlite3.OperationalError)
            self._fail(batch, StorageError(f"ledger commit failed: {exc}"))
            return
        self.commits += 1
        if not self.healthy and time.monotonic() - self._failed_at >= self.recover_after_s:
            log.warning("ledger writable again", extra={"action": "ledger_recovered"})
            self.healthy = True
            self.last_error = None
        for (ok, value), (_, fut) in zip(results, batch, strict=True):
            if fut.done():
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

    @staticmethod
    def _fail(batch: list[tuple[Write, asyncio.Future[Any]]], error: StorageError) -> None:
        for _, fut in batch:
            if not fut.done():
                fut.set_exception(error)

    def _mark_unhealthy(self, exc: BaseException) -> None:
        self._failed_at = time.monotonic()
        if self.healthy:
            # One clear line per fault, not one per failed write.
            log.error("ledger cannot commit: %s (%s); operations stay unacked until it can",
                      exc, self.path, extra={"action": "ledger_unhealthy"})
        self.healthy = False
        self.last_error = str(exc)


def _try_open(path: Path) -> None:
    sqlite3.connect(path).close()
