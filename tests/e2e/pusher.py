"""Infrai's push delivery as the service meets it, written here from the documented
contract and not from the service's code: messages are taken from the emulator's queue
with a visibility timeout, POSTed signed (HMAC-SHA256 over ``<timestamp>.<body>``) to the
service's ``/v1/push/{queue}``, acked at Infrai on a 2xx, and otherwise left to come back
when their visibility timeout ends. Infrai's own HTTP timeout per delivery is UNKNOWN;
this one gives up after ``delivery_timeout_s`` and, like a real pusher, delivers again
later while the first request may still be in the service's hands.

Beside the faithful part, two attacks the tests drive: :meth:`Pusher.duplicate` (the same
delivery POSTed twice at once, as an at-least-once pusher may) and :meth:`Pusher.replay`
(a captured signed delivery sent again, many times at once, from outside)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson


@dataclass
class Captured:
    body: bytes
    headers: dict[str, str]


@dataclass
class Pusher:
    infrai_url: str
    infrai_key: str
    queue: str
    push_url: str
    secret: str
    visibility_s: int = 6
    delivery_timeout_s: float = 5.0
    batch: int = 10
    duplicate_share: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    answers: Counter[int] = field(default_factory=Counter)
    captured: list[Captured] = field(default_factory=list)
    timeouts: int = 0
    _task: asyncio.Task[None] | None = None
    _http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._http = aiohttp.ClientSession()
        self._task = asyncio.create_task(self._loop(), name="pusher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._http is not None:
            await self._http.close()

    async def _infrai(self, path: str, body: dict[str, Any]) -> Any:
        assert self._http is not None
        async with self._http.post(
                f"{self.infrai_url}{path}", data=orjson.dumps(body),
                headers={"Authorization": f"Bearer {self.infrai_key}",
                         "Content-Type": "application/json"}) as r:
            doc = orjson.loads(await r.read() or b"null")
            if r.status != 200:
                return None
            return doc.get("data", doc) if isinstance(doc, dict) else doc

    def sign(self, body: bytes) -> dict[str, str]:
        ts = str(int(time.time()))
        sig = hmac.new(self.secret.encode(), ts.encode() + b"." + body, hashlib.sha256)
        return {"X-Infrai-Signature": "sha256=" + sig.hexdigest(), "X-Infrai-Timestamp": ts,
                "Content-Type": "application/json"}

    async def post(self, body: bytes, headers: dict[str, str]) -> int | None:
        """One delivery; None when it timed out (the service may still be working it)."""
        assert self._http is not None
        try:
            async with self._http.post(
                    self.push_url, data=body, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=self.delivery_timeout_s)) as r:
                await r.read()
                self.answers[r.status] += 1
                return r.status
        except TimeoutError:
            self.timeouts += 1
            return None
        except aiohttp.ClientError:
            return None  # the service is down (killed): the message comes back

    async def _deliver(self, item: dict[str, Any]) -> None:
        payload = item.get("payload", item.get("body"))
        body = orjson.dumps({"message_id": item["message_id"], "payload": payload})
        headers = self.sign(body)
        self.captured.append(Captured(body, headers))
        if self.rng.random() < self.duplicate_share:
            statuses = await asyncio.gather(self.post(body, headers),
                                            self.post(body, self.sign(body)))
        else:
            statuses = [await self.post(body, headers)]
        if any(s is not None and 200 <= s < 300 for s in statuses):
            await self._infrai("/v1/queue/ack", {"queue": self.queue,
                                                 "message_id": item["message_id"]})

    async def _loop(self) -> None:
        while True:
            data = await self._infrai("/v1/queue/consume", {
                "queue": self.queue, "max_messages": self.batch,
                "visibility_timeout": self.visibility_s})
            items = data.get("messages") if isinstance(data, dict) else data
            if not items:
                await asyncio.sleep(0.1)  # a poll period: the emulator has no long poll
                continue
            await asyncio.gather(*(self._deliver(i) for i in items
                                   if isinstance(i, dict) and "message_id" in i))

    async def replay(self, copies: int) -> Counter[int | None]:
        """A captured delivery, as it was signed, sent ``copies`` times at once."""
        assert self.captured, "nothing captured yet"
        c = self.rng.choice(self.captured)
        statuses = await asyncio.gather(*(self.post(c.body, c.headers) for _ in range(copies)))
        return Counter(statuses)
