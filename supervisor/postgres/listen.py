"""One replica's own connection to PostgreSQL for the shared budget: it LISTENs for the
other replicas' changes, and it holds the lock that counts the replica alive.

* **Notifications** carry the row's new state (see :mod:`supervisor.postgres.budget_row`); each
  payload is handed to the budget as it comes. A notification can be lost (a dropped
  connection), so the budget reads the row anyway at least once a second.
* **Liveness** is a session advisory lock on this connection, held shared by every
  replica. A starting replica first tries it exclusively: only when no other replica is
  alive does it get it, and it then applies the new life (policy.remembered) while a
  replica starting at the same moment waits for the shared lock. A crashed replica's
  lock goes with its connection, so nobody has to clean up after it.
* **The connection is kept by a task of its own** (:meth:`Listener.run`), so that
  making it again, however long that takes (the database away, the lock waiting for a
  replica that is starting), never holds up the budget's reads and writes. A connection
  the server or the network closed is replaced at once; the old one is closed first, and
  the new one is installed only once it LISTENs and holds the lock (a half-made one
  would never be made again). The budget reads the row after every reconnection, for
  what it missed meanwhile.
* **A quiet connection is pinged** (``PING_S``). It only ever receives, so one that died
  in silence (a NAT or a firewall forgot it, the server went during a partition) would
  otherwise look open for ever: no notification would reach the replica again (the
  others' 429s would take a second, the next read, instead of milliseconds), and its
  liveness lock would be gone without it knowing. A ping unanswered within
  ``PING_TIMEOUT_S`` ends the connection, and it is made again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import asyncpg

from supervisor.postgres import connect as pg

log = logging.getLogger(__name__)

# Ping the connection after this long without a notification on it.
PING_S = 2.0
# A ping not answered within this long: the connection is dead. Not much less: a stall
# of this event loop or a busy database must not pass for one (each reconnection drops
# the liveness lock for a moment).
PING_TIMEOUT_S = 2.0
# After a failed reconnection, try again this long after.
RECONNECT_S = 1.0

Report = Callable[[str, Exception], None]


class Listener:
    """The LISTEN connection of one budget key. ``on_payload`` gets every notification on
    ``channel``; ``on_back`` is called once a lost connection is made again (what was
    notified meanwhile is lost). ``fault`` and ``mended`` report a failure and its end."""

    def __init__(self, dsn: str, schema: str, channel: str, lock_key: int, key: str,
                 on_payload: Callable[[str], None], on_back: Callable[[], None],
                 fault: Report, mended: Callable[[str], None]) -> None:
        self._dsn, self._schema = dsn, schema
        self._channel = channel
        self._lock_key = lock_key
        self._key = key  # for the log
        self._on_payload = on_payload
        self._on_back = on_back
        self._fault, self._mended = fault, mended
        self.conn: asyncpg.Connection | None = None
        self._lost = asyncio.Event()  # the server or the network ended the connection
        self._heard_at = time.monotonic()
        self.statements = 0  # LISTEN, the lock statements and pings, for the cost per grant

    @property
    def lost(self) -> bool:
        """No connection, or one the server or the network has closed."""
        return self.conn is None or self.conn.is_closed()

    async def connect(self, first: bool) -> bool:
        """LISTEN on a connection of its own and hold the liveness lock on it. ``first``
        tries the lock exclusively: True when no other replica is alive (it is then held
        exclusively until :meth:`unlock_exclusive`)."""
        if self.conn is not None:
            lost, self.conn = self.conn, None
            with contextlib.suppress(Exception):
                await lost.close(timeout=1.0)
            log.warning("shared budget for %s: LISTEN connection lost, reconnecting", self._key,
                        extra={"action": "budget_relisten"})
        conn = await pg.connect(self._dsn, self._schema)
        try:  # installed only once complete: a half-made one would never be made again
            self.statements += 3 if first else 2
            alone = first and bool(await conn.fetchval("SELECT pg_try_advisory_lock($1)",
                                                       self._lock_key))
            await conn.execute("SELECT pg_advisory_lock_shared($1)", self._lock_key)
            await conn.add_listener(self._channel, self._notified)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.close(timeout=1.0)
            raise
        conn.add_termination_listener(lambda _conn: self._lost.set())
        self.conn = conn
        self._heard_at = time.monotonic()
        return alone

    async def run(self) -> None:
        """Keep the connection (after :meth:`connect`): make a lost one again, ping a
        quiet one. Runs until cancelled."""
        while True:
            if self.lost:
                try:
                    await self.connect(first=False)
                except Exception as exc:
                    self._fault("listen", exc)
                    await asyncio.sleep(RECONNECT_S)
                    continue
                self._mended("listen")
                self._on_back()
                continue
            self._lost.clear()
            quiet = PING_S - (time.monotonic() - self._heard_at)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, quiet)):
                    await self._lost.wait()
            if not self.lost and time.monotonic() - self._heard_at >= PING_S:
                await self._ping()

    async def _ping(self) -> None:
        conn = self.conn
        assert conn is not None
        self.statements += 1
        try:
            await conn.execute("SELECT 1", timeout=PING_TIMEOUT_S)
        except Exception as exc:
            self._fault("listen", exc)
            conn.terminate()  # lost: made again at once
        else:
            self._heard_at = time.monotonic()

    async def unlock_exclusive(self) -> None:
        """Give up the exclusive hold a first connection took, keeping the shared one: the
        replicas waiting for this one's new life go on."""
        assert self.conn is not None
        self.statements += 1
        await self.conn.execute("SELECT pg_advisory_unlock($1)", self._lock_key)

    async def close(self, within_s: float) -> None:
        """Drop the connection, and with it this replica's liveness lock."""
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close(timeout=within_s)
            self.conn = None

    def _notified(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        self._heard_at = time.monotonic()  # alive: no ping needed for a while
        self._on_payload(str(payload))
