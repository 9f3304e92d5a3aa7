"""Redis Streams as the work queue (``queue.backend = "redis"``), through ``redis.asyncio``.

One stream per deployment (``<key>:work``) read by one consumer group (``<key>``), each
process a consumer of its own. What a managed queue calls a lease is a pending entry:
``XREADGROUP`` hands an entry to this consumer, ``XCLAIM`` takes back one idle for
longer than the lease (whoever held it died or stalled; found with ``XPENDING ... IDLE``),
an extension resets the idle time (``XCLAIM ... IDLE 0 JUSTID``, which keeps the delivery
count) and records when the longer lease ends (``<key>:leases``, which claimers honour),
and an ack is ``XACK`` then ``XDEL`` in one script, so the stream holds only what is
unacknowledged and nothing trims an entry a consumer still holds.

Each delivery names the entry, the consumer and the entry's delivery count. Ack and
extend run as scripts that act only while the entry is still pending to that consumer at
that count: a delivery whose lease ran out and was claimed again (by another replica, or
by this process after a stall) can neither ack nor extend the new holder's delivery.

Redis has no delayed delivery: a delayed message waits in a sorted set
(``<key>:delayed``, scored by when it is due on the Redis server's clock, so replicas'
clocks never matter) and a script moves the due ones into the stream before each receive
and wait. Nothing is dead-lettered here: the ledger counts receives and ends a message
received ``queue.max_receives`` times, as it does for every transport.

The message ID is ours (random, carried in the entry), not the stream entry's: a delayed
message keeps it when it moves into the stream. The ledger does the rest, as it does for
Infrai (supervisor/queue/courier.py): no nack (a retry publishes a delayed copy and acks
this one), publish is not idempotent (a copy is dropped by the consumer, which finds the
operation's attempt in flight or settled).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from supervisor import metrics
from supervisor.errors import QueueError
from supervisor.model import Delivery, Message, QueueStats
from supervisor.queue.base import Capabilities, Unsupported

log = logging.getLogger(__name__)

T = TypeVar("T")

# Due messages moved into the stream per call: a receive never stalls on a backlog.
PROMOTE_BATCH = 500
# A consumer (a process) idle this long and holding nothing is gone: deleted at start.
GONE_AFTER_MS = 86_400_000
# A wait blocks on the stream at most this long, then looks at the delayed set again.
MAX_BLOCK_S = 5.0

CAPABILITIES = Capabilities(transactional_ack=False, extend=True, nack=False, stats=True,
                            max_delay_s=float("inf"), billed=False, default_prefetch=0)

# KEYS: stream, delayed. ARGV: how many. Moves due entries into the stream (server clock).
_PROMOTE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, body in ipairs(due) do
  redis.call('XADD', KEYS[1], '*', 'm', body)
  redis.call('ZREM', KEYS[2], body)
end
local nxt = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if #nxt == 0 then return {#due, -1} end
return {#due, tonumber(nxt[2]) - now}
"""

# KEYS: delayed. ARGV: delay in ms, then each body. Scores on the server's clock.
_DELAY = """
local t = redis.call('TIME')
local due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], due, ARGV[i]) end
return #ARGV - 1
"""

# KEYS: stream, leases. ARGV: group, consumer, lease ms, count. Entries idle past the
# lease and past any extension of it, claimed for this consumer, each with its delivery
# count after the claim.
_CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local want = tonumber(ARGV[4])
local idle = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', tonumber(ARGV[3]), '-', '+',
                        want * 4 + 16)
local out = {}
for _, p in ipairs(idle) do
  if #out >= want then break end
  local held = redis.call('HGET', KEYS[2], p[1])
  if not held or tonumber(held) <= now then
    local e = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3]), p[1])
    if #e == 1 and e[1] and e[1][2] then
      redis.call('HDEL', KEYS[2], p[1])
      table.insert(out, {e[1][1], e[1][2], p[4] + 1})
    end
  end
end
return out
"""

# KEYS: stream, leases. ARGV: group, entry, consumer, count, then 'ack' or the lease ms.
# 1: done; 0: the entry is gone (acked before); -1: held by another delivery now.
_SETTLE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 then return 0 end
if p[1][2] ~= ARGV[3] or tostring(p[1][4]) ~= ARGV[4] then return -1 end
if ARGV[5] == 'ack' then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[1], ARGV[2])
  redis.call('HDEL', KEYS[2], ARGV[2])
else
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'IDLE', 0, 'JUSTID')
  redis.call('HSET', KEYS[2], ARGV[2], now + tonumber(ARGV[5]))
end
return 1
"""


# KEYS: stream. ARGV: group, idle ms. Consumers idle that long and holding nothing.
_FORGET = """
local gone = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
  if tonumber(info['pending']) == 0 and tonumber(info['idle']) > tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], info['name'])
    gone = gone + 1
  end
end
return gone
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisQueue:
    """:class:`~supervisor.queue.base.Queue` on one stream and one consumer group."""

    def __init__(self, url: str, key: str, client: aioredis.Redis | None = None,
                 max_block_s: float = MAX_BLOCK_S, gone_after_ms: int = GONE_AFTER_MS) -> None:
        self.max_block_s = max_block_s
        self.gone_after_ms = gone_after_ms
        self.key = key
        self.stream, self.delayed, self.group = f"{key}:work", f"{key}:delayed", key
        self.leases = f"{key}:leases"  # entry -> when an extended lease ends (server ms)
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        # Commands time out rather than hang on a broker that stopped answering; the
        # blocking read in wait() gets its own, longer, allowance (MAX_BLOCK_S).
        # A pooled connection the broker dropped (a restart, a failover, CLIENT KILL)
        # fails the next command sent on it: that one is sent again once on a fresh
        # connection. Every command here is safe to repeat: ack, extend and claim check
        # the holder, and a publish repeated is a copy the consumer drops.
        self.client = client or aioredis.Redis.from_url(
            url, socket_connect_timeout=5.0, socket_timeout=max_block_s + 5.0,
            health_check_interval=30,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 1),
            retry_on_error=[RedisConnectionError])
        self._promote = self.client.register_script(_PROMOTE)
        self._delay = self.client.register_script(_DELAY)
        self._claim = self.client.register_script(_CLAIM)
        self._settle = self.client.register_script(_SETTLE)
        self._forget = self.client.register_script(_FORGET)
        self._healthy = True
        self._fault = ""

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    @property
    def healthy(self) -> bool:
        return self._healthy

    async def start(self) -> None:
        """Create the stream and the group (reading from the stream's start, so nothing
        published before any consumer existed is skipped); an existing group is kept."""

        async def create() -> None:
            try:
                await self.client.xgroup_create(self.stream, self.group, id="0",
                                                mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

        await self._call(f"creating group {self.group!r} on {self.stream!r}", create)
        await self._forget_gone_consumers()

    async def _forget_gone_consumers(self) -> None:
        """Every process is a consumer of its own, and Redis keeps each for good: those
        that hold nothing and were idle for a day (gone processes) are deleted, each
        checked and deleted in one script (one that read an entry in between would
        drop it from the pending list)."""
        await self._call("consumers", lambda: self._forget(
            keys=[self.stream], args=[self.group, self.gone_after_ms]))

    async def close(self) -> None:
        await self.client.aclose()

    async def _call(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        metrics.QUEUE_CALLS.labels(what.split(" ")[0]).inc()
        try:
            result = await call()
        except ResponseError as exc:
            # Redis answered: it is up, and refused this command (no group, a wrong type
            # under our key, an ACL): the caller decides; nothing to report as an outage.
            self._up()
            raise QueueError(f"redis {what}: {exc}") from exc
        except RedisError as exc:
            fault = f"{type(exc).__name__}: {exc}"
            if self._healthy or fault != self._fault:
                log.warning("redis %s failed: %s", what, fault,
                            extra={"action": "queue_unavailable"})
            self._healthy, self._fault = False, fault
            raise QueueError(f"redis {what}: {fault}") from exc
        self._up()
        return result

    def _up(self) -> None:
        if not self._healthy:
            log.info("redis answers again", extra={"action": "queue_available"})
        self._healthy, self._fault = True, ""

    async def publish(self, messages: Sequence[Message], delay_s: float = 0.0) -> list[str]:
        if not messages:
            return []
        ids = [secrets.token_hex(12) for _ in messages]
        bodies = [orjson.dumps({"id": mid, "run_id": m.run_id, "operation_id": m.operation_id,
                                "recipient_id": m.recipient_id})
                  for mid, m in zip(ids, messages, strict=True)]
        if delay_s > 0:
            delay_ms = max(1, int(delay_s * 1000 + 0.999))  # never due before its wait
            await self._call("publish", lambda: self._delay(
                keys=[self.delayed], args=[delay_ms, *bodies]))
            return ids

        async def add() -> None:
            # One transaction: all of them stored, or none (a retry adds no half batch).
            async with self.client.pipeline(transaction=True) as pipe:
                for body in bodies:
                    pipe.xadd(self.stream, {"m": body})
                await pipe.execute()

        await self._call("publish", add)
        return ids

    async def _due(self) -> float | None:
        """Move due delayed messages into the stream; seconds until the next one."""
        reply: Any = await self._call("promote", lambda: self._promote(
            keys=[self.stream, self.delayed], args=[PROMOTE_BATCH]))
        moved, next_ms = reply
        if int(moved) >= PROMOTE_BATCH:
            return 0.0
        return None if int(next_ms) < 0 else max(0.0, int(next_ms) / 1000)

    async def receive(self, max_messages: int, lease_s: float) -> list[Delivery]:
        try:
            return await self._receive(max_messages, lease_s)
        except QueueError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The server lost the group (restarted without persistence, or someone
            # deleted the stream): make it again. What it held is the ledger's to
            # republish (redrive), as after any lost message.
            log.warning("redis stream %s has no group %r; created again", self.stream,
                        self.group, extra={"action": "queue_group_recreated"})
            await self.start()
            return []

    async def _receive(self, max_messages: int, lease_s: float) -> list[Delivery]:
        await self._due()
        # The lease is the group's: entries idle longer than it are claimable by anyone.
        idle_ms = int(lease_s * 1000)
        entries: list[tuple[str, Any, int]] = [
            (_text(e[0]), e[1], int(e[2])) for e in await self._call(
                "claim", lambda: self._claim(keys=[self.stream, self.leases], args=[
                    self.group, self.consumer, idle_ms, max_messages]))]
        if len(entries) < max_messages:
            read: Any = await self._call("read", lambda: self.client.xreadgroup(
                self.group, self.consumer, {self.stream: ">"},
                count=max_messages - len(entries)))
            for _, items in read or ():
                entries += [(_text(entry_id), fields, 1) for entry_id, fields in items]
        out = []
        for entry_id, fields, count in entries:
            delivery = self._delivery(entry_id, fields, count)
            if delivery is None:
                # Not one of ours (another producer, a corrupted entry): it can never be
                # worked and the ledger is not missing it. Removed, counted, said.
                log.warning("redis entry %s of %s has no operation in it; acked and dropped",
                            entry_id, self.stream, extra={"action": "message_malformed"})
                metrics.QUEUE_DROPPED.labels("malformed").inc()
                await self._settle_entry(entry_id, count, "ack")
            else:
                out.append(delivery)
        return out

    def _delivery(self, entry_id: str, fields: Any, count: int) -> Delivery | None:
        try:
            raw = fields.get(b"m", fields.get("m")) if isinstance(fields, dict) else None
            if raw is None and isinstance(fields, list):
                # A script's reply: the fields as a flat list of name, value pairs.
                pairs = dict(zip(fields[::2], fields[1::2], strict=True))
                raw = pairs.get(b"m", pairs.get("m"))
            if raw is None:
                return None
            doc = orjson.loads(raw)
            message = Message(run_id=doc["run_id"], operation_id=doc["operation_id"],
                              recipient_id=doc["recipient_id"])
            mid = doc["id"]
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None
        if not all(isinstance(v, str) and v for v in (*vars_of(message), mid)):
            return None
        return Delivery(message, mid, f"{entry_id} {self.consumer} {count}")

    async def _settle_entry(self, entry_id: str, count: int, how: str | int) -> int:
        result = await self._call("ack" if how == "ack" else "extend", lambda: self._settle(
            keys=[self.stream, self.leases],
            args=[self.group, entry_id, self.consumer, count, how]))
        return int(result)

    async def wait(self, timeout_s: float) -> None:
        due = await self._due()
        if due is not None:
            timeout_s = min(timeout_s, due)
        timeout_ms = int(min(timeout_s, self.max_block_s) * 1000)
        if timeout_ms <= 0:
            return
        # Anything not yet delivered to the group returns at once; otherwise the next
        # XADD (ours or another replica's) ends the block.
        try:
            groups = await self._call("wait", lambda: self.client.xinfo_groups(self.stream))
        except QueueError as exc:
            if "no such key" not in str(exc):
                raise
            return  # no stream: the next receive makes it (and the group) again
        last = next((g.get("last-delivered-id") for g in groups
                     if _text(g.get("name")) == self.group), None)
        await self._call("wait", lambda: self.client.xread(
            {self.stream: _text(last) if last is not None else "$"}, count=1,
            block=timeout_ms))

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            entry_id, consumer, count = _receipt(d)
            if consumer != self.consumer:
                continue  # another process's delivery: its lease decides, not our ack
            await self._settle_entry(entry_id, count, "ack")

    async def nack(self, delivery: Delivery, delay_s: float) -> None:
        raise Unsupported("redis: nack (capabilities.nack is False; the courier publishes "
                          "a delayed copy instead)")

    async def extend(self, delivery: Delivery, lease_s: float) -> bool:
        entry_id, consumer, count = _receipt(delivery)
        if consumer != self.consumer:
            return False
        # Idle again from now, and held until now + lease_s: claimers skip an entry whose
        # extension has not run out, however long the group's lease.
        return await self._settle_entry(entry_id, count, max(1, int(lease_s * 1000))) == 1

    async def stats(self) -> QueueStats:
        async def read() -> tuple[Any, Any, Any, Any]:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.xinfo_groups(self.stream)
                pipe.zcard(self.delayed)
                pipe.time()
                pipe.xlen(self.stream)
                groups, parked, now, length = await pipe.execute()
            return groups, parked, now, length

        groups, parked, now, length = await self._call("stats", read)
        group: dict[str, Any] = next(
            (g for g in groups if _text(g.get("name")) == self.group), {})
        leased = int(group.get("pending", 0) or 0)
        depth = max(0, int(length) - leased)
        oldest = 0.0
        if depth:
            last = _text(group.get("last-delivered-id", "0-0"))
            first = await self._call("stats", lambda: self.client.xrange(
                self.stream, min=f"({last}" if last != "0-0" else "-", count=1))
            if first:
                born_ms = int(_text(first[0][0]).split("-")[0])
                now_ms = int(now[0]) * 1000 + int(now[1]) // 1000
                oldest = max(0.0, (now_ms - born_ms) / 1000)
        return QueueStats(depth=depth, parked=int(parked), leased=leased,
                          oldest_claimable_age_s=oldest)


def vars_of(m: Message) -> tuple[str, str, str]:
    return (m.run_id, m.operation_id, m.recipient_id)


def _receipt(d: Delivery) -> tuple[str, str, int]:
    entry_id, consumer, count = d.receipt.split(" ")
    return entry_id, consumer, int(count)
