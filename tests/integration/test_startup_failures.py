"""A start-up that fails at any step leaves nothing open (issue 18, point 3).

The service is configured with every part that opens something at start-up (the data-dir
lock, the ledger, the Infrai work queue, the budget, the partner client, two events sinks,
the tick queue, the HTTP listener); each step is made to fail in turn, by a real cause
where there is one (a data dir that is a file, a ledger path that is a directory, a port
already taken, an unreachable PostgreSQL), else through the composition root's own seam
(:meth:`supervisor.lifecycle.Resources.starting`). After the failure: no task, no thread,
no HTTP client session, no file descriptor under the data dir, no listening socket, and on
PostgreSQL no session of the schema's.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest

from supervisor import config as config_module
from supervisor.config import Config
from supervisor.errors import StartupError
from supervisor.lifecycle import Resources
from supervisor.service import Service
from tests.helpers import free_port

TOKEN = "trigger-token-for-tests-0123456789"
SQLITE_STEPS = ["data-dir-lock", "sqlite-ledger", "infrai-queue", "release-dead-owners",
                "budget", "partner", "events-sinks", "tick-queue", "http", "listen"]
# The default, embedded shape: the queue lives in the ledger's SQLite file.
EMBEDDED_STEPS = ["data-dir-lock", "sqlite-ledger", "sqlite-queue", "release-dead-owners",
                  "budget", "partner", "events-sinks", "tick-queue", "http", "listen"]
PG_STEPS = ["pg-database", "pg-membership", "infrai-queue", "budget", "partner",
            "events-sinks", "tick-queue", "http", "listen"]


class Injected(Exception):
    """The failure injected at one step."""


class FailingAt(Resources):
    """Start-up as usual until ``step``, which fails before it opens anything."""

    def __init__(self, step: str | None) -> None:
        super().__init__()
        self.step = step

    async def starting(self, step: str) -> None:
        await super().starting(step)
        if step == self.step:
            raise Injected(step)




def configure(tmp_path: Path, port: int, **env: str) -> Config:
    """Every part that opens something at start-up; nothing at start-up calls out, so the
    Infrai and partner addresses need no server."""
    environ = {
        "CLEANUP_TRIGGER_TOKEN": TOKEN, "INFRAI_API_KEY": "ifr_startup_key",
        "HOOK_SECRET": "hook-secret-0123456789",
        "CLEANUP__SERVICE__DATA_DIR": str(tmp_path / "data"),
        "CLEANUP__SERVICE__LISTEN": f"127.0.0.1:{port}",
        "CLEANUP__QUEUE__BACKEND": "infrai",
        "CLEANUP__INFRAI__BASE_URL": "http://127.0.0.1:9",
        "CLEANUP__INFRAI__TICK_QUEUE": "ticks",
        **env}
    cfg = tmp_path / "cleanup.toml"
    cfg.write_text('[[events.sink]]\nname = "audit"\nkind = "infrai"\nqueue = "audit"\n'
                   '[[events.sink]]\nname = "crm"\nkind = "webhook"\n'
                   'url = "http://127.0.0.1:9/hook"\nsecret_env = "HOOK_SECRET"\n',
                   encoding="utf-8")
    return config_module.load(cfg, environ=environ)


def open_under(path: Path) -> list[str]:
    """This process's file descriptors on files under ``path``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since listed (the listing's own)
        if target.startswith(str(path)):
            found.append(target)
    return found


def listening(port: int) -> bool:
    """Whether anything listens on ``port``: a bind without SO_REUSEADDR fails if so."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def open_sessions() -> list[aiohttp.ClientSession]:
    return [o for o in gc.get_objects()
            if isinstance(o, aiohttp.ClientSession) and not o.closed]


def threads_started_since(before: set[threading.Thread]) -> set[threading.Thread]:
    # The loop's default executor (asyncio.to_thread) keeps its idle workers until the
    # loop closes: the loop's, not something the service opened.
    return {t for t in threading.enumerate()
            if t not in before and not t.name.startswith("asyncio_")}


async def assert_nothing_open(tmp_path: Path, port: int, threads: set[threading.Thread],
                              sessions: int) -> None:
    # A closed aiosqlite connection's thread ends on its own, just after the close.
    for _ in range(100):
        if not threads_started_since(threads):
            break
        await asyncio.sleep(0.01)  # a thread's exit cannot be awaited
    assert threads_started_since(threads) == set()
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
    assert len(open_sessions()) == sessions
    assert open_under(tmp_path) == []
    assert not listening(port)


async def fail_at(service: Service) -> BaseException:
    with pytest.raises((StartupError, Injected)) as caught:
        await service.run()
    assert not service.started.is_set()
    return caught.value


async def steps_of_a_full_start(cfg: Config) -> list[str]:
    resources = FailingAt(None)
    service = Service(cfg, resources)
    task = asyncio.create_task(service.run())
    await service.started.wait()
    service.request_stop()
    assert await task == 0
    return resources.steps


async def test_the_steps_are_the_ones_this_test_fails(tmp_path: Path) -> None:
    """A step added to start-up must be added here, so it is failed too."""
    assert await steps_of_a_full_start(configure(tmp_path, free_port())) == SQLITE_STEPS


async def test_embedded_the_steps_are_the_ones_this_test_fails(tmp_path: Path) -> None:
    cfg = configure(tmp_path, free_port(), CLEANUP__QUEUE__BACKEND="sqlite")
    assert await steps_of_a_full_start(cfg) == EMBEDDED_STEPS


async def test_on_postgresql_the_steps_are_the_ones_this_test_fails(
        tmp_path: Path, pg: Any) -> None:
    cfg = configure(tmp_path, free_port(), CLEANUP__LEDGER__BACKEND="postgres",
                    CLEANUP_DATABASE_URL=pg.dsn, CLEANUP__LEDGER__SCHEMA=pg.schema)
    assert await steps_of_a_full_start(cfg) == PG_STEPS


# The steps broken for real; the others fail through the seam.
REAL_CAUSES = ("data-dir-lock", "sqlite-ledger", "listen")


@pytest.mark.parametrize(("queue", "step"), [("infrai", s) for s in SQLITE_STEPS]
                         + [("sqlite", s) for s in EMBEDDED_STEPS if s not in SQLITE_STEPS])
async def test_a_failure_at_each_step_leaves_nothing_open(queue: str, step: str,
                                                          tmp_path: Path) -> None:
    threads, sessions = set(threading.enumerate()), len(open_sessions())
    port = free_port()
    data = tmp_path / "data"
    if step == "data-dir-lock":
        data.write_text("a file where the data dir should be")
    elif step == "sqlite-ledger":
        (data / "cleanup.sqlite3").mkdir(parents=True)
    taken = socket.create_server(("127.0.0.1", port)) if step == "listen" else None
    service = Service(configure(tmp_path, port, CLEANUP__QUEUE__BACKEND=queue),
                      FailingAt(None if step in REAL_CAUSES else step))
    error = await fail_at(service)
    if taken is not None:
        taken.close()
    if step in REAL_CAUSES:
        assert isinstance(error, StartupError), error
    assert service.resources.steps[-1] == step  # it got that far, and no further
    await assert_nothing_open(tmp_path, port, threads, sessions)


async def pg_sessions(dsn: str, schema: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            f"cleanup-supervisor:{schema}")
        return count
    finally:
        await conn.close()


@pytest.mark.parametrize("step", PG_STEPS)
async def test_on_postgresql_a_failure_at_each_step_leaves_no_session(
        step: str, tmp_path: Path, pg: Any) -> None:  # tests/conftest.py: dsn, schema
    threads, sessions = set(threading.enumerate()), len(open_sessions())
    port = free_port()
    dsn = pg.dsn
    if step == "pg-database":  # a real cause: nothing listens there
        dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    taken = socket.create_server(("127.0.0.1", port)) if step == "listen" else None
    cfg = configure(tmp_path, port, CLEANUP__LEDGER__BACKEND="postgres",
                    CLEANUP_DATABASE_URL=dsn, CLEANUP__LEDGER__SCHEMA=pg.schema)
    injected = None if step in ("pg-database", "listen") else step
    service = Service(cfg, FailingAt(injected))
    error = await fail_at(service)
    if injected is None:
        assert isinstance(error, StartupError), error
    if taken is not None:
        taken.close()
    assert service.resources.steps[-1] == step
    assert await pg_sessions(pg.dsn, pg.schema) == 0
    await assert_nothing_open(tmp_path, port, threads, sessions)
