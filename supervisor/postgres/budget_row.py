"""The shared budget's row in PostgreSQL: one per budget key (a partner base URL), every
statement the shared budget (:mod:`supervisor.postgres.budget`) runs on it, and the pure
decisions taken under its lock (the policy's events on the shared state, a new life).

The row holds the policy's state (``BudgetState.to_dict()``), the configured quotas' slots
(``RollingQuota.to_list()`` by name), ``next_at`` (the GCRA theoretical arrival time:
the wall-clock second the next reserved slot starts at), ``version`` (bumped on every
change of ``state``, never by a reservation), ``epoch`` (bumped when reservations made so
far are void: the rate dropped or a pause began) and ``updated_at``.

Every method of :class:`BudgetTable` is one statement, or one short transaction holding
the row lock while Python decides (:meth:`BudgetTable.locked`). ``statements`` counts what
was sent, BEGIN and COMMIT included, so a benchmark can print the cost per grant.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import asyncpg

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
from supervisor.postgres.connect import Migration, channel

TABLE = "rate_budget"

MIGRATIONS: tuple[Migration, ...] = (
    Migration("budget", 1, (
        f"""CREATE TABLE IF NOT EXISTS {TABLE} (
            key TEXT PRIMARY KEY,
            state JSONB NOT NULL,
            quotas JSONB NOT NULL DEFAULT '{{}}'::jsonb,
            next_at DOUBLE PRECISION NOT NULL DEFAULT 0,
            epoch BIGINT NOT NULL DEFAULT 0,
            version BIGINT NOT NULL DEFAULT 1,
            updated_at TIMESTAMPTZ NOT NULL DEFAULT now())""",
    )),
)

# Two cut times this close are the same cut: one is a copy of the other, and the margin
# only guards their round trip through JSON.
SAME_CUT_S = 1e-6

_COLUMNS = "state::text AS state, quotas::text AS quotas, next_at, epoch, version"
# The notification carries the new state (well under 1 KB), so a listener need not read the
# row; a key too long for the payload limit (8000 bytes) sends only the version.
_NOTIFY = ("pg_notify($%d, CASE WHEN octet_length(key) < 4000 THEN json_build_object("
           "'key', key, 'version', version, 'epoch', epoch, 'state', state)::text "
           "ELSE version::text END) AS notified")


@dataclass(frozen=True, slots=True)
class Row:
    state: dict[str, Any] | None
    quotas: dict[str, Any] | None  # None: not read (a notification)
    next_at: float
    epoch: int
    version: int


@dataclass(frozen=True, slots=True)
class Change:
    """What a decision under the row lock writes; ``None`` fields stay as they are."""

    state: dict[str, Any] | None = None  # a new policy state: the version moves on
    quotas: dict[str, Any] | None = None
    next_at: float | None = None
    void: bool = False  # reservations made so far are void: the epoch moves on
    notify: bool = False  # tell every replica (in the same transaction)


@dataclass(frozen=True, slots=True)
class Pending:
    """An event a replica applied to its own state, to apply to the row's too. A 429's
    ``paced_cut`` is the ``cut_at`` of the state its request was paced under, as the
    replica knew it (None: not known, its ``sent_at`` decides alone)."""

    event: Throttle | Announce | Pause | Resume | Success
    now: float
    paced_cut: float | None = None


def parse(data: dict[str, Any] | None) -> BudgetState | None:
    """The policy's state from the row; None when it cannot be read."""
    try:
        return None if data is None else BudgetState.from_dict(data)
    except (TypeError, ValueError):
        return None


def live(cfg: PolicyConfig, state: BudgetState, now: float) -> BudgetState:
    """``state`` with the rate the recovery gives at ``now``: the row's ``rate`` is only
    written when something else changes, every replica computes it from time."""
    rate = policy.curve(cfg, state, now)
    return state if rate == state.rate else replace(state, rate=rate)


def apply(cfg: PolicyConfig, state: BudgetState, pending: Pending) -> BudgetState:
    event = pending.event
    if isinstance(event, Throttle):
        # The policy trims what was being paced: the rate the curve gives by then.
        state = live(cfg, state, pending.now)
        if pending.paced_cut is not None:
            event = replace(event, sent_at=_sent_at(event.sent_at, pending.paced_cut,
                                                    state.cut_at))
    return policy.step(cfg, state, event, pending.now)


def _sent_at(sent_at: float, paced_cut: float, cut_at: float) -> float:
    """When a 429's request counts as sent, for the policy's one cut per episode
    (``sent_at >= cut_at`` cuts). Across replicas the two times come from two clocks, and
    a replica hears of another's cut only some milliseconds later: a request it granted
    meanwhile, from a slot reserved before the cut, was sent at the old rate, yet would
    count as after the cut and cut again (halving: the policy reads it as refused at once
    after resuming). So what the replica knew decides: paced under an older cut than the
    row's, the request is part of the episode that cut; paced under the row's latest, its
    429 is news, whatever the clocks say."""
    if cut_at > paced_cut + SAME_CUT_S:
        return min(sent_at, cut_at - SAME_CUT_S)
    return max(sent_at, cut_at)


def voids(cfg: PolicyConfig, before: BudgetState, after: BudgetState, now: float) -> bool:
    """Whether slots reserved under ``before`` must not be used under ``after``: the rate
    dropped, pacing turned strict, or a pause began."""
    return (after.paused_until > max(before.paused_until, now)
            or (after.strict and not before.strict)
            or policy.curve(cfg, after, now) < policy.curve(cfg, before, now))


def with_events(cfg: PolicyConfig, row: Row, batch: list[Pending], now: float) -> Change | None:
    """The row's state with a replica's events applied in order; a cut or a pause voids
    the reservations made so far (the next slot is one interval from now at the new rate,
    or the pause's end) and every replica is told."""
    before = parse(row.state) or policy.initial(cfg)
    after = before
    for pending in batch:
        after = apply(cfg, after, pending)
    if after == before:
        return None
    if any(isinstance(p.event, Resume) for p in batch):
        # The pause lifted: the next slot is now, not where the pause had moved it; what
        # was reserved for after the pause is void.
        next_at = max(after.paused_until, now)
        return Change(state=after.to_dict(), next_at=next_at, void=True, notify=True)
    if not voids(cfg, before, after, now):
        return Change(state=after.to_dict(), notify=True)
    next_at = max(after.paused_until, now + 1.0 / policy.curve(cfg, after, now))
    return Change(state=after.to_dict(), next_at=next_at, void=True, notify=True)


def restored(quota: RollingQuota, row: Row, now: float) -> RollingQuota:
    """``quota`` as the row counts it."""
    fresh = RollingQuota(quota.name, quota.limit, quota.window_s)
    fresh.restore((row.quotas or {}).get(quota.name), now)
    return fresh


def new_life(cfg: PolicyConfig, row: Row, quotas: list[RollingQuota], now: float) -> Change:
    """policy.remembered on the row, by the first replica of a new life: a learnt limit
    drifts back, a pause in force is kept (and no slot starts before it ends), one longer
    than any pause may be is dropped (and the slots with it)."""
    state = policy.remembered(cfg, parse(row.state) or policy.initial(cfg), now)
    next_at = row.next_at if row.next_at <= now + cfg.max_pause_s else now
    return Change(state=state.to_dict(), void=True,
                  quotas={q.name: restored(q, row, now).to_list() for q in quotas},
                  next_at=max(next_at, state.paused_until))


def notified(payload: str) -> tuple[str | None, int | None, Row | None]:
    """A notification's key, version and, when it carries the state, the row as it says
    (None for whatever it does not tell)."""
    try:
        data = json.loads(payload)
    except ValueError:
        return None, None, None
    if isinstance(data, int):
        return None, data, None
    if not isinstance(data, dict):
        return None, None, None
    key, version, epoch, state = (data.get(k) for k in ("key", "version", "epoch", "state"))
    if not isinstance(version, int) or not isinstance(epoch, int) or not isinstance(state, dict):
        return key if isinstance(key, str) else None, None, None
    return key, version, Row(state=state, quotas=None, next_at=0.0, epoch=epoch,
                             version=version)


def _loads(text: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _row(rec: asyncpg.Record) -> Row:
    return Row(state=_loads(rec["state"]), quotas=_loads(rec["quotas"]) or {},
               next_at=float(rec["next_at"]), epoch=int(rec["epoch"]),
               version=int(rec["version"]))


class BudgetTable:
    """The statements of one budget key, on the process's pool."""

    def __init__(self, pool: asyncpg.Pool, key: str, schema: str) -> None:
        self._pool = pool
        self.key = key
        self.channel = channel(schema, "budget")
        self.statements = 0

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy]:
        async with self._pool.acquire() as conn:
            self.statements += 2  # BEGIN, COMMIT (or ROLLBACK)
            async with conn.transaction():
                yield conn

    async def open(self, initial: dict[str, Any],
                   remember: Callable[[Row], Change | None] | None) -> tuple[Row, float]:
        """Insert the row if it is missing; with ``remember`` (no other replica is alive:
        a new life) apply what it decides to an existing row, under its lock so it happens
        once. Returns the row and the database's clock (epoch seconds)."""
        async with self._transaction() as conn:
            self.statements += 2
            inserted = await conn.fetchval(
                f"INSERT INTO {TABLE} (key, state) VALUES ($1, $2::jsonb) "
                "ON CONFLICT (key) DO NOTHING RETURNING version", self.key, json.dumps(initial))
            rec = await conn.fetchrow(
                f"SELECT {_COLUMNS}, extract(epoch from clock_timestamp())::float8 AS db_now "
                f"FROM {TABLE} WHERE key = $1 FOR UPDATE", self.key)
            assert rec is not None  # inserted or already there, and locked
            row, db_now = _row(rec), float(rec["db_now"])
            change = remember(row) if remember is not None and inserted is None else None
            if row.state is None and change is None:
                change = Change(state=initial)  # unreadable: start afresh
            if change is not None:
                row = await self._update(conn, change)
        return row, db_now

    async def read(self) -> Row | None:
        async with self._pool.acquire() as conn:
            self.statements += 1
            rec = await conn.fetchrow(f"SELECT {_COLUMNS} FROM {TABLE} WHERE key = $1", self.key)
        return None if rec is None else _row(rec)

    async def reserve(self, earliest: float, span: float, version: int) -> tuple[float, int] | None:
        """Reserve ``span`` seconds of slots in one statement: they start at
        ``max(next_at, earliest)`` and ``next_at`` moves past them. Only while the state is
        still ``version`` (the rate and tolerance were computed from it); ``None`` when it
        is not. Returns (first slot, epoch)."""
        async with self._pool.acquire() as conn:
            self.statements += 1
            rec = await conn.fetchrow(
                f"UPDATE {TABLE} SET next_at = greatest(next_at, $2::float8) + $3::float8, "
                "updated_at = now() WHERE key = $1 AND version = $4 RETURNING next_at, epoch",
                self.key, earliest, span, version)
        return None if rec is None else (float(rec["next_at"]) - span, int(rec["epoch"]))

    async def locked(self, decide: Callable[[Row], Change | None]) -> Row:
        """SELECT ... FOR UPDATE, let ``decide`` compute the change in Python, write it.
        Returns the row as it stands at the end."""
        async with self._transaction() as conn:
            self.statements += 1
            rec = await conn.fetchrow(
                f"SELECT {_COLUMNS} FROM {TABLE} WHERE key = $1 FOR UPDATE", self.key)
            if rec is None:
                raise LookupError(f"no budget row for {self.key}")
            row = _row(rec)
            change = decide(row)
            if change is not None:
                row = await self._update(conn, change)
        return row

    async def _update(self, conn: asyncpg.pool.PoolConnectionProxy, change: Change) -> Row:
        self.statements += 1
        rec = await conn.fetchrow(
            f"UPDATE {TABLE} SET state = coalesce($2::jsonb, state), "
            "quotas = coalesce($3::jsonb, quotas), next_at = coalesce($4::float8, next_at), "
            "version = version + (CASE WHEN $2::jsonb IS NULL THEN 0 ELSE 1 END), "
            "epoch = epoch + $5::int, updated_at = now() "
            f"WHERE key = $1 RETURNING {_COLUMNS}"
            + (", " + _NOTIFY % 6 if change.notify else ""),
            self.key, None if change.state is None else json.dumps(change.state),
            None if change.quotas is None else json.dumps(change.quotas), change.next_at,
            1 if change.void else 0, *((self.channel,) if change.notify else ()))
        assert rec is not None  # the row is locked by this transaction
        return _row(rec)

    async def compare_and_set(self, version: int, state: dict[str, Any]) -> Row | None:
        """Write ``state`` only over ``version``, and tell everyone; ``None`` when another
        write came first (the caller skips: its own change is derived again if it still
        holds)."""
        async with self._pool.acquire() as conn:
            self.statements += 1
            rec = await conn.fetchrow(
                f"UPDATE {TABLE} SET state = $2::jsonb, version = version + 1, "
                f"updated_at = now() WHERE key = $1 AND version = $3 RETURNING {_COLUMNS}, "
                + _NOTIFY % 4, self.key, json.dumps(state), version, self.channel)
        return None if rec is None else _row(rec)
