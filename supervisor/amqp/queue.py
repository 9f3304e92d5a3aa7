"""RabbitMQ as the work queue (``queue.backend = "rabbitmq"``), through ``aio-pika``.

One durable quorum queue per deployment, pulled (``basic.get``) with manual acks: the
consumer pool asks for what its idle workers and ``queue.prefetch`` can take, one round
trip a message, and a push consumer's prefetch window would hold messages nobody asked
for. A wait reads the queue's ready count every 0.2 s (a publish of our own ends it at
once). RabbitMQ has no visibility timeout: a message delivered to a channel is that
channel's until it is acked, rejected, or the channel closes (then the broker requeues it
at once). So the lease is ours: a delivery handed out by :meth:`RabbitQueue.receive`
and neither acked nor extended within its lease is handed back (``basic.reject`` with
requeue), as a managed queue's visibility timeout would; and the broker's own
``consumer_timeout`` (30 minutes by default), which closes a channel holding a message
that long, is never reached: no hold is extended past MAX_HOLD_S (25 minutes).

Delivery tags live and die with their channel. Each delivery carries the channel's
generation; an ack of a delivery from a channel since closed is not sent (the tag would
name nothing, or another message on a channel of the same number): the broker already
requeued that message, and its redelivery finds the operation settled and is dropped.
Nothing is acked twice, nothing is lost.

The queue's ``x-delivery-limit`` is set above ``queue.max_receives``, so the ledger, which
counts receives and ends an operation received too often as failed, always decides
before the broker would drop a message (RabbitMQ 4 drops at 20 unless told otherwise).

Delays: a message due later waits in a delay queue whose TTL is one of :data:`DELAYS`
(the shortest not shorter than the delay: a retry never comes early, at most 2.5 x late)
and is dead-lettered into the work queue when it expires. One TTL per delay queue means
every message in it expires in the order it came, so no long delay holds a short one back.
Longer than the longest: the ledger keeps it and redrive publishes it when due.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import aio_pika
import orjson
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
)
from aio_pika.exceptions import AMQPError, ChannelInvalidStateError
from aiormq.exceptions import AMQPError as AiormqError

from supervisor import metrics
from supervisor.errors import PartialPublish, QueueError
from supervisor.model import Delivery, Message, QueueStats
from supervisor.queue.base import Capabilities, Unsupported

log = logging.getLogger(__name__)

# The delay queues' TTLs, in seconds. A delay is rounded up to the next one.
DELAYS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600,
          43200, 86400, 172800, 345600, 604800)
# Above the ledger's own limit: the ledger decides, the broker never drops first.
DELIVERY_LIMIT_MARGIN = 5
CONNECT_TIMEOUT_S = 10.0
WAIT_POLL_S = 0.2
# The longest a delivery is held: under RabbitMQ's default consumer_timeout (1800 s),
# which closes a channel holding an unacked message that long.
MAX_HOLD_S = 1500.0
# Each receive is a round trip per message: a few kept in hand so no worker waits on one.
DEFAULT_PREFETCH = 10
_FAULTS = (AMQPError, AiormqError, ConnectionError, OSError, asyncio.TimeoutError,
           ChannelInvalidStateError)  # a channel closed under the call


def delay_for(delay_s: float) -> float | None:
    """The delay queue's TTL for ``delay_s``: the shortest not shorter (None: too long)."""
    return next((d for d in DELAYS if d >= delay_s), None)


@dataclass
class _Held:
    message: AbstractIncomingMessage
    generation: int
    expiry: asyncio.TimerHandle | None = None
    since: float = 0.0  # when it was received (loop time): no hold outlives MAX_HOLD_S


class RabbitQueue:
    """:class:`~supervisor.queue.base.Queue` on one quorum queue of one broker."""

    def __init__(self, url: str, queue: str, max_receives: int) -> None:
        self.url = url
        self.name = queue
        self.max_receives = max_receives
        self._capabilities = Capabilities(
            transactional_ack=False, extend=True, nack=False, stats=False,
            max_delay_s=float(DELAYS[-1]), billed=False, default_prefetch=DEFAULT_PREFETCH)
        self._connection: AbstractConnection | None = None
        self._opening = asyncio.Lock()
        self._token = secrets.token_hex(6)
        # A call failed on a channel that does not know yet it was closed: open anew.
        self._broken = False
        self._publish_channel: AbstractChannel | None = None
        self._consume_channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._generation = 0  # the consuming channel's life: bumped when it closes
        self._published = asyncio.Event()  # a publish of ours: a wait ends at once
        # Publishes of ours, and how many the last receive had seen: one landing between
        # an empty receive and the wait after it still ends that wait.
        self._published_n = self._seen_n = 0
        self._held: dict[str, _Held] = {}  # receipt -> the delivery handed out
        self._delay_queues: set[float] = set()
        self._closing = False
        # Set each time the connection has been opened again after a close.
        self.reopened = asyncio.Event()
        self._fault = ""

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def healthy(self) -> bool:
        return self._open()

    # -- life ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self._ensure()

    async def _ensure(self) -> None:
        """A connection with both channels open, opened again when the broker closed
        anything (a restart, a failover, close_all_connections, a channel error).

        Ours, not aio-pika's robust connection: its channel reopening raced a closed
        connection and left a channel closed for good (seen under close_all_connections).
        A new connection is a new generation: the old channel's tags are dead, and the
        broker has requeued what they held."""
        if self._open():
            return
        async with self._opening:
            if self._open():
                return
            if self._connection is not None:
                self._lost()
                with contextlib.suppress(*_FAULTS, RuntimeError):
                    await self._connection.close()
                self._connection = None
            try:
                connection = await aio_pika.connect(
                    self.url, timeout=CONNECT_TIMEOUT_S,
                    client_properties={"connection_name": f"cleanup-supervisor:{self.name}"})
                try:
                    self._publish_channel = await connection.channel(publisher_confirms=True)
                    self._consume_channel = await connection.channel(publisher_confirms=False)
                    self._queue = await self._consume_channel.declare_queue(
                        self.name, durable=True, arguments={
                            "x-queue-type": "quorum",
                            "x-delivery-limit": self.max_receives + DELIVERY_LIMIT_MARGIN})
                except BaseException:
                    with contextlib.suppress(*_FAULTS, RuntimeError):
                        await connection.close()
                    raise
            except (*_FAULTS, ValueError) as exc:  # ValueError: a URL it cannot parse
                raise QueueError(f"rabbitmq: cannot open queue {self.name!r}: "
                                 f"{_describe(exc)}") from exc
            self._connection, self._broken = connection, False
            self._delay_queues.clear()  # declared again on the new channel when used
            if self._generation:
                self.reopened.set()
                log.info("rabbitmq connection open again", extra={"action": "queue_available"})
            self._generation += 1

    def _open(self) -> bool:
        c, pub, con = self._connection, self._publish_channel, self._consume_channel
        return (not self._broken and c is not None and not c.is_closed and pub is not None
                and not pub.is_closed and con is not None and not con.is_closed)

    def _lost(self) -> None:
        """The connection or a channel closed: what it held is the broker's again."""
        for held in self._held.values():
            if held.expiry is not None:
                held.expiry.cancel()
        self._held.clear()
        if not self._closing:
            log.warning("rabbitmq connection or channel closed; its unacked messages are "
                        "requeued by the broker", extra={"action": "queue_unavailable"})

    async def close(self) -> None:
        self._closing = True
        for held in self._held.values():
            if held.expiry is not None:
                held.expiry.cancel()
        self._held.clear()
        if self._connection is not None:
            with contextlib.suppress(*_FAULTS, RuntimeError):
                await self._connection.close()

    # -- the protocol ----------------------------------------------------------------------

    async def publish(self, messages: Sequence[Message], delay_s: float = 0.0) -> list[str]:
        if not messages:
            return []
        await self._ensure()
        assert self._publish_channel is not None
        routing = self.name
        if delay_s > 0:
            ttl = delay_for(delay_s)
            if ttl is None:
                raise QueueError(f"rabbitmq: delay {delay_s} s is past the longest "
                                 f"({DELAYS[-1]} s)")
            routing = await self._delay_queue(ttl)
        ids = [secrets.token_hex(12) for _ in messages]
        exchange = self._publish_channel.default_exchange
        metrics.QUEUE_CALLS.labels("publish").inc(len(messages))  # one confirm each
        # Publisher confirms: each publish returns once the broker has the message (a
        # quorum queue: once a majority has written it). Those confirmed are named even
        # when others failed, so the ledger records them (else each is published again).
        results = await asyncio.gather(*(exchange.publish(aio_pika.Message(
            orjson.dumps({"run_id": m.run_id, "operation_id": m.operation_id,
                          "recipient_id": m.recipient_id}),
            message_id=mid, content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT), routing_key=routing)
            for mid, m in zip(ids, messages, strict=True)), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            self._broken = True
            if not isinstance(failed[0], Exception):
                raise failed[0]  # a cancellation, not a failed publish
            if not isinstance(failed[0], _FAULTS):
                raise failed[0]
            raise PartialPublish(
                [None if isinstance(r, BaseException) else mid
                 for mid, r in zip(ids, results, strict=True)],
                QueueError(f"rabbitmq publish: {_describe(failed[0])}"))
        if delay_s <= 0:
            self._published_n += 1
            self._published.set()
        return ids

    async def _delay_queue(self, ttl: float) -> str:
        name = f"{self.name}.delay.{ttl:g}s"
        if ttl not in self._delay_queues:
            assert self._publish_channel is not None
            try:
                await self._publish_channel.declare_queue(name, durable=True, arguments={
                    "x-queue-type": "quorum", "x-message-ttl": int(ttl * 1000),
                    "x-dead-letter-exchange": "", "x-dead-letter-routing-key": self.name,
                    # quorum queues dead-letter at least once (3.10+): not lost on the way
                    "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"})
            except _FAULTS as exc:
                raise QueueError(f"rabbitmq: cannot declare delay queue {name!r}: "
                                 f"{_describe(exc)}") from exc
            self._delay_queues.add(ttl)
        return name

    async def receive(self, max_messages: int, lease_s: float) -> list[Delivery]:
        # Pulled (basic.get), one message per round trip: the pool asks for what its idle
        # workers and queue.prefetch can take, and a push consumer's prefetch window would
        # hold messages nobody asked for (each under no lease of ours).
        await self._ensure()
        out: list[Delivery] = []
        self._seen_n = self._published_n
        retried = False
        while len(out) < max_messages:
            metrics.QUEUE_CALLS.labels("get").inc()
            # Read together each time: another task may have opened a new connection,
            # and a message is its channel's generation, never an older one's.
            generation, queue = self._generation, self._queue
            assert queue is not None
            try:
                message = await queue.get(no_ack=False, fail=False)
            except _FAULTS as exc:
                self._broken = True
                if out:
                    break  # what was taken is handed out; the next call opens anew
                if not retried:
                    # The broker closed the channel under us: once more, on a new one.
                    retried = True
                    await self._ensure()
                    continue
                raise QueueError(f"rabbitmq receive: {_describe(exc)}") from exc
            if message is None:
                break
            delivery = self._delivery(message, generation)
            if delivery is None:
                log.warning("rabbitmq message %s on %s has no operation in it; acked and "
                            "dropped", message.message_id, self.name,
                            extra={"action": "message_malformed"})
                metrics.QUEUE_DROPPED.labels("malformed").inc()
                with contextlib.suppress(*_FAULTS, ChannelInvalidStateError):
                    await message.ack()
                continue
            self._hold(delivery.receipt, message, generation, lease_s)
            out.append(delivery)
        return out

    def _delivery(self, message: AbstractIncomingMessage, generation: int) -> Delivery | None:
        try:
            doc = orjson.loads(message.body)
            m = Message(run_id=doc["run_id"], operation_id=doc["operation_id"],
                        recipient_id=doc["recipient_id"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return None
        if not all(isinstance(v, str) and v for v in (m.run_id, m.operation_id,
                                                      m.recipient_id)):
            return None
        mid = message.message_id or f"tag-{generation}-{message.delivery_tag}"
        # The instance's token: tags restart at 1 on every channel of every process,
        # and the receipt is the ledger's attempt owner.
        return Delivery(m, mid, f"{self._token}:{generation}:{message.delivery_tag}")

    def _hold(self, receipt: str, message: AbstractIncomingMessage, generation: int,
              lease_s: float) -> None:
        loop = asyncio.get_running_loop()
        held = self._held.get(receipt) or _Held(message, generation, since=loop.time())
        if held.expiry is not None:
            held.expiry.cancel()
        held.expiry = loop.call_later(lease_s, self._expire, receipt)
        self._held[receipt] = held

    def _expire(self, receipt: str) -> None:
        held = self._held.pop(receipt, None)
        if held is None or held.generation != self._generation:
            return
        # The lease ran out: handed back, as a visibility timeout would.
        task = asyncio.get_running_loop().create_task(self._reject(held.message))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _reject(self, message: AbstractIncomingMessage) -> None:
        with contextlib.suppress(*_FAULTS, ChannelInvalidStateError):
            await message.reject(requeue=True)

    async def wait(self, timeout_s: float) -> None:
        """Until a publish of ours, the queue shows a ready message (another replica's,
        a delayed one dead-lettered in, one handed back), or ``timeout_s``. AMQP tells a
        pulling client nothing: the queue's ready count is read every WAIT_POLL_S."""
        if self._published_n != self._seen_n:
            return  # a publish of ours since the last receive
        self._published.clear()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (left := deadline - loop.time()) > 0:
            if await self._ready() > 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(WAIT_POLL_S, left)):
                    await self._published.wait()
                    return

    async def _ready(self) -> int:
        await self._ensure()
        assert self._consume_channel is not None
        metrics.QUEUE_CALLS.labels("ready").inc()
        try:
            # On the raw channel: aio-pika's own declare answers from what it declared.
            raw = await self._consume_channel.get_underlay_channel()
            declared = await raw.queue_declare(self.name, passive=True)
        except _FAULTS as exc:
            self._broken = True
            raise QueueError(f"rabbitmq wait: {_describe(exc)}") from exc
        return int(declared.message_count or 0)

    async def ack(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            held = self._held.pop(d.receipt, None)
            if held is None:
                continue  # its lease ran out, or its channel closed: the broker has it
            if held.expiry is not None:
                held.expiry.cancel()
            if held.generation != self._generation:
                continue
            metrics.QUEUE_CALLS.labels("ack").inc()
            try:
                await held.message.ack()
            except ChannelInvalidStateError:
                continue  # closed under us: requeued by the broker
            except _FAULTS as exc:
                raise QueueError(f"rabbitmq ack: {_describe(exc)}") from exc

    async def nack(self, delivery: Delivery, delay_s: float) -> None:
        raise Unsupported("rabbitmq: nack (capabilities.nack is False; the courier "
                          "publishes a delayed copy instead)")

    async def extend(self, delivery: Delivery, lease_s: float) -> bool:
        held = self._held.get(delivery.receipt)
        if held is None or held.generation != self._generation or not self._open():
            return False  # its channel closed (the broker has it again) or is closing
        if asyncio.get_running_loop().time() - held.since + lease_s > MAX_HOLD_S:
            # The broker's consumer_timeout would close the channel under every delivery
            # on it: this one is given up instead (the caller defers it: a copy is
            # published and this one acked, or it is handed back when its lease ends).
            return False
        self._hold(delivery.receipt, held.message, held.generation, lease_s)
        return True

    async def stats(self) -> QueueStats:
        raise Unsupported("rabbitmq: stats (capabilities.stats is False)")


_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")


def _describe(exc: BaseException) -> str:
    """The fault's kind and text, a URL's password in it masked (an error may quote the
    URL it was connecting to)."""
    text = _PASSWORD.sub(r"\1***@", str(exc) or type(exc).__name__)
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
