"""The composition root: the one place that turns a configuration into components.

Storage (ledger, work queue, rate budget, roles), the partner client, the transports
(push, the tick source, the events sinks' Infrai channels), the application's components
and the drain group each belongs to are all chosen and built here; ``Service`` hosts what
this returns, and the CLI's commands (migrate, trigger --via infrai, dlq-redrive) build
what they need here too. Everything opened is entered into a
:class:`~supervisor.lifecycle.Resources` as it is opened, so a failure half-way closes
what was opened before it, in reverse.

Embedded (``ledger.backend = "sqlite"``): one file under the data-dir lock, one process;
leases and in-flight guards left by a previous life are released at start, because their
owner is certainly gone. Scale-out (``"postgres"``): N replicas on one database; nothing is
released at start (its owner may be a live replica), a dead replica's work is released by
whichever replica notices (:class:`~supervisor.postgres.replicas.Membership`), singleton
roles are advisory locks, and one rate budget is shared through the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO, TypeVar

from supervisor import metrics
from supervisor.apistate import ApiState
from supervisor.batch.jobs import JobPoller
from supervisor.budget.base import RateBudget
from supervisor.budget.local import LocalBudget
from supervisor.budget.pair import TwoLimits, item_limits
from supervisor.budget.settings import LimitsConfig
from supervisor.config import Config
from supervisor.consumer import ConsumerPool
from supervisor.errors import QueueError, StartupError, StorageError
from supervisor.events.relay import EventRelay
from supervisor.events.settings import EventsConfig
from supervisor.events.sinks import InfraiSink, Sink, WebhookSink
from supervisor.infrai.channel import InfraiChannel
from supervisor.infrai.push import push_settings
from supervisor.infrai.queue import InfraiQueue
from supervisor.infrai.settings import InfraiConfig
from supervisor.infrai.tick_source import InfraiTicks
from supervisor.ledger.base import LedgerStore
from supervisor.lifecycle import Component, Drain, Resources
from supervisor.monitor import Monitor
from supervisor.partner import PartnerClient
from supervisor.postgres import connect as pg
from supervisor.postgres import sql as pg_sql
from supervisor.postgres.database import PgDatabase
from supervisor.postgres.ledger import PostgresLedger
from supervisor.postgres.queue import PostgresQueue
from supervisor.postgres.replicas import AdvisoryRoles, Membership, new_replica_id
from supervisor.push import PushedQueue, PushEntry, PushReceiver, PushSettings
from supervisor.queue.base import Queue
from supervisor.reconcile import Reconciler
from supervisor.redrive import Redriver
from supervisor.roles import LocalRoles, Roles
from supervisor.runs import RunOpener, RunWatch
from supervisor.scan import Publisher, Scanner
from supervisor.schedule import Scheduler
from supervisor.sqlite.database import Database
from supervisor.sqlite.ledger import SqliteLedger
from supervisor.sqlite.queue import SqliteQueue
from supervisor.ticks import TickPuller, TickSource

log = logging.getLogger(__name__)

# With replicas the last settlement of a run may happen anywhere: the monitor role's
# holder looks for runs to close this often (a statement that changes nothing until then).
FINISH_EVERY_S = 0.25
# A storage fault counts as cleared once commits succeed this long after the last failure.
LEDGER_RECOVER_AFTER_S = 2.0


class DataDirLock:
    """An exclusive lock on the data dir: the SQLite ledger assumes a single process."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "cleanup.lock"
        self._fh: TextIO | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fh = self.path.open("a")
        except OSError as exc:
            raise StartupError(f"data dir {self.path.parent} is not writable: {exc}") from exc
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise StartupError(f"another cleanup-supervisor uses {self.path.parent}") from None
        self._fh = fh

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def pg_migrations() -> tuple[pg.Migration, ...]:
    """Every component's migrations: the ledger's, the queue's (the same tables) and the
    shared budget's."""
    from supervisor.postgres.budget import MIGRATIONS as BUDGET

    return pg_sql.MIGRATIONS + BUDGET


async def migrate(c: Config) -> tuple[str, list[str]]:
    """Apply the migrations the configured ledger lacks: where, and which were applied."""
    if c.ledger.backend == "sqlite":
        db = Database(c.ledger_path)
        try:
            await db.open()  # a SQLite file gains what it lacks at every open
        finally:
            await db.close()
        return str(c.ledger_path), []
    assert c.ledger.dsn is not None  # config validation requires it
    pool = await pg.create_pool(c.ledger.dsn.reveal(), c.ledger.schema, max_size=1)
    try:
        return f"schema {c.ledger.schema}", await pg.migrate(pool, c.ledger.schema,
                                                             pg_migrations())
    finally:
        await pool.close()


def infrai_channel(c: InfraiConfig, queue: str | None = None) -> InfraiChannel:
    """A channel to Infrai queue ``queue``: the work queue (with its dead-letter queue)
    when None; any other queue (ticks, an events sink) has no dead-letter queue."""
    if queue is None:
        return InfraiChannel(c)
    return InfraiChannel(dataclasses.replace(c, queue=queue, dead_letter_queue=""))


@contextlib.asynccontextmanager
async def infrai_session(c: InfraiConfig,
                         queue: str | None = None) -> AsyncIterator[InfraiChannel]:
    """A started channel (:func:`infrai_channel`) for one command, closed after it."""
    channel = infrai_channel(c, queue)
    await channel.start()
    try:
        yield channel
    finally:
        await channel.close()


def tick_source(channel: InfraiChannel) -> TickSource:
    """The ticks waiting on the channel of ``infrai.tick_queue``."""
    return InfraiTicks(channel)


def build_sinks(events: EventsConfig, infrai: InfraiConfig) -> list[Sink]:
    return [InfraiSink(s, infrai_channel(infrai, s.queue)) if s.kind == "infrai"
            else WebhookSink(s) for s in events.sink]


@dataclass
class Storage:
    ledger: LedgerStore
    queue: Queue
    budget: RateBudget
    roles: Roles
    # Set by a write another replica (or this one) made: a run opened, a page discovered.
    wakeups: dict[str, asyncio.Event]
    replica: str = ""
    membership: Membership | None = None
    released: int = 0  # leases handed back at start (SQLite only)
    # How often the holder of the monitor role looks for runs to close.
    finish_every_s: float = 1.0
    storage_healthy: Callable[[], bool] = lambda: True
    describe: str = ""
    # Tasks the storage owns that the service supervises (a SQLite ledger's writer, a
    # replica's heartbeat).
    components: list[Component] = field(default_factory=list)


async def open_storage(c: Config, r: Resources) -> Storage:
    """Open what ``c`` configures; raises StartupError (exit 3) when any part cannot."""
    if c.ledger.backend == "postgres":
        return await _open_postgres(c, r)
    return await _open_sqlite(c, r)


async def _work_queue(c: Config, r: Resources) -> Queue:
    """The work queue outside the ledger's database: Infrai's or a Redis stream."""
    # The brokers' clients are imported by the shape that uses them: together they are
    # a sixth of the service's start (0.13 s), and most shapes use neither.
    if c.queue.backend == "redis":
        from supervisor.redisq.queue import RedisQueue

        assert c.queue.redis_dsn is not None  # config validation requires it
        try:
            redis_queue = RedisQueue(c.queue.redis_dsn.reveal(), c.queue.redis_key)
            await r.open("redis-queue", redis_queue.start, redis_queue.close)
        except (QueueError, ValueError) as exc:  # ValueError: a URL redis-py cannot parse
            raise StartupError(f"queue.backend = 'redis' cannot start: {exc}") from exc
        return redis_queue
    if c.queue.backend == "rabbitmq":
        from supervisor.amqp.queue import RabbitQueue

        assert c.queue.rabbitmq_dsn is not None  # config validation requires it
        rabbit = RabbitQueue(c.queue.rabbitmq_dsn.reveal(), c.queue.rabbitmq_queue,
                             c.queue.max_receives)
        try:
            await r.open("rabbitmq-queue", rabbit.start, rabbit.close)
        except QueueError as exc:
            raise StartupError(f"queue.backend = 'rabbitmq' cannot start: {exc}") from exc
        return rabbit
    queue = InfraiQueue(c.infrai)
    await r.open("infrai-queue", queue.start, queue.close)
    return queue


def _outside(c: Config) -> bool:
    """Whether the work queue lives outside the ledger's database."""
    return c.queue.backend in ("infrai", "redis", "rabbitmq")


async def _open_sqlite(c: Config, r: Resources) -> Storage:
    lock = DataDirLock(c.service.data_dir)

    async def acquire() -> None:
        lock.acquire()

    async def unlock() -> None:
        lock.release()

    await r.open("data-dir-lock", acquire, unlock)
    db = Database(c.ledger_path, recover_after_s=LEDGER_RECOVER_AFTER_S)
    try:
        try:
            await r.open("sqlite-ledger", db.open, db.close)
        except StorageError as exc:
            raise StartupError(str(exc)) from exc
        queue: Queue
        released = 0
        if _outside(c):
            queue = await _work_queue(c, r)
        else:
            sqlite_queue = queue = SqliteQueue(db)
            released = await r.open("sqlite-queue", sqlite_queue.recover_leases)
        ledger = SqliteLedger(db, owns_queue=queue.capabilities.transactional_ack)
        # Under the data-dir lock every in-flight guard's owner is a previous life.
        await r.open("release-dead-owners", ledger.release_dead_owners)
        def local(limits: LimitsConfig, key: str) -> LocalBudget:
            return LocalBudget(limits, key=key, store=ledger,
                               timeout_s=c.partner.request_timeout_seconds,
                               max_pause_s=c.partner.max_retry_after_seconds)

        budget = _two_limits(c, local)
        await r.open("budget", budget.start)
    except StorageError as exc:  # the ledger opened but its first reads or writes fail
        raise StartupError(f"ledger {c.ledger_path} cannot be used: {exc}") from exc
    return Storage(ledger=ledger, queue=queue, budget=budget, roles=LocalRoles(),
                   wakeups={"runs": asyncio.Event(), "outbox": asyncio.Event(),
                            "finished": asyncio.Event()},
                   released=released, storage_healthy=lambda: db.healthy,
                   describe=f"ledger {c.ledger_path}",
                   components=[Component("ledger-writer", db.watch, Drain.LAST)])


B = TypeVar("B", bound=RateBudget)


def _two_limits(c: Config, make: Callable[[LimitsConfig, str], B]) -> B | TwoLimits:
    """The partner's budget: ``[limits]``, and under ``batch.cost = "both"`` a second one
    on ids beside it (its memory and shared row keyed apart)."""
    requests = make(c.limits, c.partner.base_url)
    if c.batch.cost != "both":
        return requests
    return TwoLimits(requests, make(item_limits(c.limits, c.batch.items_per_second),
                                    f"{c.partner.base_url}#items"))


async def _open_postgres(c: Config, r: Resources) -> Storage:
    from supervisor.postgres.budget import PostgresBudget

    assert c.ledger.dsn is not None  # config validation requires it
    dsn = c.ledger.dsn.reveal()
    replica = new_replica_id()
    db = PgDatabase(dsn, c.ledger.schema, replica, pool_size=c.ledger.pool_size)
    try:
        try:
            await r.open("pg-database", lambda: db.open(pg_migrations()), db.close)
        except StorageError as exc:
            raise StartupError(str(exc)) from exc
        roles = AdvisoryRoles(dsn, c.ledger.schema, c.ledger.role_poll_seconds, replica)
        r.closes("pg-roles", roles.close)
        membership = Membership(db, c.ledger, roles)
        # Its own connection is closed should the join fail; once joined, it leaves.
        await r.open("pg-membership", membership.join, membership.close)
        r.closes("pg-membership-leave", membership.leave)
        queue: Queue = await _work_queue(c, r) if _outside(c) else PostgresQueue(db)
        ledger = PostgresLedger(db, owns_queue=queue.capabilities.transactional_ack,
                                fence_s=c.ledger.dead_after_seconds / 2,
                                dead_after_s=c.ledger.dead_after_seconds)
        def shared(limits: LimitsConfig, key: str) -> PostgresBudget:
            return PostgresBudget(limits, key=key, pool=db.pool, dsn=dsn,
                                  schema=c.ledger.schema,
                                  timeout_s=c.partner.request_timeout_seconds,
                                  max_pause_s=c.partner.max_retry_after_seconds,
                                  db_clock=db.clock)

        budget = _two_limits(c, shared)
        await r.open("budget", budget.start, budget.close)
    except (StorageError, OSError) as exc:
        raise StartupError(f"cannot start on PostgreSQL: {exc}") from exc
    return Storage(ledger=ledger, queue=queue, budget=budget, roles=roles,
                   wakeups={name: db.wakeups[name] for name in ("runs", "outbox", "finished")},
                   finish_every_s=FINISH_EVERY_S,
                   replica=replica, membership=membership,
                   storage_healthy=lambda: db.healthy and membership.fresh,
                   describe=f"ledger postgres schema {c.ledger.schema}, replica {replica}",
                   components=[Component("heartbeat", membership.run, Drain.LAST)])


@dataclass
class Assembly:
    """Everything the service hosts: the storage, what the HTTP API needs, the supervised
    components with their drain groups, and the writes made once they have all stopped."""

    storage: Storage
    api: ApiState
    pool: ConsumerPool
    components: list[Component]
    # Awaited, each bounded, after the drain: closing runs, the budget's memory.
    final_writes: list[Callable[[], Awaitable[object]]]
    # What the pool's stop reported (workers drained, cut off at the grace limit).
    drained: dict[str, int] = field(default_factory=dict)


async def assemble(c: Config, r: Resources) -> Assembly:
    """Open and build everything ``c`` configures except the HTTP listener (the host's)."""
    storage = await open_storage(c, r)
    partner = PartnerClient(c.partner, c.limits.concurrency, storage.budget.departed)
    await r.open("partner", partner.start, partner.close)
    relay = EventRelay(c.events, storage.ledger, build_sinks(c.events, c.infrai))
    await r.open("events-sinks", relay.start, relay.close)
    a = _application(c, storage, partner, relay)
    if c.infrai.tick_queue:
        channel = infrai_channel(c.infrai, c.infrai.tick_queue)
        await r.open("tick-queue", channel.start, channel.close)
        puller = TickPuller(tick_source(channel), a.api.opener, c.schedule.name,
                            c.infrai.tick_poll_seconds)
        a.components.append(Component("ticks", puller.run, Drain.INTAKE))
    a.components = [_placed(storage.roles, x) for x in a.components]
    return a


def _pushed(c: Config) -> tuple[PushedQueue, PushSettings] | None:
    """Pushed: the pool works what Infrai POSTs to /v1/push/{queue}, answering instead of
    acking; its fetcher finds nothing to pull. Everything else publishes to Infrai."""
    if c.infrai.delivery != "push":
        return None
    settings = push_settings(c.infrai)
    return PushedQueue(settings.visibility_timeout_s, settings.max_wait_s), settings


def _application(c: Config, storage: Storage, partner: PartnerClient,
                 relay: EventRelay) -> Assembly:
    ledger, queue, budget, roles = storage.ledger, storage.queue, storage.budget, storage.roles
    runs_changed = RunWatch()
    monitor = Monitor(ledger, queue, budget, runs_changed, c.schedule.digest_cutoff_seconds,
                      finishes=lambda: roles.holds("monitor"),
                      settled=storage.wakeups["finished"],
                      finish_every_s=storage.finish_every_s,
                      readiness=lambda: ready())  # below: it reads the pool

    def settled() -> None:
        monitor.settled.set()
        relay.notify()  # the events just written go out now, not at the next poll

    pushed = _pushed(c)
    pool = ConsumerPool(c, ledger, queue if pushed is None else pushed[0], budget, partner,
                        on_settled=settled)
    push = None if pushed is None else \
        PushReceiver(pushed[1], {c.infrai.queue: PushEntry(pool, pushed[0])})
    opener = RunOpener(c, ledger, storage.wakeups["runs"])
    reconciler = Reconciler(c.partner, ledger, queue, budget, partner)

    def ready() -> tuple[bool, dict[str, bool]]:
        checks = {"ledger": storage.storage_healthy(), "queue": queue.healthy,
                  "workers": pool.running, "accepting": api.accepting}
        ok = all(checks.values())
        metrics.READY.set(1 if ok else 0)
        return ok, checks

    api = ApiState(config=c, ledger=ledger, opener=opener, reconciler=reconciler, ready=ready,
                   runs_changed=runs_changed, current_rate=lambda: budget.snapshot().rate,
                   projected_finish=lambda n, now: budget.snapshot().projected_finish(n, now),
                   ledger_stats=lambda: monitor.last_stats, push=push, budget=budget)
    a = Assembly(storage, api, pool, [], final_writes=[ledger.finish_runs, budget.save])

    async def refuse() -> None:
        api.accepting = False
        runs_changed.notify()  # long-polls answer now, not at their timeout

    async def drain_pool() -> None:
        a.drained.update(await pool.stop(c.service.shutdown_grace_seconds))

    a.components = [
        Component("api", None, Drain.INTAKE, stop=refuse),
        *_intake(c, storage, pool, opener, reconciler),
        Component("consumers", pool.run, Drain.WORK, stop=drain_pool),
        # The monitor last, after a final pass so closed runs are recorded.
        Component("monitor", monitor.run, Drain.LAST),
        # Holds the monitor's role for its own sake (finishing runs asks who holds it).
        Component("finisher", _forever, Drain.LAST, role="monitor"),
        *storage.components, *relay.components()]
    return a


def _intake(c: Config, storage: Storage, pool: ConsumerPool, opener: RunOpener,
            reconciler: Reconciler) -> list[Component]:
    """What brings work in: stopped first in the drain."""
    ledger, queue = storage.ledger, storage.queue
    scan_wakeup, publish_wakeup = storage.wakeups["runs"], storage.wakeups["outbox"]
    out = [
        Component("publisher", Publisher(ledger, queue, publish_wakeup).run, Drain.INTAKE,
                  role="publisher"),
        Component("scan", Scanner(c, ledger, scan_wakeup, publish_wakeup).run, Drain.INTAKE,
                  role="scan"),
        Component("redrive", Redriver(c.queue, ledger, queue,
                                      horizon=pool.redrive_horizon).run, Drain.INTAKE,
                  role="redrive")]
    if c.partner.probe_path:
        out.append(Component("reconcile", reconciler.run, Drain.INTAKE, role="reconcile"))
    if c.batch.shape == "job" and pool.batches is not None:
        poller = JobPoller(c, ledger, pool.budget, reconciler.partner, pool.courier,
                           pool.batches.job_submitted, pool.batches.job_closed)
        out.append(Component("jobs", poller.run, Drain.INTAKE, role="jobs"))
    if c.schedule.cron is not None and c.schedule.clock == "embedded":
        out.append(Component("schedule", Scheduler(c.schedule, opener).run, Drain.INTAKE))
    return out


def _placed(roles: Roles, x: Component) -> Component:
    """A component with a role runs only while this process holds it."""
    if x.run is None or x.role is None:
        return x
    run, role = x.run, x.role
    return dataclasses.replace(x, run=lambda: roles.run(role, run))


async def _forever() -> None:
    """A role held for its own sake (the monitor's run finishing asks who holds it)."""
    await asyncio.Event().wait()
