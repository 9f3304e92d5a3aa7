"""A webhook events sink on loopback, for the demos, the tools in bench/ and the tests.

It verifies each delivery's signature as a real receiver must (HMAC-SHA256 of
``"<timestamp>." + body``), keeps each event ID once (delivery is at least once) and,
while :attr:`down`, answers 503 as a sink in an outage would, so the relay's lag and
retries have something to do.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import orjson
from aiohttp import web

from supervisor.events.sinks import SIGNATURE_HEADER, TIMESTAMP_HEADER


class WebhookSink:
    def __init__(self, name: str = "hook", secret_env: str = "SANDBOX_HOOK_SECRET") -> None:
        self.name = name
        self.secret_env = secret_env  # the service reads the secret from this variable
        self.secret = secrets.token_urlsafe(24)
        self.down = False
        self.ids: set[str] = set()
        self.deliveries = 0
        self.refused = 0  # answered 503 while down
        self.bad_signatures = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    @property
    def events(self) -> int:
        """Distinct events taken."""
        return len(self.ids)

    def sink(self) -> dict[str, str]:
        """Its ``[[events.sink]]`` entry (the secret goes in the service's environment)."""
        return {"name": self.name, "kind": "webhook", "url": self.url,
                "secret_env": self.secret_env}

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/events", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/events"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> WebhookSink:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        ts = request.headers.get(TIMESTAMP_HEADER, "")
        want = "sha256=" + hmac.new(self.secret.encode(), ts.encode() + b"." + body,
                                    hashlib.sha256).hexdigest()
        if not hmac.compare_digest(request.headers.get(SIGNATURE_HEADER, ""), want):
            self.bad_signatures += 1
            return web.Response(status=401)
        if self.down:
            self.refused += 1
            return web.Response(status=503)
        self.deliveries += 1
        self.ids.update(e["id"] for e in orjson.loads(body)["events"])
        return web.Response(status=204)
