"""One Infrai queue as a raw channel: any small JSON payload in, raw items out, acked by
message ID, and the queue's administration (creation, the dead-letter redrive).

The work queue's :class:`~supervisor.infrai.queue.InfraiQueue` is a ``Queue`` over one of
these; ticks (supervisor/infrai/tick_source.py), the events sink and the CLI use the
channel itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from typing import Any
from urllib.parse import quote

from supervisor.errors import QueueError
from supervisor.infrai.client import InfraiClient, InfraiError
from supervisor.infrai.settings import InfraiConfig

log = logging.getLogger(__name__)

# An ack that finds the message gone or re-leased did not fail us: a redelivery of a
# settled operation is acked again on sight.
ACK_GONE = frozenset({"MESSAGE_NOT_FOUND", "LEASE_EXPIRED", "NOT_FOUND"})


def gone(exc: InfraiError) -> bool:
    """Whether a refusal says the message is no longer ours to act on."""
    return exc.code in ACK_GONE or exc.status == 404


class InfraiChannel:
    def __init__(self, config: InfraiConfig, client: InfraiClient | None = None) -> None:
        self.config = config
        self.client = client or InfraiClient(config)
        self._created = False
        self._publishes = asyncio.Semaphore(config.publish_concurrency)

    @property
    def healthy(self) -> bool:
        return self.client.blocked is None

    async def start(self) -> None:
        await self.client.start()

    async def close(self) -> None:
        await self.client.close()

    async def ensure_queues(self) -> None:
        """Create the dead-letter queue, then the queue (once; an existing one is kept).
        Called before the first call that needs them, so a key refused at start blocks
        consumption instead of failing the start."""
        if self._created or not self.config.create_queues:
            return
        c = self.config
        if c.dlq:
            await self._create({"name": c.dlq, "type": "standard"})
        body: dict[str, Any] = {"name": c.queue, "type": "standard", "max_retries": c.max_retries}
        if c.dlq:
            body["dead_letter_queue"] = c.dlq
        await self._create(body)
        self._created = True

    async def _create(self, body: dict[str, Any]) -> None:
        try:
            await self.client.call("queue.create", "/v1/queue/create", body,
                                   idempotency_key=f"create-{body['name']}")
        except InfraiError as exc:
            if exc.status != 409:  # it exists already: what we wanted
                raise
        log.info("Infrai queue %s ready", body["name"], extra={"action": "queue_created"})

    async def publish_body(self, body: dict[str, Any], key: str | None = None) -> str:
        """One ``queue.publish`` of ``body`` (the queue named in it); returns the message
        ID. Call :meth:`ensure_queues` first."""
        # One key per message of this call, kept across its retries: a publish that acted
        # before its answer was lost is not a second message. Never derived from the
        # operation alone: a redrive must create a new message, not replay a lost one.
        key = key or f"pub-{body['payload'].get('operation_id', 'msg')}-{secrets.token_hex(6)}"
        async with self._publishes:
            data = await self.client.call("queue.publish", "/v1/queue/publish", body,
                                          idempotency_key=key)
        message_id = data.get("message_id") if isinstance(data, dict) else None
        if not isinstance(message_id, str) or not message_id:
            raise QueueError(f"Infrai queue.publish answered no message_id: {data!r}"[:300])
        return message_id

    async def publish_payload(self, payload: dict[str, Any], key: str | None = None) -> str:
        """One message with any small JSON payload (a tick, an event). ``key``: the same
        content under the same key is one message (an event batch sent again after a
        lost answer)."""
        await self.ensure_queues()
        return await self.publish_body({"queue": self.config.queue, "payload": payload}, key)

    async def consume(self, max_messages: int, lease_s: float) -> list[Any]:
        """The raw items of one consume call, in either documented answer shape."""
        await self.ensure_queues()
        data = await self.client.call("queue.consume", "/v1/queue/consume", {
            "queue": self.config.queue, "max_messages": min(max_messages, self.config.max_batch),
            "visibility_timeout": math.ceil(lease_s)})
        items = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise QueueError(f"Infrai queue.consume answered no message list: {data!r}"[:300])
        return items

    async def ack_id(self, message_id: str) -> None:
        try:
            # A fresh key per ack: a key is replayed, and an ack refused once (lease
            # expired) must act when it is sent again under the next lease.
            await self.client.call("queue.ack", "/v1/queue/ack",
                                   {"queue": self.config.queue, "message_id": message_id},
                                   idempotency_key=f"ack-{message_id}-{secrets.token_hex(4)}")
        except InfraiError as exc:
            if not gone(exc):
                raise
            log.debug("ack of %s: %s (it comes back, and is acked then)", message_id, exc)

    async def redrive_dead_letters(self) -> Any:
        """Move the dead-letter queue's messages back (an operator's command)."""
        path = self.config.redrive_path.replace("{queue}", quote(self.config.queue, safe=""))
        return await self.client.call("queue.dlq.redrive", path, {"queue": self.config.queue},
                                      idempotency_key=f"redrive-{secrets.token_hex(6)}")
