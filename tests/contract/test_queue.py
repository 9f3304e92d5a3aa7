"""The Queue protocol's contract: every transport passes this one class.

Backends: the embedded SQLite queue on a real file, the PostgreSQL queue table on a
schema of its own (tests/conftest.py's ``pg``), a Redis stream under a key of its own on
the machine's Redis (``redis_key``), a RabbitMQ quorum queue of its own
(``rabbit_queue``), and the Infrai adapter against the
emulator on loopback in each capability mix the reference leaves open (no nack and no
extend, nack only, nack and extend, a bare-list consume answer, a strict server that
rejects late and unknown acks); and the pushed transport (supervisor/push.py), whose
messages arrive over HTTP, so the tests that need ``pull`` skip there. Optional methods
are exercised where a transport declares them and must refuse cleanly where it does not.

Time: the SQLite, PostgreSQL and Redis queues' leases are wall-clock (short ones, waited out); the
emulator's
clock is advanced instead, so a visibility timeout or a delay costs no real waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cleanup_sandbox.infrai import EmulatorConfig, start_emulator
from supervisor.amqp.queue import RabbitQueue
from supervisor.errors import QueueError
from supervisor.infrai.queue import InfraiQueue
from supervisor.model import Delivery
from supervisor.postgres import sql as pg_sql
from supervisor.postgres.database import PgDatabase
from supervisor.postgres.queue import PostgresQueue
from supervisor.push import PushedQueue
from supervisor.queue.base import Queue, Unsupported
from supervisor.redisq.queue import RedisQueue
from supervisor.sqlite.database import Database
from supervisor.sqlite.queue import SqliteQueue
from tests.helpers import EMU_KEY, eventually, infrai_config, msg


@dataclass
class Backend:
    queue: Queue
    lease_s: float  # what the tests lease for
    delay_s: float  # what the tests delay by
    # Let ``seconds`` pass on the transport's clock.
    advance: Callable[[float], Awaitable[None]]
    # How long past a lease or a delay the tests wait before they look: the emulator's
    # clock is advanced (a whole second costs nothing); a real one is waited out.
    margin_s: float = 0.3

    async def past(self, seconds: float) -> None:
        await self.advance(seconds + self.margin_s)

    async def comes_back(self, n: int = 1) -> list[Delivery]:
        """The next receive that hands something out: on a wall clock a loaded host or a
        broker's expiry may be late, so it is asked again for a while rather than once."""
        async def received() -> list[Delivery] | None:
            return await self.queue.receive(n, self.lease_s) or None

        got: list[Delivery] = await eventually(received, 5.0, "a delivery", every_s=0.05)
        return got


INFRAI_MIXES: dict[str, dict[str, object]] = {
    "infrai": {},
    "infrai-bare-list": {"consume_shape": "bare"},
    "infrai-nack": {"nack_route": "/v1/queue/nack"},
    "infrai-nack-extend": {"nack_route": "/v1/queue/nack", "extend_route": "/v1/queue/extend"},
    "infrai-strict": {"ack_expired": "reject", "ack_unknown": "not_found",
                      "create_existing": "conflict", "key_reuse": "conflict",
                      "require_create_keys": True, "message_extras": True},
}


@pytest.fixture(params=["sqlite", "postgres", "redis", "rabbitmq", *INFRAI_MIXES, "pushed"])
def transport(request: pytest.FixtureRequest) -> tuple[str, Any]:
    """The backend's name, and the PostgreSQL schema or Redis key where it needs one (only
    there: a machine without PostgreSQL or Redis still runs the others)."""
    name = str(request.param)
    server = {"postgres": "pg", "redis": "redis_key", "rabbitmq": "rabbit_queue"}.get(name)
    return name, request.getfixturevalue(server) if server else None


async def sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)  # SQLite and PostgreSQL leases are wall-clock: time must pass


@pytest.fixture
async def backend(transport: tuple[str, Any], tmp_path: Path) -> AsyncIterator[Backend]:
    name, pg = transport
    if name == "sqlite":
        db = Database(tmp_path / "queue.sqlite3")
        await db.open()
        try:
            yield Backend(SqliteQueue(db), lease_s=0.1, delay_s=0.2, advance=sleep)
        finally:
            await db.close()
        return
    if name == "pushed":
        queue = PushedQueue(lease_s=30, max_wait_s=5)
        try:
            yield Backend(queue, lease_s=30, delay_s=120, advance=sleep)
        finally:
            await queue.close()
        return
    if name == "postgres":
        pgdb = PgDatabase(pg.dsn, pg.schema, "contract-replica")
        await pgdb.open(pg_sql.MIGRATIONS)
        try:
            yield Backend(PostgresQueue(pgdb), lease_s=0.1, delay_s=0.2, advance=sleep)
        finally:
            await pgdb.close()
        return
    if name == "redis":
        rq = RedisQueue(pg.url, pg.key)
        await rq.start()
        try:
            yield Backend(rq, lease_s=0.1, delay_s=0.2, advance=sleep)
        finally:
            await rq.close()
        return
    if name == "rabbitmq":
        rabbit = RabbitQueue(pg.url, pg.name, max_receives=20)
        await rabbit.start()
        try:
            # Delays are whole delay queues' TTLs (0.2 s is one); leases are our timers.
            yield Backend(rabbit, lease_s=0.1, delay_s=0.2, advance=sleep)
        finally:
            await rabbit.close()
        return
    mix = INFRAI_MIXES[name]
    emulator = await start_emulator(EmulatorConfig(api_key=EMU_KEY, **mix))  # type: ignore[arg-type]

    async def advance(seconds: float) -> None:
        emulator.advance(seconds)

    config = infrai_config(emulator, queue="contract",
                           nack_path=str(mix.get("nack_route") or ""),
                           extend_path=str(mix.get("extend_route") or ""))
    queue = InfraiQueue(config)
    await queue.start()
    try:
        yield Backend(queue, lease_s=30, delay_s=120, advance=advance, margin_s=1.0)
    finally:
        await queue.close()
        await emulator.close()


def needs_pull(q: Queue) -> None:
    if not q.capabilities.pull:
        pytest.skip("no pull: messages arrive by push, receive hands none out and publish "
                    "takes only the message of a delivery being answered")


def needs_push(q: Queue) -> None:
    if q.capabilities.pull:
        pytest.skip("pull: what a pushed transport does instead is not asked of it")


class TestQueueContract:
    async def test_publish_names_each_message_and_receive_hands_out_identifiers(
            self, backend: Backend) -> None:
        q = backend.queue
        needs_pull(q)
        ids = await q.publish([msg(1), msg(2)])
        assert len(ids) == 2
        assert len(set(ids)) == 2
        got = await q.receive(10, backend.lease_s)
        assert {d.message for d in got} == {msg(1), msg(2)}
        assert {d.message_id for d in got} == set(ids)
        assert all(d.receipt for d in got)

    async def test_receive_takes_at_most_max_messages(self, backend: Backend) -> None:
        q = backend.queue
        needs_pull(q)
        await q.publish([msg(i) for i in range(5)])
        first = await q.receive(2, backend.lease_s)
        rest = await q.receive(10, backend.lease_s)
        assert len(first) == 2
        assert len(rest) == 3
        assert await q.receive(10, backend.lease_s) == []

    async def test_a_held_message_comes_back_when_its_visibility_timeout_ends(
            self, backend: Backend) -> None:
        q = backend.queue
        needs_pull(q)
        await q.publish([msg(1)])
        [first] = await q.receive(1, backend.lease_s)
        assert await q.receive(1, backend.lease_s) == []  # held: nobody else gets it
        await backend.past(backend.lease_s * 2)
        [second] = await backend.comes_back()
        assert second.message == first.message
        assert second.message_id == first.message_id  # the same message, delivered again
        assert second.receipt != first.receipt  # a different delivery

    async def test_ack_deletes_for_good(self, backend: Backend) -> None:
        q = backend.queue
        needs_pull(q)
        await q.publish([msg(1), msg(2)])
        got = await q.receive(2, backend.lease_s)
        acked = next(d for d in got if d.message == msg(1))
        await q.ack([acked])
        await backend.past(backend.lease_s * 2)
        again = await backend.comes_back(10)
        assert [d.message for d in again] == [msg(2)]

    async def test_an_ack_of_a_gone_message_is_no_error(self, backend: Backend) -> None:
        """A redelivery of a settled operation is acked on sight, and an ack can be sent
        twice (its first answer was lost): neither may fail the consumer."""
        q = backend.queue
        needs_pull(q)
        await q.publish([msg(1)])
        [d] = await q.receive(1, backend.lease_s)
        await q.ack([d])
        await q.ack([d])
        await backend.past(backend.lease_s * 2)
        assert await q.receive(1, backend.lease_s) == []  # acked: never delivered again

    async def test_a_delayed_message_is_hidden_until_due(self, backend: Backend) -> None:
        q = backend.queue
        needs_pull(q)
        await q.publish([msg(1)], delay_s=backend.delay_s)
        assert await q.receive(1, backend.lease_s) == []
        await backend.past(backend.delay_s)
        [d] = await backend.comes_back()
        assert d.message == msg(1)

    async def test_the_longest_delay_is_accepted(self, backend: Backend) -> None:
        q = backend.queue
        needs_pull(q)
        longest = min(q.capabilities.max_delay_s, 7 * 86400.0)
        [mid] = await q.publish([msg(1)], delay_s=longest)
        assert mid
        assert await q.receive(1, backend.lease_s) == []

    async def test_a_delay_past_the_longest_is_refused(self, backend: Backend) -> None:
        q = backend.queue
        needs_pull(q)
        if q.capabilities.max_delay_s == float("inf"):
            pytest.skip("this transport has no longest delay")
        with pytest.raises(QueueError):
            await q.publish([msg(1)], delay_s=q.capabilities.max_delay_s + 1)

    async def test_nack_hands_back_after_its_delay(self, backend: Backend) -> None:
        q = backend.queue
        needs_pull(q)
        await q.publish([msg(1)])
        [d] = await q.receive(1, backend.lease_s)
        if not q.capabilities.nack:
            with pytest.raises(Unsupported):
                await q.nack(d, 0.0)
            return
        await q.nack(d, backend.delay_s)
        assert await q.receive(1, backend.lease_s) == []
        await backend.past(backend.delay_s)
        [again] = await backend.comes_back()
        assert again.message == msg(1)

    async def test_extend_keeps_a_message_held_past_its_first_timeout(
            self, backend: Backend) -> None:
        q = backend.queue
        needs_pull(q)
        await q.publish([msg(1)])
        [d] = await q.receive(1, backend.lease_s)
        if not q.capabilities.extend:
            with pytest.raises(Unsupported):
                await q.extend(d, backend.lease_s)
            return
        await backend.advance(backend.lease_s / 2)
        assert await q.extend(d, backend.lease_s * 4) is True
        await backend.advance(backend.lease_s)
        assert await q.receive(1, backend.lease_s) == []  # still ours

    async def test_stats_only_where_declared(self, backend: Backend) -> None:
        q = backend.queue
        needs_pull(q)
        await q.publish([msg(1), msg(2)])
        await q.publish([msg(3)], delay_s=backend.delay_s)
        if not q.capabilities.stats:
            with pytest.raises(Unsupported):
                await q.stats()
            return
        await q.receive(1, backend.lease_s)
        s = await q.stats()
        assert (s.depth, s.parked, s.leased) == (1, 1, 1)

    async def test_a_publish_wakes_a_waiting_consumer(self, backend: Backend) -> None:
        q = backend.queue
        needs_pull(q)
        assert await q.receive(1, backend.lease_s) == []
        waiter = asyncio.create_task(q.wait(30))
        await q.publish([msg(1)])
        await asyncio.wait_for(waiter, 5)  # well before its 30 s
        # A publish between an empty receive and the wait after it is not lost either.
        assert [d.message for d in await q.receive(1, backend.lease_s)] == [msg(1)]
        assert await q.receive(1, backend.lease_s) == []
        await q.publish([msg(2)])
        await asyncio.wait_for(q.wait(30), 5)

    async def test_capabilities_are_consistent(self, backend: Backend) -> None:
        caps = backend.queue.capabilities
        assert dataclasses.is_dataclass(caps)
        # Acks inside the ledger's transaction only where the queue shares its database.
        assert caps.transactional_ack is isinstance(backend.queue, SqliteQueue | PostgresQueue)
        assert caps.max_delay_s >= 7 * 86400.0
        assert backend.queue.healthy

    async def test_capabilities_declare_what_the_consumer_relies_on(
            self, backend: Backend) -> None:
        caps = backend.queue.capabilities
        assert caps.default_prefetch >= 0
        if not caps.pull:  # nothing is received: nothing to bill or keep in hand
            assert (caps.billed, caps.default_prefetch) == (False, 0)

    async def test_a_pushed_transport_hands_nothing_out(self, backend: Backend) -> None:
        q = backend.queue
        needs_push(q)
        assert await q.receive(10, backend.lease_s) == []
        await asyncio.wait_for(q.wait(0.01), 5)  # an idle poll returns, finding nothing
        assert await q.receive(10, backend.lease_s) == []

    async def test_a_pushed_transport_publishes_no_message_of_its_own(
            self, backend: Backend) -> None:
        """Its messages are published to the subscribed queue; it can only note, for a
        delivery being answered, that its message is due again later."""
        q = backend.queue
        needs_push(q)
        with pytest.raises(QueueError):
            await q.publish([msg(1)])

    async def test_a_pushed_delivery_refuses_what_it_does_not_declare(
            self, backend: Backend) -> None:
        """A delivery that arrived over HTTP: an ack of it (or of one already answered) is
        no error; nack, extend and stats refuse cleanly unless declared."""
        q = backend.queue
        needs_push(q)
        d = Delivery(msg(1), "m-1", "push/m-1/0")
        await q.ack([d])
        await q.ack([d])
        caps = q.capabilities
        if not caps.nack:
            with pytest.raises(Unsupported):
                await q.nack(d, 0.0)
        if not caps.extend:
            with pytest.raises(Unsupported):
                await q.extend(d, backend.lease_s)
        if not caps.stats:
            with pytest.raises(Unsupported):
                await q.stats()
