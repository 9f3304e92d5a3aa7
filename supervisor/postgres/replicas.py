"""Nothing assumes it is alone: replica membership and singleton roles.

With one process (the SQLite ledger, under the data-dir lock) :class:`LocalRoles` holds
every role at once. With PostgreSQL each replica registers in ``replicas`` and heartbeats;
whichever replica notices one silent for ``dead_after_seconds`` deletes it and, in the same
transaction, releases its leases and in-flight guards, so its work is delivered again
within seconds and no live replica's is ever taken (:class:`Membership`). A singleton role
(the scan, the outbox publisher, redrive, reconcile, the run monitor, each events sink) is
a session advisory lock on one connection per replica (:class:`AdvisoryRoles`): a holder
that dies loses its session and so the lock, and another replica takes the role at its
next try, within ``role_poll_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import asyncpg

from supervisor import metrics
from supervisor.errors import StorageError
from supervisor.ledger.settings import LedgerConfig
from supervisor.postgres import connect as pg
from supervisor.postgres import sql
from supervisor.postgres.database import STORAGE, Conn, PgDatabase

log = logging.getLogger(__name__)

Factory = Callable[[], Coroutine[Any, Any, None]]
T = TypeVar("T")


def new_replica_id() -> str:
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(3)}"


# A probe of the lock connection that takes longer than this lets go of every role.
CHECK_TIMEOUT_S = 2.0


class RoleLost(StorageError):
    """The connection holding this replica's role locks broke: every role is let go."""


class AdvisoryRoles:
    """Singleton roles as session advisory locks on one connection of this replica."""

    def __init__(self, dsn: str, schema: str, poll_s: float, replica: str = "") -> None:
        self.dsn = dsn
        self.schema = schema
        self.replica = replica  # registered: the reaper may end this session with it
        self.poll_s = poll_s
        self._conn: asyncpg.Connection | None = None
        self._use = asyncio.Lock()  # one query at a time on the lock connection
        self._held: set[str] = set()
        self._lost = asyncio.Event()

    def holds(self, name: str) -> bool:
        return name in self._held

    async def _connection(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            if self._conn is not None:
                # Closed under us (the session was ended): its locks went with it, so
                # every role it held is lost, whoever notices first (a probe, a try).
                self._drop(StorageError("the role lock connection was closed"))
            self._held.clear()
            self._conn = await pg.connect(self.dsn, self.schema)
            self._lost = asyncio.Event()
            if self.replica:
                await self._conn.execute(sql.SET_ROLES_PID, self.replica)
        return self._conn

    async def _try(self, name: str) -> bool:
        async with self._use:
            try:
                conn = await self._connection()
                return bool(await conn.fetchval("SELECT pg_try_advisory_lock($1)",
                                                pg.lock_key(self.schema, f"role:{name}")))
            except (asyncpg.PostgresError, *STORAGE) as exc:
                self._drop(exc)
                return False

    async def _release(self, name: str) -> None:
        self._held.discard(name)
        metrics.ROLE_HELD.labels(name).set(0)
        async with self._use:
            if self._conn is not None and not self._conn.is_closed():
                with contextlib.suppress(asyncpg.PostgresError, *STORAGE):
                    await self._conn.execute("SELECT pg_advisory_unlock($1)",
                                             pg.lock_key(self.schema, f"role:{name}"))

    def _drop(self, exc: BaseException) -> None:
        if self._held:
            log.error("lost the role lock connection (%s): letting go of %s", exc,
                      ", ".join(sorted(self._held)), extra={"action": "roles_lost"})
        self._held.clear()
        self._lost.set()
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None

    async def check(self) -> None:
        """Probe the lock connection (the heartbeat calls it): a broken one loses all."""
        if not self._held:
            return
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S), self._use:
                conn = await self._connection()
                await conn.fetchval("SELECT 1")
        except (asyncpg.PostgresError, *STORAGE) as exc:
            # TimeoutError is among STORAGE: an unresponsive lock connection may have lost
            # its session already, and another replica may hold our roles.
            self._drop(exc)

    async def run(self, name: str, factory: Factory) -> None:
        # Polled: a lock held by another session has no event to await. The period is
        # the takeover time after a holder dies.
        while True:
            if await self._try(name):
                break
            await asyncio.sleep(self.poll_s)
        self._held.add(name)
        metrics.ROLE_HELD.labels(name).set(1)
        log.info("took role %s", name, extra={"action": "role_taken", "role": name})
        work = asyncio.ensure_future(factory())
        lost = asyncio.ensure_future(self._lost.wait())
        try:
            await asyncio.wait({work, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, lost):
                if not task.done():
                    task.cancel()
            await asyncio.gather(work, lost, return_exceptions=True)
            await self._release(name)
        # ``lost`` cancelled above means the work ended first: its return or crash stands.
        if work.done() and not work.cancelled() and (lost.cancelled() or not lost.done()):
            work.result()  # the component's own return or crash
            return
        raise RoleLost(f"role {name} lost with its lock connection")

    async def close(self) -> None:
        # The locks go with the connection: a component still running under one must stop.
        self._held.clear()
        self._lost.set()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None


class Membership:
    """This replica in the registry: registers, heartbeats, reaps the dead, leaves.

    On a connection of its own, as the role locks are, never the shared pool: the pool
    also serves every API read, the consumer and the shared budget, and a pool saturated
    by them must not keep the heartbeat waiting until the peers declare a live replica
    dead and send its work again.
    """

    def __init__(self, db: PgDatabase, cfg: LedgerConfig, roles: AdvisoryRoles) -> None:
        self.db = db
        self.cfg = cfg
        self.roles = roles
        self.reaped = 0  # replicas this one declared dead
        self.released = 0  # leases and guards it released for them
        self._last_beat = 0.0
        self._steady_since = 0.0  # heartbeats without a gap since then
        self._conn: asyncpg.Connection | None = None

    async def _write(self, fn: Callable[[Conn], Coroutine[Any, Any, T]]) -> T:
        """``fn`` in one transaction on the heartbeat's connection (made again after any
        fault: a statement cut short by a timeout leaves it in an unknown state)."""
        try:
            if self._conn is None or self._conn.is_closed():
                self._conn = await pg.connect(self.db.dsn, self.db.schema)
            async with self._conn.transaction():
                return await fn(self._conn)
        except (asyncpg.PostgresError, *STORAGE) as exc:
            self._drop()
            raise StorageError(f"heartbeat write failed: {exc}") from exc
        except BaseException:
            self._drop()
            raise

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), CHECK_TIMEOUT_S)

    @property
    def fresh(self) -> bool:
        """Whether the last heartbeat is recent enough that no other replica can think us
        dead (half of dead_after): otherwise start no new attempt."""
        return time.monotonic() - self._last_beat < self.cfg.dead_after_seconds / 2

    async def join(self) -> None:
        async def write(conn: Conn) -> None:
            await conn.execute(sql.REGISTER_REPLICA, self.db.replica, socket.gethostname(),
                               os.getpid())

        await self._write(write)
        self._last_beat = self._steady_since = time.monotonic()

    async def run(self) -> None:
        """The heartbeat component: every replica runs it. A failed beat (the database
        away, a pool exhausted) is retried at the next period, never left to the
        supervisor's growing restart backoff: the beat is what keeps this replica alive."""
        failing = False
        while True:
            await asyncio.sleep(self.cfg.heartbeat_seconds)  # a period, not a sync
            try:
                async with asyncio.timeout(self.cfg.dead_after_seconds / 2):
                    await self.beat()
            except (StorageError, TimeoutError) as exc:
                if not failing:
                    log.warning("heartbeat failed (%s); retrying every %gs", exc or "timeout",
                                self.cfg.heartbeat_seconds, extra={"action": "heartbeat_failed"})
                failing = True
                continue
            if failing:
                log.info("heartbeat back", extra={"action": "heartbeat_recovered"})
            failing = False

    async def beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat > self.cfg.dead_after_seconds / 2:
            self._steady_since = now  # a gap: this replica's own view was stale too
        steady = now - self._steady_since >= self.cfg.dead_after_seconds

        async def write(conn: Conn) -> tuple[list[str], int]:
            if await conn.fetchval(sql.HEARTBEAT, self.db.replica) is None:
                # Declared dead while we stalled: what we held was released. Register
                # again; deliveries still held here will find their leases gone.
                log.error("replica %s was declared dead by another; registering again",
                          self.db.replica, extra={"action": "replica_rejoined"})
                await conn.execute(sql.REGISTER_REPLICA, self.db.replica,
                                   socket.gethostname(), os.getpid())
            # Only a replica that has itself beaten without a gap for the whole dead time
            # judges others: after an outage every replica comes back with stale rows, and
            # the first to reconnect must not declare the others (alive, reconnecting) dead.
            reaped = [] if not steady else await conn.fetch(
                sql.REAP_REPLICAS, self.cfg.dead_after_seconds, self.db.replica)
            dead = [r[0] for r in reaped]
            pids = [r[1] for r in reaped if r[1] is not None]
            if pids:
                await conn.fetchval(sql.END_ROLE_SESSIONS, pids,
                                    f"cleanup-supervisor:{self.db.schema}")
            metrics.LIVE_REPLICAS.set(await conn.fetchval(sql.COUNT_REPLICAS))
            released = 0
            if dead:
                status = await conn.execute(sql.RELEASE_MESSAGES_OF, dead)
                released += int(status.rpartition(" ")[2])
                status = await conn.execute(sql.RELEASE_GUARDS_OF, dead)
                released += int(status.rpartition(" ")[2])
                await conn.execute(sql.NOTIFY, pg.channel(self.db.schema, "queue"), "")
            return dead, released

        dead, released = await self._write(write)
        self._last_beat = time.monotonic()
        if dead:
            self.db.wakeups["queue"].set()  # committed: our own consumers look too
        if dead:
            self.reaped += len(dead)
            self.released += released
            metrics.REPLICAS_REAPED.inc(len(dead))
            log.warning("replica(s) %s stopped heartbeating; released %d leases and guards",
                        ", ".join(dead), released, extra={"action": "replicas_reaped"})
        await self.roles.check()

    async def leave(self) -> None:
        """A clean stop: the pool handed its leases back already; deregister."""
        async def write(conn: Conn) -> None:
            await conn.execute(sql.LEAVE, self.db.replica)

        try:
            with contextlib.suppress(StorageError):
                await self._write(write)
        finally:
            await self.close()

    async def live(self) -> list[dict[str, Any]]:
        rows = await self.db.read(sql.LIVE_REPLICAS)
        return [{"id": r[0], "host": r[1], "pid": r[2], "started_at": r[3],
                 "heartbeat_age_s": round(r[5] - r[4], 3)} for r in rows]
