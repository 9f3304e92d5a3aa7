"""The rate budget shared through PostgreSQL: several PostgresBudget instances, each with a
pool and a LISTEN connection of its own, stand in for replicas in one process (and, in
the last test, real processes). Real PostgreSQL (the ``pg`` fixture), real clocks, short
runs; synchronisation by polling a condition with a deadline, never by a bare sleep.
The database is taken away from one replica by a TCP proxy in front of it (the server is
shared: it is never stopped, and no session but a test's own is ever ended)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from supervisor.budget import policy
from supervisor.budget.base import Feedback, Grant, Outcome, Policy
from supervisor.budget.policy_state import BudgetState, PolicyConfig, Throttle
from supervisor.budget.settings import LimitsConfig, QuotaConfig
from supervisor.postgres import listen as pg_listen
from supervisor.postgres.budget import MIGRATIONS, PostgresBudget
from supervisor.postgres.connect import create_pool, migrate

KEY = "http://partner"
CEILING = 50.0
BURST = LimitsConfig().burst
OK = Feedback(Outcome.OK, 0.001)
ROOT = str(Path(__file__).resolve().parents[2])  # the repository, for the replica processes

Make = Callable[..., Awaitable[PostgresBudget]]


class PgSchema(Protocol):
    dsn: str
    schema: str


def limits(**overrides: Any) -> LimitsConfig:
    return LimitsConfig(**{"rate_per_second": CEILING, "concurrency": 8, **overrides})


class Proxy:
    """A TCP proxy in front of PostgreSQL, to take the database away from the replicas
    connected through it. ``down()`` drops every connection and refuses new ones until
    ``up()``; ``freeze()`` lets no link carry anything, open or opened later, until
    ``thaw()`` (a partition); ``forget()`` silences the links open now for good while new
    ones go through (a NAT or a firewall that forgot them: nobody is told)."""

    def __init__(self, dsn: str) -> None:
        self._target = urlsplit(dsn)
        self._refusing = False
        self._frozen = False
        self._links: dict[asyncio.Task[Any], tuple[list[asyncio.StreamWriter], asyncio.Event]] = {}
        self._forgotten: list[asyncio.Event] = []
        self._server: asyncio.Server | None = None
        self.dsn = dsn

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        user, _, _ = self._target.netloc.rpartition("@")
        self.dsn = urlunsplit(self._target._replace(
            netloc=f"{user}@127.0.0.1:{port}" if user else f"127.0.0.1:{port}"))
        return self

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            writer.transport.abort()
            return
        gate = asyncio.Event()
        if not self._frozen:
            gate.set()
        ends = [writer]
        task = asyncio.current_task()
        assert task is not None
        self._links[task] = (ends, gate)
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self._target.hostname, self._target.port or 5432)
            ends.append(up_writer)
            await asyncio.gather(self._pump(reader, up_writer, gate),
                                 self._pump(up_reader, writer, gate))
        except OSError:
            pass
        finally:
            for end in ends:
                end.transport.abort()
            del self._links[task]

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    gate: asyncio.Event) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                await gate.wait()
                dst.write(data)
                await dst.drain()
        dst.transport.abort()

    def down(self) -> None:
        self._refusing = True
        for ends, _ in self._links.values():
            for end in ends:
                end.transport.abort()

    def up(self) -> None:
        self._refusing = False

    def freeze(self) -> None:
        self._frozen = True
        for _, gate in self._links.values():
            gate.clear()

    def thaw(self) -> None:
        self._frozen = False
        for _, gate in self._links.values():
            if gate not in self._forgotten:
                gate.set()

    def forget(self) -> None:
        for _, gate in self._links.values():
            gate.clear()
            self._forgotten.append(gate)

    async def close(self) -> None:
        self.down()
        for _, gate in self._links.values():
            gate.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await asyncio.gather(*self._links, return_exceptions=True)


@pytest.fixture
async def proxies(pg: PgSchema) -> AsyncIterator[Callable[[], Awaitable[Proxy]]]:
    """``await proxy()``: a proxy in front of the test's PostgreSQL, closed at the end
    (after every replica: ``replicas`` depends on this fixture)."""
    made: list[Proxy] = []

    async def proxy() -> Proxy:
        made.append(await Proxy(pg.dsn).start())
        return made[-1]

    try:
        yield proxy
    finally:
        for p in made:
            await p.close()


@pytest.fixture
async def replicas(pg: PgSchema, proxies: object) -> AsyncIterator[Make]:
    """``await make(**limits)``: one more replica, started, on a pool of its own;
    ``pool_dsn`` and ``listen_dsn`` route its pool or its LISTEN connection elsewhere
    (a proxy)."""
    pools: list[asyncpg.Pool] = []
    budgets: list[PostgresBudget] = []

    async def make(pool_dsn: str | None = None, listen_dsn: str | None = None,
                   **overrides: Any) -> PostgresBudget:
        pool = await create_pool(pool_dsn or pg.dsn, pg.schema, min_size=1, max_size=4)
        pools.append(pool)
        await migrate(pool, pg.schema, MIGRATIONS)
        budget = PostgresBudget(limits(**overrides), KEY, pool, listen_dsn or pg.dsn,
                                pg.schema)
        budgets.append(budget)
        await budget.start()
        return budget

    try:
        yield make
    finally:
        for budget in budgets:
            await budget.close()
        for pool in pools:
            await pool.close()


async def until(condition: Callable[[], bool], deadline_s: float) -> float:
    """Poll ``condition`` every millisecond; the seconds it took (TimeoutError past the
    deadline)."""
    started = time.monotonic()
    async with asyncio.timeout(deadline_s):
        while not condition():  # noqa: ASYNC110 - a snapshot to poll, no event to await
            await asyncio.sleep(0.001)
    return time.monotonic() - started


async def work(budget: PostgresBudget, grants: list[float], stop: float) -> None:
    """One worker: requests answered at once, until the wall-clock time ``stop``."""
    while True:
        grant = await budget.acquire()
        budget.release(grant, OK)
        if grant.at >= stop:
            return
        grants.append(grant.at)


def busiest_second(times: list[float]) -> int:
    """The most grants in any window [t, t + 1 s)."""
    times = sorted(times)
    return max((bisect.bisect_left(times, t + 1.0) - i for i, t in enumerate(times)), default=0)


async def shared_row(pg: PgSchema) -> tuple[BudgetState, int]:
    """The row's state and version, read apart from every replica."""
    conn = await asyncpg.connect(pg.dsn)
    try:
        row = await conn.fetchrow(f'SELECT state::text, version FROM "{pg.schema}".rate_budget '
                                  "WHERE key = $1", KEY)
    finally:
        await conn.close()
    assert row is not None
    return BudgetState.from_dict(json.loads(row["state"])), row["version"]


async def shared_state(pg: PgSchema) -> BudgetState:
    return (await shared_row(pg))[0]


async def test_the_aggregate_never_exceeds_the_ceiling_and_costs_little(
        replicas: Make) -> None:
    budgets = [await replicas() for _ in range(3)]
    before = sum(b.statements for b in budgets), sum(b.grants for b in budgets)
    grants: list[list[float]] = [[] for _ in budgets]
    stop = time.time() + 2.5
    await asyncio.gather(*(work(b, grants[i], stop) for i, b in enumerate(budgets)
                           for _ in range(6)))
    statements = sum(b.statements for b in budgets) - before[0]
    granted = sum(b.grants for b in budgets) - before[1]
    everything = [t for per_replica in grants for t in per_replica]
    print(f"\n{len(everything)} grants in 2.5 s, busiest second {busiest_second(everything)}, "
          f"{statements / granted:.3f} statements per grant, "
          f"{sum(b.reservations for b in budgets)} reservations")
    assert busiest_second(everything) <= CEILING + BURST
    assert len(everything) >= 0.9 * 2.5 * CEILING * (1 - LimitsConfig().headroom)
    assert all(len(g) > 0.15 * len(everything) for g in grants)  # every replica has a share
    assert statements / granted < 0.5


async def test_every_grant_says_when_its_slot_was_paced(replicas: Make) -> None:
    # Slots are reserved ahead, at the rate of their reservation: a 429 hands that time
    # to the policy (Throttle.paced_at), which measures a probe at the pace it had.
    budgets = [await replicas() for _ in range(3)]
    seen: list[Grant] = []
    began = time.time()

    async def worker(budget: PostgresBudget) -> None:
        for _ in range(15):
            grant = await budget.acquire()
            budget.release(grant, OK)
            seen.append(grant)

    await asyncio.gather(*(worker(b) for b in budgets for _ in range(3)))
    assert len(seen) == 135
    paced = [g.paced_at for g in seen]
    assert all(p is not None for p in paced)
    # Reserved in this test, before the grant, and at most a block (0.2 s at the rate)
    # plus a busy host's round trips ahead of it.
    assert all(began <= g.paced_at <= g.at < g.paced_at + 1.0 for g in seen
               if g.paced_at is not None)


async def test_a_429_on_one_replica_cuts_the_rate_of_every_replica_at_once(
        replicas: Make) -> None:
    a, b, c = [await replicas() for _ in range(3)]
    before = b.snapshot().rate
    grant = await a.acquire()
    a.release(grant, Feedback(Outcome.THROTTLED, 0.001, retry_after_s=0.5))
    cut = a.snapshot().rate
    assert cut < before  # this replica at once
    took = await until(lambda: b.snapshot().rate < before and c.snapshot().rate < before, 0.1)
    print(f"\nthe cut reached the other replicas in {1000 * took:.1f} ms")
    assert b.snapshot().rate == pytest.approx(cut)
    assert c.snapshot().paused_until == a.snapshot().paused_until


async def test_a_retry_after_pause_holds_every_worker_of_every_replica(
        replicas: Make) -> None:
    a, b, c = [await replicas() for _ in range(3)]
    grants: list[float] = []
    stop = time.time() + 30
    workers = [asyncio.create_task(work(r, grants, stop)) for r in (b, c) for _ in range(4)]
    try:
        await until(lambda: len(grants) >= 10, 2.0)  # b and c are sending
        a.release(await a.acquire(), Feedback(Outcome.THROTTLED, 0.001, retry_after_s=0.6))
        paused_at, until_t = time.time(), a.snapshot().paused_until
        await until(lambda: b.snapshot().paused_until == c.snapshot().paused_until == until_t,
                    0.1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(b.acquire(), 0.3)  # a worker that arrives now waits too
        await until(lambda: any(t >= until_t for t in grants), 2.0)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    # Nothing left b or c once the pause was known (within 100 ms of the 429).
    assert not [t for t in grants if paused_at + 0.1 <= t < until_t]


async def test_a_pause_survives_every_replica_and_a_new_life_remembers_once(
        replicas: Make, pg: PgSchema) -> None:
    a, b = await replicas(), await replicas()
    a.release(await a.acquire(), Feedback(Outcome.THROTTLED, 0.001, retry_after_s=1.0))
    learnt = a.snapshot().state.w_max
    assert learnt is not None
    until_t = time.time() + 600
    b.pause(until_t, "maintenance")
    await a.save()
    await b.save()
    await a.close()
    await b.close()

    # Two replicas starting together after all were gone: the new life is applied once.
    c, d = await asyncio.gather(replicas(), replicas())
    for r in (c, d):
        snap = r.snapshot()
        assert snap.paused_until == pytest.approx(until_t)
        assert snap.state.pause_reason == "maintenance"
        assert snap.state.w_max == pytest.approx(learnt * policy.PROBE_BACK)
    assert (await shared_state(pg)).w_max == pytest.approx(learnt * policy.PROBE_BACK)
    # One joining a live budget takes it as it is.
    e = await replicas()
    assert e.snapshot().state.w_max == pytest.approx(learnt * policy.PROBE_BACK)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(e.acquire(), 0.2)


async def test_one_429_storm_seen_by_three_replicas_cuts_once(
        replicas: Make, pg: PgSchema) -> None:
    budgets = [await replicas() for _ in range(3)]
    initial = budgets[0].snapshot().state
    grants = [await b.acquire() for b in budgets]  # all sent before any cut
    for b, g in zip(budgets, grants, strict=True):
        b.release(g, Feedback(Outcome.THROTTLED, 0.001, retry_after_s=1.0))
    await asyncio.gather(*(b.save() for b in budgets))
    shared = await shared_state(pg)
    cfg = PolicyConfig.from_limits(limits())
    once = policy.step(cfg, initial, Throttle(grants[0].at, 1.0), time.time())
    assert shared.rate == pytest.approx(once.rate)  # one edge trim, not three
    assert shared.w_max == pytest.approx(once.w_max)
    await until(lambda: all(b.snapshot().state.cut_at == shared.cut_at for b in budgets), 1.5)
    assert {round(b.snapshot().rate, 6) for b in budgets} == {round(once.rate, 6)}


async def test_a_configured_quota_is_shared_by_every_replica(replicas: Make) -> None:
    quota = (QuotaConfig(limit=30, period_seconds=60.0, name="thirty"),)
    budgets = [await replicas(quota=quota) for _ in range(3)]
    grants: list[float] = []
    stop = time.time() + 30
    workers = [asyncio.create_task(work(b, grants, stop)) for b in budgets for _ in range(4)]
    try:
        await until(lambda: len(grants) >= 30, 3.0)
        with pytest.raises(TimeoutError):
            await until(lambda: len(grants) > 30, 0.3)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    assert len(grants) == 30  # not 90
    for b in budgets:
        (view,) = b.snapshot().quotas
        assert (view.name, view.remaining) == ("thirty", 0)
        assert b.snapshot().held_for(time.time()) > 50


async def test_a_lost_listen_connection_is_reconnected(replicas: Make, pg: PgSchema) -> None:
    a, b = await replicas(), await replicas()
    listen = b._listener.conn  # white box: the connection to cut
    assert listen is not None
    conn = await asyncpg.connect(pg.dsn)
    try:
        await conn.execute("SELECT pg_terminate_backend($1)", listen.get_server_pid())
    finally:
        await conn.close()
    before = b.snapshot().rate
    a.release(await a.acquire(), Feedback(Outcome.THROTTLED, 0.001, retry_after_s=0.2))
    # The notification is lost; the next read (at most a second on) or the reconnection
    # brings the cut anyway.
    await until(lambda: b.snapshot().rate < before, 1.5)
    await until(lambda: b._listener.conn is not None and b._listener.conn is not listen
                and not b._listener.conn.is_closed(), 1.5)


async def test_successes_write_only_what_time_does_not_give(
        replicas: Make, pg: PgSchema) -> None:
    a, b = await replicas(), await replicas()
    a.release(await a.acquire(), Feedback(Outcome.THROTTLED, 0.001, retry_after_s=None))
    await a.save()
    assert (await shared_state(pg)).blind == 1  # our own backoff, doubling per 429 in a row
    await until(lambda: b.snapshot().state.blind == 1, 0.1)
    b.release(await b.acquire(), OK)  # the first success ends the run of 429s: for everyone
    await b.save()
    state, version = await shared_row(pg)
    assert state.blind == 0
    await until(lambda: a.snapshot().state.blind == 0, 0.1)
    for _ in range(3):  # the recovery climbs with time: nothing for the row
        b.release(await b.acquire(), OK)
    await b.save()
    assert (await shared_row(pg))[1] == version


async def test_an_announced_limit_is_shared_and_written_once(
        replicas: Make, pg: PgSchema) -> None:
    a, b = await replicas(), await replicas()
    announced = Feedback(Outcome.OK, 0.001,
                         policies=(Policy("default", 30, 1.0, remaining=10, reset_s=1.0),))
    a.release(await a.acquire(), announced)
    assert a.snapshot().state.announced == 30.0
    await until(lambda: b.snapshot().state.announced == 30.0, 0.1)
    assert b.snapshot().rate <= 30.0
    await a.save()
    version = (await shared_row(pg))[1]
    a.release(await a.acquire(), announced)  # the same again changes nothing
    await a.save()
    assert (await shared_row(pg))[1] == version


async def test_when_the_run_began_reaches_the_row_behind_an_announcement(
        replicas: Make, pg: PgSchema) -> None:
    # The first answer carries both an announced policy (an event to write) and the run's
    # first success, which the partner's burst is measured from (policy._measured): the
    # row must keep both, or the replica adopting it forgets when the run began.
    a, b = await replicas(), await replicas()
    grant = await a.acquire()
    a.release(grant, Feedback(Outcome.OK, 0.001,
                              policies=(Policy("default", 80, 1.0, remaining=10, reset_s=1.0),)))
    await a.save()
    state, _ = await shared_row(pg)
    assert state.announced == 80.0
    assert state.began == grant.at
    await until(lambda: b.snapshot().state.began == grant.at, 0.1)


async def test_a_failed_write_is_retried_and_the_cut_never_lost(replicas: Make) -> None:
    a, b = await replicas(), await replicas()
    before = b.snapshot().rate
    locked, calls = a._table.locked, 0  # white box: the row's database fails once

    async def flaky(decide: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("connection reset by peer")
        return await locked(decide)

    a._table.locked = flaky  # type: ignore[method-assign]
    a.release(await a.acquire(), Feedback(Outcome.THROTTLED, 0.001, retry_after_s=0.3))
    cut = a.snapshot().rate
    assert cut < before
    await a.save()  # the write fails: logged, kept, not raised
    assert calls == 1
    # Retried within moments (not at the next read, a second on), and every replica
    # learns it within the 100 ms a cut may take.
    await until(lambda: b.snapshot().rate == pytest.approx(cut), 0.15)
    assert calls == 2
    assert a.snapshot().rate == pytest.approx(cut)  # a's own reads never undid it meanwhile


async def test_its_own_notification_first_does_not_apply_a_429_twice(
        replicas: Make, pg: PgSchema) -> None:
    a = await replicas()
    locked = a._table.locked  # white box: the NOTIFY of a write overtakes its answer
    seen: list[int] = []

    async def notified_first(decide: Any) -> Any:
        row = await locked(decide)
        a._view.on_notify(json.dumps({"key": KEY, "version": row.version,
                                      "epoch": row.epoch, "state": row.state}))
        seen.append(a.snapshot().state.blind)  # the view, before the writer's answer
        return row

    a._table.locked = notified_first  # type: ignore[method-assign]
    a.release(await a.acquire(), Feedback(Outcome.THROTTLED, 0.001, retry_after_s=None))
    await a.save()
    shared = await shared_state(pg)
    assert shared.blind == 1
    # Never two 429s in a row: the backoff did not double, not even for a moment.
    assert seen == [1]
    assert a.snapshot().state.blind == 1
    assert a.snapshot().paused_until == shared.paused_until



Proxies = Callable[[], Awaitable[Proxy]]
THROTTLED_NOW = Feedback(Outcome.THROTTLED, 0.001, retry_after_s=0.0)  # a cut, no pause


@pytest.mark.parametrize("reset", [
    "DELETE FROM {schema}.rate_budget",  # by hand: the row is put back, fresh
    "UPDATE {schema}.rate_budget SET version = 1, epoch = 0",  # a failover lost writes
])
async def test_a_row_that_went_back_is_taken_as_it_is_and_nothing_hangs(
        replicas: Make, pg: PgSchema, reset: str) -> None:
    a, b = await replicas(), await replicas()
    for _ in range(3):  # versions move on
        a.release(await a.acquire(), THROTTLED_NOW)
        await a.save()
    conn = await asyncpg.connect(pg.dsn)
    try:
        await conn.execute(reset.format(schema=f'"{pg.schema}"'))
    finally:
        await conn.close()
    statements = a.statements
    # Both replicas go on (before: every reservation refused, for ever, in a tight loop).
    for r in (a, b):
        r.release(await asyncio.wait_for(r.acquire(), 2.5), OK)
    assert a.statements - statements < 100
    # And they hear each other again.
    await until(lambda: a._view.version == b._view.version, 1.5)
    before = b.snapshot().rate
    a.release(await asyncio.wait_for(a.acquire(), 1.0), THROTTLED_NOW)
    await until(lambda: b.snapshot().rate < before, 0.1)


async def test_close_returns_while_postgres_does_not_answer(
        replicas: Make, proxies: Proxies) -> None:
    proxy = await proxies()
    a = await replicas(pool_dsn=proxy.dsn, listen_dsn=proxy.dsn)
    grants: list[float] = []
    workers = [asyncio.create_task(work(a, grants, time.time() + 30)) for _ in range(3)]
    try:
        await until(lambda: len(grants) >= 5, 2.0)
        grant = await a.acquire()
        proxy.freeze()  # a partition: nothing arrives, nothing is refused
        a.release(grant, THROTTLED_NOW)  # a write, stuck in the database
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        started = time.monotonic()
        # A caller's deadline holds (before, close() took the cancellation for a task's).
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(a.close(), 0.5)
        assert time.monotonic() - started < 1.0
        await asyncio.wait_for(a.close(), 10)  # the same close, on: before, 12 to 30 s
        took = time.monotonic() - started
    finally:
        proxy.thaw()
    print(f"\nclose() took {took:.2f} s with the database away")
    assert took < 5.0


async def test_workers_hold_while_postgres_is_away_and_resume_when_it_is_back(
        replicas: Make, proxies: Proxies) -> None:
    proxy = await proxies()
    a = await replicas(pool_dsn=proxy.dsn, listen_dsn=proxy.dsn)
    grants: list[float] = []
    workers = [asyncio.create_task(work(a, grants, time.time() + 30)) for _ in range(4)]
    try:
        await until(lambda: len(grants) >= 5, 2.0)
        proxy.down()
        await asyncio.sleep(1.0)  # the outage itself: nothing to poll for
        back = time.time()
        proxy.up()
        await until(lambda: grants[-1] > back, 3.0)
        await until(lambda: not a._listener.lost, 3.0)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


async def test_a_listen_connection_dead_in_silence_is_replaced(
        replicas: Make, proxies: Proxies) -> None:
    proxy = await proxies()
    a, b = await replicas(), await replicas(listen_dsn=proxy.dsn)
    dead = b._listener.conn  # white box: the connection that dies in silence
    proxy.forget()  # nothing arrives on it any more, and nobody is told
    await until(lambda: b._listener.conn is not dead and not b._listener.lost,
                pg_listen.PING_S + pg_listen.PING_TIMEOUT_S + 2.0)
    # Notifications flow again: a 429 reaches b within 100 ms (not at b's next read).
    before = b.snapshot().rate
    a.release(await a.acquire(), THROTTLED_NOW)
    await until(lambda: b.snapshot().rate < before, 0.1)


async def test_reads_and_writes_go_on_while_the_listen_connection_cannot_come_back(
        replicas: Make, proxies: Proxies) -> None:
    proxy = await proxies()
    a, b = await replicas(), await replicas(listen_dsn=proxy.dsn)
    proxy.down()  # b's LISTEN connection goes, and cannot be made again
    await until(lambda: b._listener.lost, 1.0)
    before = b.snapshot().rate
    a.release(await a.acquire(), THROTTLED_NOW)
    await until(lambda: b.snapshot().rate < before, 2.0)  # b's reads bring it
    cut = b.snapshot().rate
    b.release(await b.acquire(), Feedback(Outcome.THROTTLED, 0.001, retry_after_s=0.3))
    await until(lambda: a.snapshot().paused_until == b.snapshot().paused_until, 0.5)
    proxy.up()
    await until(lambda: not b._listener.lost, 3.0)
    a.release(await a.acquire(), Feedback(Outcome.THROTTLED, 0.001, retry_after_s=0.5))
    await until(lambda: b.snapshot().paused_until == a.snapshot().paused_until, 0.1)
    assert b.snapshot().rate <= cut


async def test_an_announced_limit_out_of_range_does_not_stop_the_writes(
        replicas: Make, pg: PgSchema) -> None:
    a, b = await replicas(), await replicas()
    # RateLimit-Policy: 100;w=1e-320 parses (a positive, finite window) into an infinite
    # rate, which the row's JSON cannot hold: every later write failed with it, for good.
    absurd = Feedback(Outcome.OK, 0.001, policies=(Policy("default", 100, 1e-320),))
    a.release(await a.acquire(), absurd)
    before = b.snapshot().rate
    a.release(await a.acquire(), THROTTLED_NOW)
    await until(lambda: b.snapshot().rate < before, 0.1)
    await a.save()
    shared = await shared_state(pg)
    assert shared.rate == pytest.approx(a.snapshot().rate)
    assert shared.announced is None  # no limit to keep


async def test_a_replica_late_to_hear_of_a_cut_does_not_cut_again(
        replicas: Make, pg: PgSchema) -> None:
    a, b = await replicas(), await replicas()
    initial = a.snapshot().state
    cfg = PolicyConfig.from_limits(limits())
    mine = await b.acquire()
    a._listener._on_payload = lambda _payload: None  # white box: a hears of b's cut late
    # a reserves one block of slots, 20 ms apart, for as many workers as it lets in.
    pending: set[asyncio.Future[Any]] = {asyncio.ensure_future(a.acquire())
                                         for _ in range(a.snapshot().concurrency_limit)}
    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    b.release(mine, THROTTLED_NOW)  # b cuts, for everyone
    await b.save()
    cut_at = (await shared_state(pg)).cut_at
    done |= (await asyncio.wait(pending))[0]
    late = max((f.result() for f in done), key=lambda g: g.at)
    # The premise: a granted this one after b's cut, from a slot it reserved before it.
    assert late.at > cut_at
    assert a.snapshot().state.cut_at == initial.cut_at
    a.release(late, THROTTLED_NOW)  # the same storm: sent at the old rate
    await a.save()
    once = policy.step(cfg, initial, Throttle(mine.at, 0.0), cut_at)
    shared = await shared_state(pg)
    assert shared.rate == pytest.approx(once.rate)  # one cut, not two
    assert shared.cut_at == cut_at
    await until(lambda: a.snapshot().rate == pytest.approx(once.rate), 1.5)

REPLICA = """
import asyncio, json, sys, time
from supervisor.budget.base import Feedback, Outcome
from supervisor.postgres.budget import MIGRATIONS, PostgresBudget
from supervisor.config import LimitsConfig
from supervisor.postgres.connect import create_pool, migrate

async def main(dsn, schema, key, ceiling, begin, stop):
    pool = await create_pool(dsn, schema, min_size=1, max_size=4)
    await migrate(pool, schema, MIGRATIONS)
    budget = PostgresBudget(LimitsConfig(rate_per_second=ceiling, concurrency=8), key, pool,
                            dsn, schema)
    await budget.start()
    await asyncio.sleep(max(0.0, begin - time.time()))
    grants, before = [], budget.statements

    async def work():
        while True:
            grant = await budget.acquire()
            budget.release(grant, Feedback(Outcome.OK, 0.001))
            if grant.at >= stop:
                return
            grants.append(grant.at)

    await asyncio.gather(*(work() for _ in range(6)))
    print(json.dumps({"grants": grants, "statements": budget.statements - before}))
    await budget.close()
    await pool.close()

asyncio.run(main(*sys.argv[1:4], *map(float, sys.argv[4:])))
"""


async def test_real_processes_share_the_ceiling(pg: PgSchema) -> None:
    begin = time.time() + 1.5  # every process imported, connected and started by then
    stop = begin + 2.0
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", REPLICA, pg.dsn, pg.schema, KEY, str(CEILING), str(begin),
        str(stop), stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT})
        for _ in range(3)]
    outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 15)
    assert all(p.returncode == 0 for p in procs)
    results = [json.loads(out) for out, _ in outputs]
    everything = [t for r in results for t in r["grants"]]
    statements = sum(r["statements"] for r in results)
    print(f"\n3 processes: {len(everything)} grants in 2 s, busiest second "
          f"{busiest_second(everything)}, {statements / len(everything):.3f} statements per "
          "grant")
    assert busiest_second(everything) <= CEILING + BURST
    # Not starved (loosely: three processes on a busy machine lose some slots to late
    # wake-ups, never more than the rate).
    assert len(everything) >= 0.5 * 2.0 * CEILING
    assert all(r["grants"] for r in results)


async def test_an_operator_resume_on_one_replica_lifts_the_pause_for_every_replica(
        replicas: Make, pg: PgSchema) -> None:
    a, b = await replicas(), await replicas()
    a.release(await a.acquire(), Feedback(Outcome.THROTTLED, 0.001, retry_after_s=1.0))
    a.pause(time.time() + 600, "quota x-ratelimit exhausted")
    await a.save()
    await until(lambda: b.snapshot().paused_until > time.time() + 500, 3.0)
    waiter = asyncio.ensure_future(b.acquire())
    done, _ = await asyncio.wait([waiter], timeout=0.2)
    assert not done  # held by the pause a learnt
    a.resume(forget_limit=True)
    await a.save()
    grant = await asyncio.wait_for(waiter, 3.0)  # b's worker goes on: told by the NOTIFY
    b.release(grant, OK)
    assert grant.at < time.time() + 1.0  # no slot left where the pause had moved them
    shared = await shared_state(pg)
    assert (shared.paused_until, shared.w_max) == (0.0, None)
    assert shared.resumed_at > 0
