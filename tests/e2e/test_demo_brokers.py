"""``cleanup-supervisor demo --queue redis|rabbitmq``: the whole demo through a queue of
its own on this machine's Redis or RabbitMQ, as a user runs it, ending with duplicates=0
failed=0, and the demo's queue removed from the broker afterwards."""

from __future__ import annotations

import asyncio
import os
import re
import sys

import aio_pika
import pytest
import redis.asyncio as aioredis

from tests.conftest import require_rabbitmq, require_redis

pytestmark = pytest.mark.e2e


async def _demo(queue: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor", "demo", "--queue", queue, "--recipients", "400",
        "--rate", "200", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env=env)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


def _last(out: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in out.strip().splitlines()[-1].split())


async def test_the_demo_runs_through_redis() -> None:
    url = await require_redis()
    code, out = await _demo("redis", {**os.environ, "CLEANUP_REDIS_URL": url})
    assert code == 0, out[-3000:]
    last = _last(out)
    assert (last["discovered"], last["duplicates"], last["failed"]) == ("400", "0", "0")
    assert "queue redis" in out
    client = aioredis.Redis.from_url(url)
    try:
        # Its key was the demo's own, and the demo removed it.
        [name] = set(re.findall(r"queue redis \(key (cleanup-demo-[0-9a-f]{8})\)", out))
        assert await client.exists(f"{name}:work", f"{name}:delayed") == 0
    finally:
        await client.aclose()


async def test_the_demo_runs_through_rabbitmq() -> None:
    url = await require_rabbitmq()
    code, out = await _demo("rabbitmq", {**os.environ, "CLEANUP_RABBITMQ_URL": url})
    assert code == 0, out[-3000:]
    last = _last(out)
    assert (last["discovered"], last["duplicates"], last["failed"]) == ("400", "0", "0")
    assert "queue rabbitmq" in out
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        [name] = set(re.findall(r"quorum queue (cleanup-demo-[0-9a-f]{8})\)", out))
        with pytest.raises(aio_pika.exceptions.ChannelClosed):
            await channel.declare_queue(name, passive=True)  # removed
    finally:
        await connection.close()
