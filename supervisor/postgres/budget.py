"""A rate budget shared by every replica through one PostgreSQL row per partner.

One replica's handle on it, put together from:

* :mod:`supervisor.postgres.budget_row`: the row, its statements, and the pure decisions taken
  under its lock (the policy's events on the shared state, a new life);
* :mod:`supervisor.postgres.budget_view`: this replica's view of the row's policy state, kept
  in step with it both ways (reads and notifications in, 429s, announcements, pauses and
  successes out): **the policy runs once, on the row**;
* :mod:`supervisor.postgres.budget_slots`: the slots this replica reserved, and the workers
  sleeping on them;
* :mod:`supervisor.postgres.listen`: its LISTEN connection, which also holds the lock
  that counts it alive.

What is decided here:

* **Pacing is GCRA, reserved in blocks.** A replica whose workers need slots reserves
  ``k`` at once in one UPDATE: they start at ``max(next_at, now + lag - tolerance)``
  (``lag``: the reservation's expected round trip), 1/rate apart, and ``next_at`` moves
  ``k/rate`` on. ``k`` is what the replica will use soon, at most ``ceil(rate x 0.2 s)``:
  replicas interleave in blocks of at most 200 ms, and a grant costs a fraction of a
  statement. The UPDATE only goes through while the row's state is the version the rate
  was computed from; otherwise the replica reads the row and tries again. With
  configured quotas it is a short transaction instead (SELECT ... FOR UPDATE, charge the
  quotas k in Python, UPDATE); a spent quota refuses, and the replica holds until it
  frees. A cut or a pause resets ``next_at`` and moves the row's ``epoch`` on: every
  replica drops the slots it reserved before.
* **One cut per episode.** Throttle's ``sent_at >= cut_at`` on the shared ``cut_at`` makes
  three replicas in one 429 storm cut once; each grant carries the cut it was paced
  under, so a replica that heard of another's cut late (or whose clock is ahead) does not
  cut again (:func:`pg_row.apply`).
* **Clock**: slots, pauses and the policy's times all use one clock (``clock``), as the
  policy's state already does, so an injected clock holds throughout. By default it is
  PostgreSQL's: this host's wall clock corrected by the offset to the database's, measured
  at start. A replica whose clock is off (no NTP, a VM resumed) would otherwise reserve
  slots, pauses and cuts seconds away from its peers' (a skew of d seconds lets about
  d x rate requests overlap where two replicas' blocks meet, or stalls every replica behind
  a slot d seconds ahead). start() warns when the offset exceeds 0.1 s.
* **A new life** (policy.remembered: a learnt limit drifts back, a pause in force is kept)
  is applied once, by a replica that starts while no other is alive (the liveness lock:
  of two starting together one remembers and the other waits for it).
* **Without the database** workers hold (no slot is reserved) and go on once it is back;
  close() gives up on what it does not answer within a few seconds.
* Concurrency (the gradient limit) stays per replica, as in LocalBudget.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable

import asyncpg

from supervisor.budget import policy
from supervisor.budget.announced import Announced
from supervisor.budget.base import Admission, Grant, QuotaView, Snapshot
from supervisor.budget.feedback import PolicyChange, PolicyFeedback, shown
from supervisor.budget.policy_state import BudgetState, PolicyConfig, Resume
from supervisor.budget.quota import RollingQuota
from supervisor.budget.settings import LimitsConfig
from supervisor.budget.slots import Slots
from supervisor.postgres import connect as pg
from supervisor.postgres.budget_row import MIGRATIONS, BudgetTable, Change, Row, live, new_life, parse
from supervisor.postgres.budget_slots import Block, SlotBook
from supervisor.postgres.budget_view import SharedView
from supervisor.postgres.listen import Listener

__all__ = ["MIGRATIONS", "PostgresBudget"]

log = logging.getLogger(__name__)

# After a reservation failed on the database, waiters wait this long before the next one.
RETRY_S = 0.5
# Waiting for pending writes at close().
CLOSE_FLUSH_S = 2.0
# Waiting for the cancelled tasks at close(), and for the LISTEN connection to close: a
# statement cancelled while the database does not answer may take asyncpg the whole
# command timeout (30 s) to give up; it is left to do so on its own.
CLOSE_WAIT_S = 1.0



class PostgresBudget(PolicyFeedback):
    """One replica's handle on the budget all replicas share. ``start()`` before use,
    ``close()`` at the end."""

    def __init__(self, limits: LimitsConfig, key: str, pool: asyncpg.Pool, dsn: str,
                 schema: str, timeout_s: float = math.inf,
                 clock: Callable[[], float] = time.time, max_pause_s: float = 900.0,
                 db_clock: pg.DbClock | None = None) -> None:
        self.cfg = PolicyConfig.from_limits(limits, max_pause_s)
        self.key = key
        # The ledger's database clock when given: every replica paces on one clock.
        self._db_clock = db_clock
        if db_clock is not None:
            clock = db_clock.now
        self._clock = clock
        self._table = BudgetTable(pool, key, schema)
        self._faults: set[str] = set()
        self._changed = asyncio.Event()  # the pause changed: waiters in ready() look again
        self._book = SlotBook(limits.burst, clock, lambda: self._view.state)
        self._costly = asyncio.Lock()  # one batch's slots at a time (grant's cost)
        self._view = SharedView(
            self.cfg, self._table,
            [RollingQuota(q.name, q.limit, q.period_seconds) for q in limits.quotas], clock,
            on_void=self._book.void, on_hold=self._changed.set, fault=self._fault,
            mended=self._mended)
        self._listener = Listener(dsn, schema, self._table.channel,
                                  pg.lock_key(schema, f"budget:{key}"), key,
                                  on_payload=self._view.on_notify, on_back=self._view.missed,
                                  fault=self._fault, mended=self._mended)
        self._announced = Announced(max_pause_s)
        self._slots = Slots(limits.concurrency, timeout_s)
        self._refresher: asyncio.Task[None] | None = None
        self._listening: asyncio.Task[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        self.grants = 0

    @property
    def statements(self) -> int:
        """Statements sent to the database so far (BEGIN, COMMIT, LISTEN included)."""
        return self._table.statements + self._listener.statements

    @property
    def reservations(self) -> int:
        """Reservations that brought slots so far."""
        return self._book.reservations

    # -- life ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._refresher is not None:
            return
        alone = await self._listener.connect(first=True)
        try:
            row, _ = await self._table.open(
                policy.initial(self.cfg).to_dict(), self._new_life if alone else None)
            if alone:
                # Still counted as alive (shared); replicas waiting for us go on.
                await self._listener.unlock_exclusive()
        except BaseException:
            await self._listener.close(within_s=1.0)
            raise
        self._view.adopt(row, self._view.next_seq())
        loop = asyncio.get_running_loop()
        self._refresher = loop.create_task(self._view.run(), name="budget-refresh")
        self._listening = loop.create_task(self._listener.run(), name="budget-listen")
        now = self._clock()
        if not alone and policy.overlong(self.cfg, self._view.state, now):
            # Written by a release that did not bound pauses: lifted for every replica.
            self._drop_overlong(self._view.state, now)
            self._view.event(Resume(), now)
        state = self._view.state
        log.info("shared budget for %s starts at %.1f/s (learnt %s, paused until %s%s)",
                 self.key, state.rate, shown(state.w_max), shown(state.paused_until or None),
                 ", a new life" if alone else "",
                 extra={"action": "budget_remembered" if alone else "budget_joined"})

    def _new_life(self, row: Row) -> Change:
        memory, now = parse(row.state), self._clock()
        if memory is None:
            log.warning("shared budget state for %s unreadable; starting fresh", self.key)
        elif policy.overlong(self.cfg, memory, now):
            self._drop_overlong(memory, now)
        return new_life(self.cfg, row, self._view.quotas, now)

    def _drop_overlong(self, state: BudgetState, now: float) -> None:
        log.warning("shared budget for %s holds a pause until %.1f, %.0f s away: longer than "
                    "any pause may last (partner.max_retry_after_seconds = %g); dropped",
                    self.key, state.paused_until, state.paused_until - now,
                    self.cfg.max_pause_s, extra={"action": "budget_pause_dropped"})

    async def save(self) -> None:
        """Everything is in the database already: wait for the writes still pending."""
        await self._view.save()

    async def close(self) -> None:
        """Flush what is pending, stop the background tasks, drop the LISTEN connection
        (and with it this replica's liveness lock). Bounded (about CLOSE_FLUSH_S + 2 x
        CLOSE_WAIT_S) however the database fares, and cancellable; a second call waits
        for the first."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._view.save(), CLOSE_FLUSH_S)
        self._view.closed = True  # from here on, what release() learns stays here
        if self._view.pending:
            log.warning("shared budget for %s closed with %d events not written", self.key,
                        len(self._view.pending))
        tasks = [t for t in (self._refresher, self._listening, self._book.reserving,
                             self._view.writer) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            # Not awaited one by one: a task's cancellation must not hang close(), nor
            # close()'s own be taken for the task's.
            _, stuck = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
            if stuck:
                log.warning("shared budget for %s: %d statements still unanswered at close, "
                            "left to time out", self.key, len(stuck),
                            extra={"action": "budget_close_stuck"})
        await self._listener.close(within_s=CLOSE_WAIT_S)

    # -- the protocol ----------------------------------------------------------------

    def _held_until(self, now: float) -> tuple[float, str]:
        until, reason = self._view.state.paused_until, self._view.state.pause_reason
        if not self._book:  # slots reserved here are charged to the quotas already
            for q in self._view.quotas:
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

    async def acquire(self, cost: int = 1) -> Grant:
        while True:
            if (grant := await self.grant(await self.admit(), cost)) is not None:
                return grant

    async def admit(self) -> Admission:
        self._check_open()
        return await self._slots.admit(self.ready, self._clock)

    async def grant(self, admission: Admission, cost: int = 1) -> Grant | None:
        if cost > 1:
            # One batch's slots in a row: two batches taking theirs in turn would both
            # leave at the end, their ids arriving at once.
            async with self._costly:
                return await self._grant(admission, cost)
        return await self._grant(admission, cost)

    async def _grant(self, admission: Admission, cost: int) -> Grant | None:
        if admission.spent:
            raise RuntimeError("PostgresBudget.grant: this admission was spent already")
        admission.spent = True
        self._book.acquiring += 1
        taken = 0
        try:
            while not self._held_until(self._clock())[0]:
                self._check_open()
                at = await self._book.next(self._reserve, lambda now: self._held_until(now)[0] > 0)
                if at is None:
                    continue  # no slot reserved: look at the hold again
                if not await self._book.wait(at, self._book.gen):
                    self._book.paced_at(at)  # it went void or stale: forgotten
                    continue
                now, state, paced_at = self._clock(), self._view.state, self._book.paced_at(at)
                if state.paused_until <= now:
                    self.grants += 1
                    self._book.granted(now)
                    taken += 1
                    # A batch of k ids to a partner that counts ids takes k slots in a
                    # row, each at its own time: paced as k requests would be.
                    if taken >= cost:
                        return Grant(at=now, cut=state.cut_at, paced_at=paced_at)
                    continue
                # A pause began while we waited for the slot: the slot is forfeit.
            # A hold began after the admission: nothing is granted before it ends.
        except BaseException:
            self._slots.free()
            raise
        finally:
            self._book.acquiring -= 1
        self._slots.free()
        return None

    def withdraw(self, admission: Admission) -> None:
        self._slots.withdraw(admission)

    def departed(self) -> None:
        # The slots' spacing is kept by the schedule every replica reserves from; one
        # replica's departures alone cannot move it.
        return

    def _check_open(self) -> None:
        if self._refresher is None or self._view.closed:
            raise RuntimeError("PostgresBudget: acquire() needs start() and no close()")

    async def _reserve(self) -> None:
        try:
            for _ in range(3):
                now = self._clock()
                if self._held_until(now)[0]:
                    return
                state = live(self.cfg, self._view.state, now)
                k = self._book.size(state.rate, now)
                got: Block | None
                if self._view.quotas:
                    got = await self._reserve_locked(k)
                else:
                    got = await self._reserve_fast(state, k, now)
                if got is None:
                    continue  # the state moved on: reserve again at its rate
                self._book.add(got)
                self._mended("reserve")
                return
        except Exception as exc:
            self._fault("reserve", exc)
            await asyncio.sleep(RETRY_S)  # the waiters hold meanwhile

    async def _reserve_fast(self, state: BudgetState, k: int, now: float) -> Block | None:
        """One UPDATE; None when the row's state is no longer the one ``state`` came from
        (it is read again)."""
        gen, interval = self._book.gen, 1.0 / state.rate
        got = await self._table.reserve(self._book.earliest(state, now), k * interval,
                                        self._view.version)
        if got is None:
            await self._view.refresh()
            return None
        start, epoch = got
        self._view.read_at = self._clock()  # the state is confirmed as it was
        slots = [] if epoch != self._view.epoch else [start + i * interval for i in range(k)]
        return Block(slots, gen, now)

    async def _reserve_locked(self, k: int) -> Block:
        """One short transaction under the row lock: the quotas are charged what is
        reserved, and a spent one refuses (no slots)."""
        slots: list[float] = []
        gen, now = self._book.gen, self._clock()

        def decide(row: Row) -> Change | None:
            nonlocal gen, now
            self._view.adopt(row, self._view.next_seq())
            gen, now = self._book.gen, self._clock()
            if self._held_until(now)[0]:
                return None
            state, quotas = live(self.cfg, self._view.state, now), self._view.quotas
            n = min(k, *(q.remaining(now) for q in quotas))
            if n <= 0:
                return None
            interval = 1.0 / state.rate
            start = max(row.next_at, self._book.earliest(state, now))
            for q in quotas:
                for _ in range(n):
                    q.take(now)
            slots.extend(start + i * interval for i in range(n))
            return Change(quotas={q.name: q.to_list() for q in quotas},
                          next_at=start + n * interval)

        self._view.adopt(await self._table.locked(decide), self._view.next_seq())
        return Block(slots, gen, now)

    def _apply(self, event: PolicyChange, now: float, cut: float | None = None) -> None:
        # Whether a 429 cuts is decided by the cut it was paced under, not by clocks (see
        # budget_row.apply); the row is written with a NOTIFY (budget_row.with_events).
        self._view.event(event, now, cut)

    def _succeeded(self, now: float, sent_at: float) -> None:
        self._view.success(now, sent_at)

    def _rate(self) -> float:
        return self._view.state.rate

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

    def snapshot(self) -> Snapshot:
        now = self._clock()
        state = live(self.cfg, self._view.state, now)
        # Slots reserved here are charged but not sent: still this replica's to use.
        views = [QuotaView(q.name, q.limit, q.window_s, q.remaining(now) + len(self._book),
                           q.resets_at(now)) for q in self._view.quotas]
        views += self._announced.views(now, state.resumed_at)
        if self._db_clock is not None and self._db_clock.offset:
            # Callers hold this host's clock against it (time.time()): the budget's times
            # are PostgreSQL's, so they are handed over on this host's.
            state, views = _on_host_clock(state, views, self._db_clock.offset)
        return self._snapshot(state, views)


def _on_host_clock(state: BudgetState, views: list[QuotaView], offset: float,
                   ) -> tuple[BudgetState, list[QuotaView]]:
    paused = state.paused_until - offset if state.paused_until else 0.0
    return (dataclasses.replace(state, paused_until=paused),
            [dataclasses.replace(v, resets_at=v.resets_at - offset) if v.resets_at else v
             for v in views])


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
