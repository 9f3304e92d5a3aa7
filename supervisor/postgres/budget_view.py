"""One replica's view of the shared budget's policy state, kept in step with the row both
ways (the row and its statements: :mod:`supervisor.postgres.budget_row`).

* **Reading.** ``shared`` is the row's state as last read (of ``version``); ``state``, this
  replica's view, is that state with the events not yet written applied on top, and what
  its own successes derived since. An answer is taken unless a newer one was already:
  answers on the pool and notifications on the LISTEN connection arrive in any order,
  and versions only move on. A notification carries the state (no read needed); the row
  is read anyway at least once a second (a lost notification, the LISTEN connection away)
  by a task of its own, which no trouble with the LISTEN connection holds up. A row found
  to have gone back a version (a reset by hand, a restore, a failover that lost the last
  writes) is taken as it is: ignored, every reservation on it would be refused for ever.
* **Writing.** A 429, an announcement or a pause (an *event*) changes the view at once,
  then the row's state under its lock, with a NOTIFY in the same transaction
  (:func:`pg_row.with_events`): the policy runs once, on the row. Recovery is a function
  of time (:func:`policy.curve`), so a success is written only when it changes something
  else (compare-and-set on the version, skipped on conflict). Announcements and pauses are
  written only when they change the view. Writes run in order in one task; a failed one is
  kept, in order, and tried again soon (``WRITE_RETRY_S``, doubling to ``REFRESH_S``), and
  this replica's own reads never undo it meanwhile (its pending events are applied on top
  of every state it reads).
* **Voids.** When the row's epoch moves on, or an event here drops the rate or begins a
  pause, the slots reserved so far must not be used: ``on_void``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from supervisor.budget import policy
from supervisor.budget.policy_state import (
    Announce,
    BudgetState,
    Pause,
    PolicyConfig,
    Resume,
    Success,
    Throttle,
)
from supervisor.budget.quota import RollingQuota
from supervisor.postgres.budget_row import (
    BudgetTable,
    Pending,
    Row,
    apply,
    live,
    notified,
    parse,
    restored,
    voids,
    with_events,
)
from supervisor.postgres.listen import Report

log = logging.getLogger(__name__)

# Re-read the row at least this often without a notification.
REFRESH_S = 1.0
# A failed write is tried again this long after, doubling up to REFRESH_S while it fails:
# a cut reaches the others within moments of a passing fault, not at the next read.
WRITE_RETRY_S = 0.05


class SharedView:
    """The policy state of one budget key as this replica sees it, and its writes.
    ``on_void`` drops the slots reserved so far; ``on_hold`` is called when the pause
    changes (workers waiting on it look again)."""

    def __init__(self, cfg: PolicyConfig, table: BudgetTable, quotas: list[RollingQuota],
                 clock: Callable[[], float], on_void: Callable[[], None],
                 on_hold: Callable[[], None], fault: Report,
                 mended: Callable[[str], None]) -> None:
        self.cfg = cfg
        self._table = table
        self._key = table.key  # for the log
        self._clock = clock
        self._on_void, self._on_hold = on_void, on_hold
        self._fault, self._mended = fault, mended
        self.shared = policy.initial(cfg)
        self.state = self.shared
        self.version = 0
        self._version_seq = 0  # _read_seq when version was taken: later reads are newer
        self.epoch = 0
        self.read_at = -math.inf
        self._read_seq = 0
        self._quota_seq = 0
        self.quotas = quotas  # as the row counts them (replaced on every read of them)
        # Writes, in order: events for the row's policy, then at most one compare-and-set.
        self.pending: deque[Pending] = deque()
        self._cas: tuple[int, BudgetState] | None = None
        self.writer: asyncio.Task[None] | None = None
        self._write_failed = False
        self._write_retry_s = WRITE_RETRY_S
        self._writing = False  # events are being written: the view waits for the answer
        self._poke = asyncio.Event()
        self._notified = False
        self.closed = False  # from then on, what is learnt stays in this process

    # -- reading the row -------------------------------------------------------------

    def next_seq(self) -> int:
        """A number for a statement about to be sent: answers of later ones are newer."""
        self._read_seq += 1
        return self._read_seq

    def adopt(self, row: Row, seq: int) -> None:
        """Take what a statement returned, unless a newer read was taken already."""
        if row.version < self.version:
            return
        if row.quotas is not None and seq > self._quota_seq:
            self._quota_seq = seq
            self.quotas = [restored(q, row, self._clock()) for q in self.quotas]
        self.read_at = self._clock()
        if row.epoch != self.epoch:
            # A void not seen yet; or the row went back (see refresh), its epoch with it:
            # slots reserved on the row as it was are void too.
            self.epoch = row.epoch
            self._on_void()
        if row.version == self.version:
            return
        if (shared := parse(row.state)) is None:
            log.warning("shared budget state for %s unreadable; keeping this replica's",
                        self._key)
            return
        self.shared, self.version = shared, row.version
        self._version_seq = self._read_seq
        if self._cas is not None and self._cas[0] != row.version:
            self._cas = None  # it would conflict: the next success derives it again
        if not self._writing:  # a state read meanwhile may hold the events written
            self._recompute()

    def _recompute(self) -> None:
        state = live(self.cfg, self.shared, self._clock())
        for pending in self.pending:
            state = apply(self.cfg, state, pending)
        self._set(state)

    def _set(self, state: BudgetState) -> None:
        old, self.state = self.state, state
        if old.paused_until != state.paused_until:
            self._on_hold()

    async def refresh(self) -> None:
        seq = self.next_seq()
        row = await self._table.read()
        if row is None:  # the row went away (a reset by hand): put it back
            row, _ = await self._table.open(policy.initial(self.cfg).to_dict(), None)
        if row.version < self.version and seq > self._version_seq:
            # Read after this replica knew a later version, so not an answer overtaken by
            # a newer one: the row went back. It is the truth now.
            log.warning("shared budget for %s: the row went back from version %d to %d; "
                        "taking it as it is", self._key, self.version, row.version,
                        extra={"action": "budget_row_reset"})
            self.version = 0
        self.adopt(row, seq)

    def on_notify(self, payload: str) -> None:
        key, version, row = notified(payload)
        if (key is not None and key != self._key) or (
                version is not None and version <= self.version):
            return
        if row is not None:
            self.adopt(row, self.next_seq())  # the state came with it: no read needed
            return
        self._notified = True
        self._poke.set()

    def missed(self) -> None:
        """Notifications were lost (the LISTEN connection is back): read the row."""
        self._notified = True
        self._poke.set()

    async def run(self) -> None:
        """Read the row at least every REFRESH_S, and at once when a notification did not
        carry the state; try a failed write again (a backstop: it retries by itself).
        Runs until cancelled."""
        while True:
            wait = max(0.01, REFRESH_S - (self._clock() - self.read_at))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._poke.wait()
            self._poke.clear()
            try:
                if self._write_failed:
                    self.kick()
                if self._notified or self._clock() - self.read_at >= REFRESH_S:
                    self._notified = False
                    await self.refresh()
            except Exception as exc:
                self._fault("refresh", exc)
                await asyncio.sleep(REFRESH_S)  # the database is away: again in a second
            else:
                self._mended("refresh")

    # -- writing the row -------------------------------------------------------------

    def event(self, event: Throttle | Announce | Pause | Resume,
              now: float,
              paced_cut: float | None = None) -> None:
        """Apply ``event`` here at once, and to the row soon."""
        pending = Pending(event, now, paced_cut)
        new = apply(self.cfg, self.state, pending)
        if new == self.state and not isinstance(event, Throttle):
            return  # nothing changes: nothing to write
        if voids(self.cfg, self.state, new, now):
            self._on_void()  # this replica's slots at once; the row's epoch voids everyone's
        self._set(new)
        self.pending.append(pending)
        self._cas = None
        self.kick()

    def success(self, now: float, sent_at: float = 0.0) -> None:
        old = self.state
        new = policy.step(self.cfg, old, Success(sent_at), now)
        self._set(new)
        if new.began != old.began and self.pending:
            # The run's first request, behind events still to be written: the row takes
            # it after them, or the write of those would drop when the run began (what
            # the partner's burst is measured from).
            self.pending.append(Pending(Success(sent_at), now))
            self.kick()
            return
        if replace(new, rate=0.0) != replace(old, rate=0.0) and not self.pending:
            # Blind reset, a plateau verified, w_max dropped at the top: for everyone.
            self._cas = (self.version, new)
            self.kick()

    async def save(self) -> None:
        """Wait for the writes still pending (one attempt: not for the database to come
        back)."""
        if self.pending or self._cas is not None:
            self.kick()
        if self.writer is not None and not self.writer.done():
            await asyncio.wait([self.writer])

    def kick(self) -> None:
        if self.closed:
            return
        if self.writer is None or self.writer.done():
            self.writer = asyncio.get_running_loop().create_task(
                self._write_all(), name="budget-write")

    async def _write_all(self) -> None:
        while self.pending or self._cas is not None:
            try:
                if self.pending:
                    await self._write_events()
                    continue
                assert self._cas is not None
                (version, state), self._cas = self._cas, None
                if version == self.version:
                    seq = self.next_seq()
                    written = await self._table.compare_and_set(version, state.to_dict())
                    if written is not None:
                        self.adopt(written, seq)
            except Exception as exc:
                # Kept, in order, and tried again soon: a cut must never be lost. Not in
                # this task: save() waits for this attempt only, not for the database.
                self._write_failed = True
                self._fault("write", exc)
                asyncio.get_running_loop().call_later(self._write_retry_s, self.kick)
                self._write_retry_s = min(REFRESH_S, 2 * self._write_retry_s)
                return
        self._write_failed = False
        self._write_retry_s = WRITE_RETRY_S
        self._mended("write")

    async def _write_events(self) -> None:
        """Every pending event in one transaction on the row, in order."""
        batch = list(self.pending)
        seq = self.next_seq()
        self._writing = True
        try:
            row = await self._table.locked(
                lambda row: with_events(self.cfg, row, batch, self._clock()))
            for _ in batch:
                self.pending.popleft()  # events added meanwhile stay, for the next round
            self.adopt(row, seq)
        finally:
            # Now the events are either in the newest state read, or still pending.
            self._writing = False
            self._recompute()
