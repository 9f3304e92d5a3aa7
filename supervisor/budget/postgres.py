"""A rate budget shared by every replica through one PostgreSQL row per partner.

The row and its statements, and the pure decisions taken under its lock, are in
:mod:`supervisor.budget.pg_row`. Here is one replica's side:

* **Pacing is GCRA, reserved in blocks.** A replica whose workers need slots reserves
  ``k`` at once in one UPDATE: they start at ``max(next_at, now + lag - tolerance)``
  (``lag``: the reservation's expected round trip), 1/rate apart, and ``next_at`` moves
  ``k/rate`` on. ``k`` is what the replica will use soon (a slot per worker in acquire(), or
  its grants of the last second scaled to 200 ms, whichever is more), at most
  ``ceil(rate x 0.2 s)``: replicas interleave in blocks of at most 200 ms, and a grant
  costs a fraction of a statement. The UPDATE only goes through while the row's state is
  the version the rate was computed from; otherwise the replica reads the row and tries
  again. With configured quotas it is a short transaction instead (SELECT ... FOR
  UPDATE, charge the quotas k in Python, UPDATE); a spent quota refuses, and the replica
  holds until it frees. Workers sleep until their slot; one overslept by more than the
  tolerance ((burst - 1)/rate, 0 when strict) plus ``STALE_S`` is forfeit, so a stall of
  the event loop delays requests but never lets the overdue ones leave together.
* **The policy runs once, on the row.** A 429 is applied to this replica's state at once
  (its workers stop), then to the row's under its lock, with a NOTIFY in the same
  transaction; a cut or a pause also resets ``next_at`` and moves the ``epoch`` on, and
  every replica drops the slots it reserved before. Throttle's ``sent_at >= cut_at`` on the
  shared ``cut_at`` makes three replicas in one 429 storm cut once. Recovery is a function
  of time (:func:`policy.curve`): each replica computes the rate itself, and a success is
  written only when something else changed (compare-and-set on the version, skipped on
  conflict). Announcements and pauses are written only when they change the state. Writes
  run in order in one task; a failed one is logged and retried at the next refresh, and
  this replica's own reads never undo it meanwhile (its pending events are applied on top
  of every state it reads).
* **Every replica LISTENs** on a connection of its own. A notification carries the new
  state (no read needed); the row is read anyway at least once a second (a lost
  notification, a dropped connection, which is reconnected).
* **Clock**: slots, pauses and the policy's times all use the replicas' own wall clock
  (``clock``), as the policy's state already does, so an injected clock holds throughout.
  Replicas' clocks must agree (NTP): a skew of d seconds lets about d x rate requests
  overlap where two replicas' blocks meet. start() warns when this clock and the
  database's differ by more than 0.1 s.
* **A new life** (policy.remembered: a learnt limit drifts back, a pause in force is kept)
  is applied once, by a replica that starts while no other is alive. Every replica holds
  a session advisory lock (shared) on its LISTEN connection; a starting one first tries it
  exclusively, so of two starting together one remembers and the other waits for it. A
  crashed replica's lock goes with its connection.
* Concurrency (the gradient limit) stays per replica, as in LocalBudget.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import asyncpg

from supervisor import pg
from supervisor.budget import policy
from supervisor.budget.base import Feedback, Grant, Outcome, Policy, QuotaView, Snapshot
from supervisor.budget.concurrency import GradientLimit
from supervisor.budget.local import PACE_WINDOW_S
from supervisor.budget.pg_row import (
    MIGRATIONS,
    BudgetTable,
    Change,
    Pending,
    Row,
    apply,
    live,
    new_life,
    notified,
    parse,
    restored,
    voids,
    with_events,
)
from supervisor.budget.policy import BudgetState, PolicyConfig
from supervisor.budget.quota import RollingQuota
from supervisor.config import LimitsConfig

__all__ = ["MIGRATIONS", "PostgresBudget"]

log = logging.getLogger(__name__)

# A reservation covers at most this much time at the rate: replicas interleave in blocks
# this long, and a cut voids at most this much of another replica's pacing.
RESERVE_S = 0.2
# This replica's demand is its grants over this long.
DEMAND_S = 1.0
# Re-read the row at least this often without a notification.
REFRESH_S = 1.0
# A slot still unused this long past its time (beyond the tolerance) is forfeit: after a
# stall of the event loop the overdue slots must not all leave at once.
STALE_S = 0.02
# How fast the estimate of a reservation's round trip follows the latest one.
LAG_ALPHA = 0.3
# After a reservation failed on the database, waiters wait this long before the next one.
RETRY_S = 0.5
# Waiting for pending writes at close().
CLOSE_FLUSH_S = 2.0
SKEW_WARN_S = 0.1


class PostgresBudget:
    """One replica's handle on the budget all replicas share. ``start()`` before use,
    ``close()`` at the end."""

    def __init__(self, limits: LimitsConfig, key: str, pool: asyncpg.Pool, dsn: str,
                 schema: str, timeout_s: float = math.inf,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = PolicyConfig.from_limits(limits)
        self.key = key
        self._burst = limits.burst
        self._clock = clock
        self._dsn, self._schema = dsn, schema
        self._table = BudgetTable(pool, key, schema)
        self._lock_key = pg.lock_key(schema, f"budget:{key}")
        # The row's state as last read (of ``_version``), and this replica's view: that
        # state with the events not yet written applied on top, and what its own
        # successes derived since.
        self._shared = policy.initial(self.cfg)
        self._state = self._shared
        self._version = 0
        self._epoch = 0
        self._read_at = -math.inf
        self._read_seq = 0
        self._quota_seq = 0
        self._quotas = [RollingQuota(q.name, q.limit, q.period_seconds) for q in limits.quotas]
        self._announced: dict[str, tuple[Policy, float]] = {}
        # Writes, in order: events for the row's policy, then at most one compare-and-set.
        self._pending: deque[Pending] = deque()
        self._cas: tuple[int, BudgetState] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._write_failed = False
        self._writing = False  # events are being written: the view waits for the answer
        # Reserved slots (wall clock), all of generation ``_gen``; a void starts a new one.
        self._slots: deque[float] = deque()
        self._gen = 0
        self._voided = asyncio.Event()
        self._reserving: asyncio.Task[None] | None = None
        # Workers past their concurrency slot, not yet granted: each needs a slot soon, those
        # sleeping on one already included (they come back for the next one right after).
        self._acquiring = 0
        self._granted: deque[float] = deque(maxlen=4096)  # this replica's recent grants
        self._lag = 0.0  # a reservation's round trip, as expected
        self._changed = asyncio.Event()
        self._concurrency = GradientLimit(limits.concurrency, timeout_s)
        self._in_flight = 0
        self._slot_free = asyncio.Event()
        self._bound_logged = False
        self._listen: asyncpg.Connection | None = None
        self._poke = asyncio.Event()
        self._notified = False
        self._refresher: asyncio.Task[None] | None = None
        self._closed = False
        self._faults: set[str] = set()
        self._listen_statements = 0
        self.reservations = 0
        self.grants = 0

    @property
    def statements(self) -> int:
        """Statements sent to the database so far (BEGIN, COMMIT, LISTEN included)."""
        return self._table.statements + self._listen_statements

    # -- life ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._refresher is not None:
            return
        now = self._clock()
        alone = await self._connect_listener(first=True)
        try:
            row, db_now = await self._table.open(
                policy.initial(self.cfg).to_dict(), self._new_life if alone else None)
            if alone:
                # Still counted as alive (shared); replicas waiting for us go on.
                await self._listen_execute("SELECT pg_advisory_unlock($1)")
        except BaseException:
            assert self._listen is not None
            with contextlib.suppress(Exception):
                await self._listen.close(timeout=1.0)
            self._listen = None
            raise
        self._adopt(row, self._next_seq())
        if self._clock is time.time and abs(db_now - now) > SKEW_WARN_S:
            log.warning("this clock and PostgreSQL's differ by %.3f s: replicas pace on their "
                        "own clocks, so theirs must agree", now - db_now,
                        extra={"action": "budget_clock_skew"})
        self._refresher = asyncio.get_running_loop().create_task(
            self._refresh_loop(), name="budget-refresh")
        log.info("shared budget for %s starts at %.1f/s (learnt %s, paused until %s%s)",
                 self.key, self._state.rate, _fmt(self._state.w_max),
                 _fmt(self._state.paused_until or None), ", a new life" if alone else "",
                 extra={"action": "budget_remembered" if alone else "budget_joined"})

    def _new_life(self, row: Row) -> Change:
        if parse(row.state) is None:
            log.warning("shared budget state for %s unreadable; starting fresh", self.key)
        return new_life(self.cfg, row, self._quotas, self._clock())

    async def save(self) -> None:
        """Everything is in the database already: wait for the writes still pending."""
        if self._pending or self._cas is not None:
            self._kick()
        if self._writer is not None and not self._writer.done():
            await asyncio.wait([self._writer])

    async def close(self) -> None:
        """Flush what is pending, stop the background tasks, drop the LISTEN connection
        (and with it this replica's liveness lock)."""
        if self._closed:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.save(), CLOSE_FLUSH_S)
        self._closed = True  # from here on, what release() learns stays in this process
        if self._pending:
            log.warning("shared budget for %s closed with %d events not written", self.key,
                        len(self._pending))
        for task in (self._refresher, self._reserving, self._writer):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._listen is not None:
            with contextlib.suppress(Exception):
                await self._listen.close(timeout=2.0)
            self._listen = None

    # -- reading the row -------------------------------------------------------------

    def _next_seq(self) -> int:
        self._read_seq += 1
        return self._read_seq

    def _adopt(self, row: Row, seq: int) -> None:
        """Take what a statement returned, unless a newer read was taken already."""
        if row.version < self._version:
            return
        if row.quotas is not None and seq > self._quota_seq:
            self._quota_seq = seq
            self._quotas = [restored(q, row, self._clock()) for q in self._quotas]
        self._read_at = self._clock()
        if row.epoch > self._epoch:
            self._epoch = row.epoch
            self._void()
        if row.version == self._version:
            return
        if (shared := parse(row.state)) is None:
            log.warning("shared budget state for %s unreadable; keeping this replica's",
                        self.key)
            return
        self._shared, self._version = shared, row.version
        if self._cas is not None and self._cas[0] != row.version:
            self._cas = None  # it would conflict: the next success derives it again
        if not self._writing:  # a state read meanwhile may hold the events written
            self._recompute()

    def _recompute(self) -> None:
        state = live(self.cfg, self._shared, self._clock())
        for pending in self._pending:
            state = apply(self.cfg, state, pending)
        self._set(state)

    async def _refresh(self) -> None:
        seq = self._next_seq()
        row = await self._table.read()
        if row is None:  # the row went away (a reset by hand): put it back
            row, _ = await self._table.open(policy.initial(self.cfg).to_dict(), None)
        self._adopt(row, seq)

    async def _refresh_loop(self) -> None:
        while True:
            wait = max(0.01, REFRESH_S - (self._clock() - self._read_at))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._poke.wait()
            self._poke.clear()
            try:
                if self._listen is None or self._listen.is_closed():
                    await self._connect_listener(first=False)
                    self._notified = True  # notifications may have been missed meanwhile
                if self._write_failed:
                    self._kick()
                if self._notified or self._clock() - self._read_at >= REFRESH_S:
                    self._notified = False
                    await self._refresh()
            except Exception as exc:
                self._fault("refresh", exc)
                await asyncio.sleep(REFRESH_S)  # the database is away: again in a second
            else:
                self._mended("refresh")

    async def _connect_listener(self, first: bool) -> bool:
        """LISTEN on a connection of its own and hold the liveness lock on it. ``first``
        tries the lock exclusively: True when no other replica is alive (it is then held
        exclusively until start() is done with the row)."""
        if self._listen is not None:
            lost, self._listen = self._listen, None
            with contextlib.suppress(Exception):
                await lost.close(timeout=1.0)
            log.warning("shared budget for %s: LISTEN connection lost, reconnecting", self.key,
                        extra={"action": "budget_relisten"})
        conn = await pg.connect(self._dsn, self._schema)
        try:  # installed only once complete: a half-made one would never be made again
            self._listen_statements += 3 if first else 2
            alone = first and bool(await conn.fetchval("SELECT pg_try_advisory_lock($1)",
                                                       self._lock_key))
            await conn.execute("SELECT pg_advisory_lock_shared($1)", self._lock_key)
            await conn.add_listener(self._table.channel, self._on_notify)
        except BaseException:
            with contextlib.suppress(Exception):
                await conn.close(timeout=1.0)
            raise
        conn.add_termination_listener(lambda _conn: self._poke.set())
        self._listen = conn
        return alone

    async def _listen_execute(self, sql: str) -> None:
        assert self._listen is not None
        self._listen_statements += 1
        await self._listen.execute(sql, self._lock_key)

    def _on_notify(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        key, version, row = notified(str(payload))
        if (key is not None and key != self.key) or (
                version is not None and version <= self._version):
            return
        if row is not None:
            self._adopt(row, self._next_seq())  # the state came with it: no read needed
            return
        self._notified = True
        self._poke.set()

    # -- writing the row -------------------------------------------------------------

    def _kick(self) -> None:
        if self._closed:
            return
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(
                self._write_all(), name="budget-write")

    async def _write_all(self) -> None:
        while self._pending or self._cas is not None:
            try:
                if self._pending:
                    await self._write_events()
                    continue
                assert self._cas is not None
                (version, state), self._cas = self._cas, None
                if version == self._version:
                    seq = self._next_seq()
                    written = await self._table.compare_and_set(version, state.to_dict())
                    if written is not None:
                        self._adopt(written, seq)
            except Exception as exc:
                # Kept, in order, for the next refresh: a cut must never be lost.
                self._write_failed = True
                self._fault("write", exc)
                return
        self._write_failed = False
        self._mended("write")

    async def _write_events(self) -> None:
        """Every pending event in one transaction on the row, in order."""
        batch = list(self._pending)
        seq = self._next_seq()
        self._writing = True
        try:
            row = await self._table.locked(
                lambda row: with_events(self.cfg, row, batch, self._clock()))
            for _ in batch:
                self._pending.popleft()  # events added meanwhile stay, for the next round
            self._adopt(row, seq)
        finally:
            # Now the events are either in the newest state read, or still pending.
            self._writing = False
            self._recompute()

    def _event(self, event: policy.Throttle | policy.Announce | policy.Pause,
               now: float) -> None:
        pending = Pending(event, now)
        new = apply(self.cfg, self._state, pending)
        if new == self._state and not isinstance(event, policy.Throttle):
            return  # nothing changes: nothing to write
        if voids(self.cfg, self._state, new, now):
            self._void()  # this replica's slots at once; the row's epoch voids everyone's
        self._set(new)
        self._pending.append(pending)
        self._cas = None
        self._kick()

    # -- the protocol ----------------------------------------------------------------

    def _held_until(self, now: float) -> tuple[float, str]:
        until, reason = self._state.paused_until, self._state.pause_reason
        if not self._slots:  # slots reserved here are charged to the quotas already
            for q in self._quotas:
                at = q.available_at(now)
                if at > until:
                    until, reason = at, f"quota {q.name} exhausted"
        return (until, reason) if until > now else (0.0, "")

    async def ready(self) -> None:
        while (until := self._held_until(self._clock())[0]) > 0:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, until - self._clock())):
                    await self._changed.wait()

    async def acquire(self) -> Grant:
        self._check_open()
        while self._in_flight >= self._concurrency.value:
            self._slot_free.clear()
            await self._slot_free.wait()
        self._in_flight += 1
        self._acquiring += 1
        try:
            while True:
                await self.ready()
                self._check_open()
                at = await self._next_slot()
                if at is None or not await self._wait_slot(at, self._gen):
                    continue
                now = self._clock()
                if self._state.paused_until <= now:
                    self.grants += 1
                    self._granted.append(now)
                    return Grant(at=now)
                # A pause began while we waited for the slot: the slot is forfeit.
        except BaseException:
            self._free_slot()
            raise
        finally:
            self._acquiring -= 1

    def _check_open(self) -> None:
        if self._refresher is None or self._closed:
            raise RuntimeError("PostgresBudget: acquire() needs start() and no close()")

    async def _next_slot(self) -> float | None:
        """A reserved slot, reserving more when there is none; None when the reservation
        was refused (a hold began, a quota is spent): the caller re-reads the hold."""
        while True:
            now = self._clock()
            while self._slots and self._stale(self._slots[0], now):
                self._slots.popleft()
            if self._slots:
                return self._slots.popleft()
            if self._held_until(now)[0]:
                return None
            if self._reserving is None or self._reserving.done():
                self._reserving = asyncio.get_running_loop().create_task(
                    self._reserve(), name="budget-reserve")
            # A cancelled waiter leaves the reservation be: the others need it.
            await asyncio.wait([self._reserving])
            if not self._slots:
                return None

    async def _wait_slot(self, at: float, gen: int) -> bool:
        """Sleep until the slot; False when it is void by then, or was overslept (a late
        wake-up delays a request, it does not let it bunch with the next ones)."""
        try:
            while gen == self._gen and (delay := at - self._clock()) > 0:
                voided = self._voided
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await voided.wait()
        except asyncio.CancelledError:
            if gen == self._gen and not self._stale(at, self._clock()):
                bisect.insort(self._slots, at)  # unused: another worker takes it
            raise
        return gen == self._gen and not self._stale(at, self._clock())

    def _tolerance(self, state: BudgetState) -> float:
        return 0.0 if state.strict else (self._burst - 1.0) / max(state.rate, 1e-9)

    def _stale(self, at: float, now: float) -> bool:
        return now > at + self._tolerance(self._state) + STALE_S

    async def _reserve(self) -> None:
        try:
            for _ in range(3):
                now = self._clock()
                if self._held_until(now)[0]:
                    return
                state = live(self.cfg, self._state, now)
                k = max(1, min(self._demand(now), math.ceil(state.rate * RESERVE_S)))
                got: tuple[list[float], int, float] | None
                if self._quotas:
                    got = await self._reserve_locked(k)
                else:
                    got = await self._reserve_fast(state, k, now)
                if got is None:
                    continue  # the state moved on: reserve again at its rate
                slots, gen, computed_at = got
                received = self._clock()
                self._lag += LAG_ALPHA * (received - computed_at - self._lag)
                self.reservations += bool(slots)
                if gen == self._gen:  # else it may predate a void: dropped, to be safe
                    fresh = [at for at in slots if not self._stale(at, received)]
                    if slots and not fresh:
                        # An answer slower than expected: its slots are gone, but one is
                        # used now (a slow database must not starve every worker).
                        fresh = [received]
                    self._slots.extend(fresh)
                self._mended("reserve")
                return
        except Exception as exc:
            self._fault("reserve", exc)
            await asyncio.sleep(RETRY_S)  # the waiters hold meanwhile

    def _demand(self, now: float) -> int:
        """The slots this replica will use soon: one for every worker in acquire() (those
        sleeping on a slot too: they come back for the next one), or what it was granted
        over the last 200 ms of the last second, whichever is more. Too many cost at most a
        block (unused slots go stale); too few, a statement per grant."""
        while self._granted and self._granted[0] < now - DEMAND_S:
            self._granted.popleft()
        return max(self._acquiring, math.ceil(len(self._granted) * RESERVE_S / DEMAND_S))

    def _earliest(self, state: BudgetState, now: float) -> float:
        """The earliest start of a reservation computed at ``now``: when its answer is
        expected back, less the tolerance."""
        return now + self._lag - self._tolerance(state)

    async def _reserve_fast(self, state: BudgetState, k: int,
                            now: float) -> tuple[list[float], int, float] | None:
        """One UPDATE; None when the row's state is no longer the one ``state`` came from
        (it is read again). Returns the slots, the generation they belong to and when they
        were computed."""
        gen, interval = self._gen, 1.0 / state.rate
        got = await self._table.reserve(self._earliest(state, now), k * interval,
                                        self._version)
        if got is None:
            await self._refresh()
            return None
        start, epoch = got
        self._read_at = self._clock()  # the state is confirmed as it was
        slots = [] if epoch != self._epoch else [start + i * interval for i in range(k)]
        return slots, gen, now

    async def _reserve_locked(self, k: int) -> tuple[list[float], int, float]:
        """One short transaction under the row lock: the quotas are charged what is
        reserved, and a spent one refuses (no slots)."""
        slots: list[float] = []
        gen, now = self._gen, self._clock()

        def decide(row: Row) -> Change | None:
            nonlocal gen, now
            self._adopt(row, self._next_seq())
            gen, now = self._gen, self._clock()
            if self._held_until(now)[0]:
                return None
            state = live(self.cfg, self._state, now)
            n = min(k, *(q.remaining(now) for q in self._quotas))
            if n <= 0:
                return None
            interval = 1.0 / state.rate
            start = max(row.next_at, self._earliest(state, now))
            for q in self._quotas:
                for _ in range(n):
                    q.take(now)
            slots.extend(start + i * interval for i in range(n))
            return Change(quotas={q.name: q.to_list() for q in self._quotas},
                          next_at=start + n * interval)

        self._adopt(await self._table.locked(decide), self._next_seq())
        return slots, gen, now

    def _free_slot(self) -> None:
        self._in_flight -= 1
        self._slot_free.set()

    def release(self, grant: Grant, feedback: Feedback) -> None:
        self._free_slot()
        now = self._clock()
        if feedback.policies:
            self._learn(feedback.policies, now)
        if feedback.outcome is Outcome.OK:
            self._concurrency.sample(feedback.latency_s, self._in_flight + 1)
            self._bound_check()
            old = self._state
            new = policy.step(self.cfg, old, policy.Success(), now)
            self._set(new)
            if replace(new, rate=0.0) != replace(old, rate=0.0) and not self._pending:
                # Blind reset, a plateau verified, w_max dropped at the top: for everyone.
                self._cas = (self._version, new)
                self._kick()
        elif feedback.outcome is Outcome.THROTTLED:
            self._event(policy.Throttle(grant.at, feedback.retry_after_s), now)

    def pause(self, until: float, reason: str) -> None:
        self._event(policy.Pause(until, reason), self._clock())

    def _learn(self, policies: tuple[Policy, ...], now: float) -> None:
        paces = [p.limit / p.window_s for p in policies if p.window_s <= PACE_WINDOW_S]
        self._event(policy.Announce(min(paces) if paces else None), now)
        for p in policies:
            if p.window_s > PACE_WINDOW_S or not paces:
                self._announced[p.name] = (p, now)
                if p.remaining is not None and p.remaining < 1 and p.reset_s:
                    self.pause(now + p.reset_s, f"quota {p.name} exhausted")

    def _bound_check(self) -> None:
        bound = self._concurrency.bounds(self._state.rate)
        if bound and not self._bound_logged:
            log.warning("limits.concurrency = %d bounds the pace: %.1f/s at %.0f ms needs %d "
                        "in flight", self._concurrency.maximum, self._state.rate,
                        1000 * (self._concurrency.long or 0.0),
                        math.ceil(self._state.rate * (self._concurrency.long or 0.0)),
                        extra={"action": "concurrency_bound"})
        self._bound_logged = bound

    def _fault(self, what: str, exc: Exception) -> None:
        """Log a failed ``what`` once (a warning) until it works again."""
        first = what not in self._faults
        self._faults.add(what)
        log.log(logging.WARNING if first else logging.DEBUG,
                "shared budget for %s: %s failed, retrying: %s", self.key, what,
                _describe(exc), extra={"action": f"budget_{what}_failed"})

    def _mended(self, what: str) -> None:
        if what in self._faults:
            self._faults.discard(what)
            log.info("shared budget for %s: %s works again", self.key, what,
                     extra={"action": f"budget_{what}_mended"})

    def _set(self, state: BudgetState) -> None:
        old, self._state = self._state, state
        if old.paused_until != state.paused_until:
            self._changed.set()  # waiters in ready() re-read the hold

    def _void(self) -> None:
        """Drop every slot reserved so far and wake the workers sleeping on one."""
        self._slots.clear()
        self._gen += 1
        self._voided.set()
        self._voided = asyncio.Event()

    def snapshot(self) -> Snapshot:
        now = self._clock()
        state = live(self.cfg, self._state, now)
        # Slots reserved here are charged but not sent: still this replica's to use.
        views = [QuotaView(q.name, q.limit, q.window_s, q.remaining(now) + len(self._slots),
                           q.resets_at(now)) for q in self._quotas]
        for p, at in self._announced.values():
            if p.remaining is None or p.reset_s is None or now > at + p.reset_s:
                continue
            views.append(QuotaView(p.name, p.limit, p.window_s, p.remaining, at + p.reset_s))
        return Snapshot(state=state, ceiling=self.cfg.ceiling,
                        concurrency_limit=self._concurrency.value,
                        concurrency_max=self._concurrency.maximum, in_flight=self._in_flight,
                        concurrency_bound=self._concurrency.bounds(state.rate),
                        quotas=tuple(views))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _fmt(value: float | None) -> str:
    return "nothing" if value is None else f"{value:.1f}"
