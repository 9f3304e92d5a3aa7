"""Ticks on an Infrai queue: the :class:`~supervisor.ticks.TickSource` the tick puller
takes, over a channel of the tick queue's own."""

from __future__ import annotations

import logging
from typing import Any

from supervisor.infrai.channel import InfraiChannel

log = logging.getLogger(__name__)


class InfraiTicks:
    def __init__(self, channel: InfraiChannel) -> None:
        self.channel = channel

    async def take(self, max_ticks: int, lease_s: float) -> list[tuple[str, Any]]:
        taken = []
        for item in await self.channel.consume(max_ticks, lease_s):
            message_id = item.get("message_id") if isinstance(item, dict) else None
            if not isinstance(message_id, str) or not message_id:
                # Nothing to ack it by: it cannot be taken, only said.
                log.warning("tick queue answered an item without a message_id: %r", item)
                continue
            taken.append((message_id, item.get("payload", item.get("body"))))
        return taken

    async def ack(self, tick_id: str) -> None:
        await self.channel.ack_id(tick_id)

    async def put(self, payload: dict[str, Any]) -> str:
        return await self.channel.publish_payload(payload)
