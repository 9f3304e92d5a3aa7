"""The embedded queue on a real SQLite file: publish dedup, leases, redelivery, acks, stats."""

from __future__ import annotations

import asyncio
import time

from supervisor.sqlite.database import Database
from supervisor.sqlite.queue import SqliteQueue
from tests.helpers import msg


async def expire(lease_s: float) -> None:
    """Let a lease run out. Lease expiry *is* time: there is no event to await."""
    await asyncio.sleep(lease_s * 2)


async def test_publish_twice_keeps_one_message(queue: SqliteQueue) -> None:
    await queue.publish([msg(1), msg(2)])
    await queue.publish([msg(1)])
    stats = await queue.stats()
    assert stats.depth == 2
    got = await queue.receive(10, 60)
    assert sorted(d.message.operation_id for d in got) == ["op_1", "op_2"]


async def test_receive_leases_and_returns_identifiers_only(queue: SqliteQueue) -> None:
    await queue.publish([msg(1)])
    [d] = await queue.receive(5, 60)
    assert d.message == msg(1)
    assert d.message_id == "op_1"
    assert d.receipt
    assert await queue.receive(5, 60) == []  # leased: nobody else gets it
    stats = await queue.stats()
    assert (stats.depth, stats.parked, stats.leased) == (0, 0, 1)


async def test_receive_respects_max_messages(queue: SqliteQueue) -> None:
    await queue.publish([msg(i) for i in range(5)])
    assert len(await queue.receive(2, 60)) == 2
    assert len(await queue.receive(10, 60)) == 3
    assert await queue.receive(10, 60) == []


async def test_an_expired_lease_redelivers_with_a_new_token(queue: SqliteQueue) -> None:
    await queue.publish([msg(1)])
    [first] = await queue.receive(1, 0.05)
    await expire(0.05)
    [second] = await queue.receive(1, 60)
    assert second.message == first.message
    assert second.message_id == first.message_id
    assert second.receipt != first.receipt
    # The first holder's ack comes too late: it is a no-op and the message stays.
    await queue.ack([first])
    assert (await queue.stats()).leased == 1
    assert await queue.extend(first, 60) is False
    # The current holder's ack removes it.
    await queue.ack([second])
    stats = await queue.stats()
    assert (stats.depth, stats.parked, stats.leased) == (0, 0, 0)


async def test_extend_pushes_the_lease_ahead(db: Database, queue: SqliteQueue) -> None:
    await queue.publish([msg(1)])
    [d] = await queue.receive(1, 1)
    assert await queue.extend(d, 600) is True
    row = await db.read_one("SELECT available_at FROM messages WHERE operation_id = 'op_1'")
    assert row is not None
    assert row[0] > time.time() + 500
    assert await queue.receive(1, 60) == []  # still ours


async def test_nack_with_delay_parks_and_without_delay_hands_back(queue: SqliteQueue) -> None:
    await queue.publish([msg(1), msg(2)])
    d1, d2 = await queue.receive(2, 60)
    await queue.nack(d1, 60)
    await queue.nack(d2, 0)
    stats = await queue.stats()
    assert (stats.depth, stats.parked, stats.leased) == (1, 1, 0)
    [again] = await queue.receive(5, 60)
    assert again.message == d2.message
    # A nacked delivery's token is spent: acking with it does nothing.
    await queue.ack([d1])
    assert (await queue.stats()).parked == 1


async def test_recover_leases_hands_back_every_lease(queue: SqliteQueue) -> None:
    await queue.publish([msg(1), msg(2), msg(3)])
    held = await queue.receive(2, 3600)
    assert len(held) == 2
    assert await queue.recover_leases() == 2
    got = await queue.receive(10, 60)
    assert len(got) == 3
    assert await queue.recover_leases() == 3  # the new leases are handed back too
    assert await queue.recover_leases() == 0


async def test_oldest_claimable_age_ignores_parked_messages(db: Database,
                                                            queue: SqliteQueue) -> None:
    assert (await queue.stats()).oldest_claimable_age_s == 0.0
    await queue.publish([msg(1), msg(2)])
    d1, _ = await queue.receive(2, 60)
    # Make op_1 an old message that is now parked for a delayed retry, and op_2 leased.
    await queue.nack(d1, 600)

    async def age_first(conn: object) -> None:
        assert hasattr(conn, "execute")
        await conn.execute("UPDATE messages SET enqueued_at = enqueued_at - 1000 "
                           "WHERE operation_id = 'op_1'")

    await db.write(age_first)
    stats = await queue.stats()
    assert (stats.depth, stats.parked, stats.leased) == (0, 1, 1)
    assert stats.oldest_claimable_age_s == 0.0  # parked and leased are not claimable

    # A claimable message that has waited 120 s is what the gauge reports.
    await queue.publish([msg(3)])

    async def backdate(conn: object) -> None:
        assert hasattr(conn, "execute")
        await conn.execute("UPDATE messages SET available_at = available_at - 120 "
                           "WHERE operation_id = 'op_3'")

    await db.write(backdate)
    stats = await queue.stats()
    assert stats.depth == 1
    assert 119 <= stats.oldest_claimable_age_s <= 130


async def test_wait_returns_when_a_message_is_published(queue: SqliteQueue) -> None:
    waiter = asyncio.create_task(queue.wait(30))
    await asyncio.sleep(0)
    await queue.publish([msg(1)])
    await asyncio.wait_for(waiter, timeout=5)


async def test_wait_is_cut_short_by_the_next_parked_message(queue: SqliteQueue) -> None:
    await queue.publish([msg(1)])
    [d] = await queue.receive(1, 60)
    await queue.nack(d, 0.05)
    assert await queue.receive(1, 60) == []  # parked: nothing to take yet
    # wait(30) must return when the park ends, far sooner than its own 30 s: the bound
    # fails the test otherwise, and what wait returned for is there to take.
    await asyncio.wait_for(queue.wait(30), timeout=5)
    assert len(await queue.receive(1, 60)) == 1


async def test_a_wakeup_during_waits_own_read_is_not_lost(queue: SqliteQueue) -> None:
    """A publish that commits while wait() is still reading the next available time must
    wake it; clearing the event after that read would lose the wakeup and idle a consumer
    for its whole poll interval with a claimable message in the queue."""
    waiter = asyncio.create_task(queue.wait(30))
    await asyncio.sleep(0)  # wait() has started its read of the next available time
    queue._wakeup.set()  # what publish() does once its commit lands, before that read returns
    await asyncio.wait_for(waiter, timeout=5)
