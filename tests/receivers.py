"""A webhook receiver on a real loopback socket, as an events sink's receiver must be: it
checks every signature and its timestamp, and can refuse, vanish or hold an answer."""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any

import orjson
from aiohttp import web

from supervisor.events.sinks import SIGNATURE_HEADER, TIMESTAMP_HEADER, signature
from tests.helpers import free_port

HOOK_SECRET = "whsec_events_test"


class Hook:
    """A webhook receiver on a real loopback socket that checks every signature.

    ``status`` other than 200 answers every request with it (a receiver that is down but
    listening); :meth:`stop` closes the socket (connections refused). ``hold`` makes the
    receiver take a request's events and then never answer (an ack lost in the air)."""

    def __init__(self, secret: str = HOOK_SECRET, signed: str = "timestamp_body") -> None:
        self.secret = secret.encode()
        self.signed = signed
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.status = 200
        self.refusal = "down for maintenance"  # the body of a refusal
        self.retry_after: str | None = None  # the Retry-After header of a refusal
        self.events: list[dict[str, Any]] = []  # in arrival order, duplicates included
        self.requests: list[tuple[str, list[str]]] = []  # (Idempotency-Key, event IDs)
        self.sizes: list[int] = []  # each taken request's body, in bytes
        self.refused = 0  # requests answered with a non-2xx status
        self.bad_signatures = 0
        self.hold: asyncio.Event | None = None
        self.held = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        timestamp = request.headers.get(TIMESTAMP_HEADER, "")
        given = request.headers.get(SIGNATURE_HEADER, "")
        expected = signature(self.secret, timestamp, body, self.signed)
        fresh = timestamp.isdigit() and abs(time.time() - int(timestamp)) < 300
        if not (fresh and hmac.compare_digest(given, expected)):
            self.bad_signatures += 1
            return web.Response(status=401)
        if self.status != 200:
            self.refused += 1
            headers = {} if self.retry_after is None else {"Retry-After": self.retry_after}
            return web.Response(status=self.status, text=self.refusal, headers=headers)
        events = orjson.loads(body)["events"]
        self.events += events
        self.requests.append((request.headers["Idempotency-Key"], [e["id"] for e in events]))
        self.sizes.append(len(body))
        if self.hold is not None:
            self.held.set()
            await self.hold.wait()
        return web.Response(status=204)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/hook", self.handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            if self.hold is not None:
                self.hold.set()
            await self._runner.cleanup()
            self._runner = None

    def ids(self) -> list[str]:
        return [e["id"] for e in self.events]
