"""What the Redis Streams queue promises beyond the Queue contract (tests/contract), on
the machine's Redis under a key of its own: a delivery whose lease ran out and was
claimed by another consumer can neither ack nor extend the new holder's; what another
producer wrote into the stream is dropped, not handed out; a retried wait sees what is
already waiting; stats count what the stream holds; a Redis that does not answer is a
QueueError and an unhealthy queue, healthy again once it answers. Nothing here mocks
Redis: the unreachable server is a closed port, the restarted one a redis-server of the
test's own."""

from __future__ import annotations

import asyncio
import shutil
import socket
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from supervisor.errors import QueueError
from supervisor.redisq.queue import RedisQueue
from tests.conftest import RedisKey
from tests.helpers import msg

LEASE_S = 0.1


async def test_a_stale_delivery_cannot_ack_or_extend_the_new_holders(
        redis_key: RedisKey) -> None:
    a, b = RedisQueue(redis_key.url, redis_key.key), RedisQueue(redis_key.url, redis_key.key)
    await a.start()
    await b.start()
    try:
        await a.publish([msg(1)])
        [first] = await a.receive(1, LEASE_S)
        await asyncio.sleep(LEASE_S * 1.5)  # a's lease runs out (Redis counts idle time)
        [second] = await b.receive(1, LEASE_S)
        assert (second.message, second.message_id) == (first.message, first.message_id)
        assert second.receipt != first.receipt
        assert await a.extend(first, 5.0) is False
        await a.ack([first])  # the stale holder's ack: a no-op
        assert (await b.stats()).leased == 1
        assert await b.extend(second, 5.0) is True
        await b.ack([second])
        stats = await b.stats()
        assert (stats.depth, stats.leased, stats.parked) == (0, 0, 0)
    finally:
        await a.close()
        await b.close()


async def test_an_extended_lease_is_not_claimed_before_it_ends(redis_key: RedisKey) -> None:
    a, b = RedisQueue(redis_key.url, redis_key.key), RedisQueue(redis_key.url, redis_key.key)
    await a.start()
    await b.start()
    try:
        await a.publish([msg(1)])
        [held] = await a.receive(1, LEASE_S)
        assert await a.extend(held, 30.0) is True
        await asyncio.sleep(LEASE_S * 2)  # idle past the group's lease, not past 30 s
        assert await b.receive(1, LEASE_S) == []
    finally:
        await a.close()
        await b.close()


async def test_an_entry_another_producer_wrote_is_dropped_not_handed_out(
        redis_key: RedisKey) -> None:
    q = RedisQueue(redis_key.url, redis_key.key)
    await q.start()
    raw = aioredis.Redis.from_url(redis_key.url)
    try:
        await raw.xadd(f"{redis_key.key}:work", {"m": b"not json"})
        await raw.xadd(f"{redis_key.key}:work", {"other": b"field"})
        await raw.xadd(f"{redis_key.key}:work", {"m": b'{"id": "x", "run_id": 7}'})
        await q.publish([msg(1)])
        got = await q.receive(10, LEASE_S)
        assert [d.message for d in got] == [msg(1)]
        # The three foreign entries were acked and deleted: only ours is left, held.
        assert await raw.xlen(f"{redis_key.key}:work") == 1
    finally:
        await raw.aclose()
        await q.close()


async def test_wait_returns_at_once_when_something_is_waiting(redis_key: RedisKey) -> None:
    q = RedisQueue(redis_key.url, redis_key.key)
    await q.start()
    try:
        await q.publish([msg(1)])
        # A long timeout: only a message already waiting ends the wait inside the test's.
        async with asyncio.timeout(30):
            await q.wait(3600)
        assert [d.message for d in await q.receive(1, LEASE_S)] == [msg(1)]
    finally:
        await q.close()


async def test_a_publish_from_another_process_wakes_a_wait(redis_key: RedisKey) -> None:
    # Blocks for an hour unless woken: a wait the publish does not end fails the case on
    # pytest's timeout.
    waiting = RedisQueue(redis_key.url, redis_key.key, max_block_s=3600)
    other = RedisQueue(redis_key.url, redis_key.key)
    admin = aioredis.Redis.from_url(redis_key.url)
    await waiting.start()
    await other.start()
    try:
        wait = asyncio.create_task(waiting.wait(3600))
        # Redis shows the wait's read blocked on the stream (no event crosses processes).
        while not any(c.get("cmd") == "xread" and "b" in c.get("flags", "")
                      for c in await admin.client_list()):
            assert not wait.done()
            await asyncio.sleep(0.01)
        await other.publish([msg(1)])
        await wait
        assert [d.message for d in await waiting.receive(5, LEASE_S)] == [msg(1)]
    finally:
        await admin.aclose()
        await waiting.close()
        await other.close()


async def test_delayed_messages_are_parked_then_claimable(redis_key: RedisKey) -> None:
    q = RedisQueue(redis_key.url, redis_key.key)
    await q.start()
    try:
        await q.publish([msg(1), msg(2)], delay_s=0.2)
        assert (await q.stats()).parked == 2
        assert await q.receive(5, LEASE_S) == []
        async with asyncio.timeout(30):
            while not (got := await q.receive(5, LEASE_S)):
                await q.wait(5)  # bounded by the next due message, not by 5 s
        assert sorted(d.message.operation_id for d in got) == ["op_1", "op_2"]
    finally:
        await q.close()


async def test_an_unreachable_redis_is_a_queue_error_and_unhealthy() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    q = RedisQueue(f"redis://:secret-pw@127.0.0.1:{port}/0", "t-unreachable")
    try:
        with pytest.raises(QueueError) as raised:
            await q.publish([msg(1)])
        assert q.healthy is False
        assert "secret-pw" not in str(raised.value)
        with pytest.raises(QueueError):
            await q.start()
    finally:
        await q.close()


async def _redis_server(port: int, directory: Path) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(directory),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
    try:
        async with asyncio.timeout(30):
            while True:
                try:
                    await client.ping()
                    return proc
                except (RedisError, OSError):
                    await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def test_a_broker_restart_is_unhealthy_then_recovered(tmp_path: Path) -> None:
    """A Redis server of the test's own, killed and started again on its port (it kept
    nothing: the group is made again on the next receive, the ledger republishes)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = await _redis_server(port, tmp_path)
    q = RedisQueue(f"redis://127.0.0.1:{port}/0", "restart")
    try:
        await q.start()
        await q.publish([msg(1)])
        server.kill()
        await server.wait()
        with pytest.raises(QueueError):
            await q.receive(1, LEASE_S)
        assert q.healthy is False
        server = await _redis_server(port, tmp_path)
        # The first receive finds no group (the server kept nothing) and makes it again.
        assert await q.receive(1, LEASE_S) == []
        assert q.healthy is True
        await q.publish([msg(2)])
        assert [d.message for d in await q.receive(1, LEASE_S)] == [msg(2)]
    finally:
        await q.close()
        if server.returncode is None:
            server.kill()
            await server.wait()


async def test_a_gone_consumer_is_forgotten_at_start_and_one_holding_entries_kept(
        redis_key: RedisKey) -> None:
    stream = f"{redis_key.key}:work"
    q = RedisQueue(redis_key.url, redis_key.key)
    await q.start()
    raw = aioredis.Redis.from_url(redis_key.url)
    try:
        await q.publish([msg(1)])
        await raw.xgroup_createconsumer(stream, redis_key.key, "gone-empty")
        await raw.xreadgroup(redis_key.key, "gone-holding", {stream: ">"}, count=1)
        await asyncio.sleep(0.1)  # both idle longer than the restart's 50 ms (time passes)
        restarted = RedisQueue(redis_key.url, redis_key.key, gone_after_ms=50)
        await restarted.start()
        names = {c["name"].decode() for c in await raw.xinfo_consumers(stream, redis_key.key)}
        await restarted.close()
    finally:
        await raw.aclose()
        await q.close()
    assert "gone-empty" not in names  # held nothing: forgotten
    assert "gone-holding" in names  # holds an entry: kept, so the entry stays claimable
