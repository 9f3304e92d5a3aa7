"""Plain helpers every suite shares; the fixtures built on them live in the conftest files.

One copy of each: a free loopback port, polling with a deadline, the Infrai emulator and a
service configuration pointed at it, message and run builders, the SQLite ledger's writer
held, PostgreSQL's admin session and advisory-lock holder, and Prometheus text read by
``prometheus_client``'s own parser.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from cleanup_sandbox.infrai import Emulator, EmulatorConfig, start_emulator
from supervisor.configtypes import Secret
from supervisor.infrai.settings import InfraiConfig
from supervisor.model import Message, Run, Settlement
from supervisor.postgres import connect as pgnames
from supervisor.queue.courier import Courier
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue
from supervisor.states import OpState

# The API key of every in-process emulator the tests start.
EMU_KEY = "ifr_test_key"
INLINE = {"kind": "inline"}


def free_port() -> int:
    """A loopback port nothing listens on now (for a process that must be told its port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def eventually(probe: Callable[[], Any], within_s: float = 15.0,
                     what: str = "condition", every_s: float = 0.02,
                     ignoring: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll ``probe`` (plain or async) until it answers something other than None or False,
    and return that. For effects with no event to await (another session's write, a gauge
    refreshed on a timer): the deadline bounds the wait. Exceptions in ``ignoring`` count
    as "not yet" (a server not listening yet)."""
    deadline = time.monotonic() + within_s
    last: BaseException | None = None
    while True:
        try:
            found = probe()
            if inspect.isawaitable(found):
                found = await found
        except ignoring as exc:
            found, last = None, exc
        if found is not None and found is not False:
            return found
        if time.monotonic() >= deadline:
            detail = f" (last error: {last})" if last is not None else ""
            raise AssertionError(f"timed out waiting for {what}: not within {within_s}s{detail}")
        await asyncio.sleep(every_s)


async def still_waiting(task: asyncio.Future[Any], for_s: float) -> bool:
    """True when ``task`` has not finished within ``for_s``: an assertion that something
    blocks (nothing else can show it), not a synchronisation."""
    done, _ = await asyncio.wait({task}, timeout=for_s)
    return not done


# -- the Infrai emulator, in process ---------------------------------------------------------


@asynccontextmanager
async def running_emulator(**overrides: Any) -> AsyncIterator[Emulator]:
    """An Infrai emulator on a loopback port, accepting :data:`EMU_KEY`."""
    emu = await start_emulator(EmulatorConfig(**{"api_key": EMU_KEY, **overrides}))
    try:
        yield emu
    finally:
        await emu.close()


def infrai_config(emulator: Emulator, **overrides: Any) -> InfraiConfig:
    """The service's Infrai settings pointed at ``emulator``, with backoffs short enough
    for a test."""
    base: dict[str, Any] = {"base_url": emulator.url, "token": Secret(EMU_KEY),
                            "backoff_initial_seconds": 0.01, "backoff_max_seconds": 0.05}
    return InfraiConfig(**{**base, **overrides})


# -- records ---------------------------------------------------------------------------------


def msg(i: int, run: str = "run_1", recipient: str | None = None) -> Message:
    return Message(run_id=run, operation_id=f"op_{i}", recipient_id=recipient or f"r-{i}")


async def open_run(ledger: Any, tick: str = "weekly@1", ids: list[str] | None = None,
                   **kw: Any) -> Run:
    """A run opened on ``ledger`` (any LedgerStore) for ``tick``; with ``ids``, their page
    recorded (operations discovered)."""
    kw.setdefault("skip_if_unfinished", False)
    opened = await ledger.open_run(tick, kw.pop("schedule", "weekly"), None, INLINE, **kw)
    assert opened.run is not None
    if ids is not None:
        await ledger.record_page(opened.run.id, ids, None, 0)
    return opened.run  # type: ignore[no-any-return]


# -- the SQLite ledger's writer -------------------------------------------------------------


@asynccontextmanager
async def writer_held(db: Database) -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """Hold the ledger's writer inside a batch, so writes queued meanwhile share the next
    group commit. ``release()`` lets the held batch commit and returns the commit count."""
    entered, gate = asyncio.Event(), asyncio.Event()

    async def hold(conn: object) -> None:
        entered.set()
        await gate.wait()

    blocker = asyncio.create_task(db.write(hold))
    await entered.wait()

    async def release() -> int:
        gate.set()
        await blocker
        return db.commits

    try:
        yield release
    finally:
        gate.set()
        await blocker


HoldWriter = Callable[[], AbstractAsyncContextManager[Callable[[], Awaitable[int]]]]


async def ambiguous_operation(ledger: SqliteLedger, queue: SqliteQueue) -> str:
    """A one-recipient run whose only operation's DELETE had an unknown outcome."""
    await open_run(ledger, ids=["r-000001"])
    await Courier(ledger, queue).publish(await ledger.unpublished(10))
    [d] = await queue.receive(1, 60)
    attempt = await ledger.begin_attempt(d.message.operation_id, "delete")
    await ledger.settle([Settlement(d.message.operation_id, OpState.AMBIGUOUS, d,
                                    attempt_id=attempt, outcome="ambiguous")])
    return d.message.operation_id


# -- PostgreSQL ------------------------------------------------------------------------------


@asynccontextmanager
async def admin(pg: Any) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(pg.dsn, server_settings={"search_path": pg.schema})
    try:
        yield conn
    finally:
        await conn.close()


async def advisory_lock_holder(pg: Any, conn: asyncpg.Connection, name: str) -> int:
    """The server pid of the session holding role ``name``'s advisory lock."""
    key = pgnames.lock_key(pg.schema, f"role:{name}") & 0xFFFFFFFFFFFFFFFF
    rows = await conn.fetch(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
        "AND classid = $1::bigint::oid AND objid = $2::bigint::oid", key >> 32, key & 0xFFFFFFFF)
    [row] = rows
    return int(row[0])


# -- Prometheus text -------------------------------------------------------------------------


Labels = frozenset[tuple[str, str]]


def parse_metrics(text: str) -> dict[tuple[str, Labels], float]:
    """Prometheus text exposition -> {(sample name, labels): value}."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class Metrics:
    """One scrape of a /metrics page."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = parse_metrics(text)

    def value(self, name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in self.samples, f"metric {name}{labels} not exposed"
        return self.samples[key]

    def get(self, name: str, default: float = 0.0, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), default)
