"""What the RabbitMQ queue promises beyond the Queue contract (tests/contract), on the
machine's RabbitMQ with a quorum queue of its own: when the broker closes the channel
holding unacked messages, they come back and the old deliveries' acks are never sent
(their tags died with the channel: nothing acked twice, nothing lost); the quorum queue's
delivery limit sits above queue.max_receives, and a queue declared with another limit is
a clear startup error; an unreachable broker is a QueueError that never shows the
password. Nothing here mocks the broker."""

from __future__ import annotations

import socket

import aio_pika
import pytest

from supervisor.amqp.queue import DELIVERY_LIMIT_MARGIN, RabbitQueue, delay_for
from supervisor.errors import QueueError
from tests.conftest import RabbitQueueName
from tests.helpers import msg

LEASE_S = 30.0


async def test_a_closed_channel_gives_its_unacked_messages_back_once(
        rabbit_queue: RabbitQueueName) -> None:
    q = RabbitQueue(rabbit_queue.url, rabbit_queue.name, max_receives=20)
    await q.start()
    try:
        await q.publish([msg(1), msg(2)])
        old = await q.receive(10, LEASE_S)
        assert {d.message for d in old} == {msg(1), msg(2)}
        generation = q._generation
        # The broker closes the channel: an ack of a tag it never gave is a channel error.
        assert q._consume_channel is not None
        raw = await q._consume_channel.get_underlay_channel()
        await raw.basic_ack(delivery_tag=9999)
        # The old deliveries' tags are dead: their acks fail nothing and ack nothing.
        await q.ack(old)
        # The next call opens a new connection (a new generation) and takes them again.
        again = await q.receive(10, LEASE_S)
        assert q.reopened.is_set()
        assert q._generation > generation
        assert q.healthy
        assert [await q.extend(d, LEASE_S) for d in old] == [False, False]
        assert {d.message for d in again} == {msg(1), msg(2)}
        assert {d.message_id for d in again} == {d.message_id for d in old}
        assert not {d.receipt for d in again} & {d.receipt for d in old}
        await q.ack(again)
        assert await q._ready() == 0
        assert await q.receive(10, LEASE_S) == []
    finally:
        await q.close()


async def test_the_delivery_limit_is_above_max_receives_and_a_change_is_named(
        rabbit_queue: RabbitQueueName) -> None:
    q = RabbitQueue(rabbit_queue.url, rabbit_queue.name, max_receives=7)
    await q.start()
    await q.close()
    # The queue exists with x-delivery-limit 7 + margin: redeclaring it with that passes.
    connection = await aio_pika.connect(rabbit_queue.url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(rabbit_queue.name, durable=True, arguments={
            "x-queue-type": "quorum", "x-delivery-limit": 7 + DELIVERY_LIMIT_MARGIN})
    finally:
        await connection.close()
    changed = RabbitQueue(rabbit_queue.url, rabbit_queue.name, max_receives=30)
    with pytest.raises(QueueError, match="x-delivery-limit"):
        await changed.start()
    await changed.close()


async def test_an_unreachable_broker_is_a_queue_error_without_the_password() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    q = RabbitQueue(f"amqp://guest:pw-secret-9@127.0.0.1:{port}/", "t-unreachable", 20)
    with pytest.raises(QueueError) as raised:
        await q.start()
    assert "pw-secret-9" not in str(raised.value)
    assert q.healthy is False
    await q.close()


def test_a_delay_waits_in_the_shortest_queue_not_shorter() -> None:
    assert delay_for(0.05) == 0.1
    assert delay_for(0.2) == 0.2
    assert delay_for(1.1) == 2
    assert delay_for(7 * 86400) == 604800
    assert delay_for(7 * 86400 + 1) is None


async def test_receipts_differ_across_processes_whose_tags_both_start_at_one(
        rabbit_queue: RabbitQueueName) -> None:
    # The receipt owns the operation's attempt in the ledger: two replicas' first
    # deliveries (tag 1 on each channel) must not own it alike.
    a = RabbitQueue(rabbit_queue.url, rabbit_queue.name, max_receives=20)
    b = RabbitQueue(rabbit_queue.url, rabbit_queue.name, max_receives=20)
    await a.start()
    await b.start()
    try:
        await a.publish([msg(1), msg(2)])
        [first] = await a.receive(1, LEASE_S)
        [second] = await b.receive(1, LEASE_S)
        assert first.receipt.endswith(":1")
        assert second.receipt.endswith(":1")
        assert first.receipt != second.receipt
        await a.ack([first])
        await b.ack([second])
    finally:
        await a.close()
        await b.close()
