"""The Celery beat caller's HTTP half (supervisor/callers/celery_beat.py) against a real
server on loopback answering each status the service can: what is done, what is retried
(and after how long), what fails at once and names why. The tasks on a real worker and
the real service: tests/e2e/test_celery_beat.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from supervisor.callers.celery_beat import (
    TickRefused,
    TickSettingsError,
    TickTarget,
    TickTransient,
    retry_countdown,
    send_tick,
)
from supervisor.configtypes import Secret
from tests.helpers import free_port

TOKEN = "tick-token-never-shown"
SLOT = "2026-12-07T02:00:00+00:00"


class Scripted:
    """A stand-in for ``POST /v1/runs`` answering what the test scripts, recording requests."""

    def __init__(self) -> None:
        self.answer: tuple[int, Any, dict[str, str]] = (201, {}, {})
        self.requests: list[tuple[dict[str, str], Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((dict(request.headers), await request.json()))
        status, body, headers = self.answer
        if body is None:
            return web.Response(status=status, headers=headers)
        return web.json_response(body, status=status, headers=headers)


@pytest.fixture
async def service() -> AsyncIterator[tuple[Scripted, str]]:
    scripted = Scripted()
    app = web.Application()
    app.router.add_post("/v1/runs", scripted.handle)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield scripted, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _target(url: str, **kw: Any) -> TickTarget:
    return TickTarget(url, Secret(TOKEN), **kw)


async def _send(url: str, slot: str | None = SLOT, **kw: Any) -> Any:
    return await asyncio.to_thread(send_tick, _target(url, **kw), slot)


async def test_a_tick_carries_its_slot_and_the_tick_token(service):
    scripted, url = service
    run = {"id": "run_1", "state": "scanning"}
    scripted.answer = (201, {"created": True, "run": run}, {})
    result = await _send(url)
    assert (result.status, result.outcome, result.run_id, result.state) == \
        (201, "opened", "run_1", "scanning")
    headers, body = scripted.requests[-1]
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert headers["Content-Type"] == "application/json"
    assert body == {"scheduled_for": SLOT}

    scripted.answer = (200, {"created": False, "run": run | {"state": "done"}}, {})
    result = await _send(url, schedule="weekly")
    assert (result.status, result.outcome, result.run_id) == (200, "found", "run_1")
    assert scripted.requests[-1][1] == {"schedule": "weekly", "scheduled_for": SLOT}
    # No slot: the service picks it (an external clock) or matches a recent run.
    await _send(url, slot=None)
    assert scripted.requests[-1][1] == {}


async def test_another_unfinished_run_is_a_skip_not_an_error(service):
    scripted, url = service
    scripted.answer = (409, {"error": "another run is unfinished", "active_run": "run_0"}, {})
    result = await _send(url)
    assert (result.status, result.outcome, result.run_id) == (409, "skipped", "run_0")


@pytest.mark.parametrize(("status", "retry_after", "expected"),
                         [(503, "5", 5.0), (500, None, None), (429, "7", 7.0), (502, "soon", None)])
async def test_5xx_and_429_are_retried_after_what_the_service_says(service, status, retry_after, expected):
    scripted, url = service
    headers = {"Retry-After": retry_after} if retry_after else {}
    scripted.answer = (status, {"error": "shutting down"}, headers)
    with pytest.raises(TickTransient, match=f"answered {status}: shutting down") as info:
        await _send(url)
    assert info.value.retry_after_s == expected
    # Retry-After when given (capped), else doubling from the base, jittered in its upper half.
    wait = retry_countdown(3, info.value, backoff_s=2.0, backoff_max_s=60.0)
    if expected is None:
        assert 8.0 <= wait <= 16.0
    else:
        assert wait == expected
    assert retry_countdown(10, info.value, 2.0, 6.0) <= 6.0


async def test_a_service_not_listening_or_not_answering_is_retried():
    with pytest.raises(TickTransient, match="Connection refused"):
        await _send(f"http://127.0.0.1:{free_port()}")

    hung_up = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Reads the request, never answers; ends when the client gives up and hangs up.
        while await reader.read(65536):
            pass
        writer.close()
        await writer.wait_closed()
        hung_up.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(TickTransient, match="timed out"):
            await _send(f"http://127.0.0.1:{port}", timeout_s=0.3)
        await asyncio.wait_for(hung_up.wait(), 5)
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(("status", "error", "named"), [
    (400, "scheduled_for must carry a UTC offset", "scheduled_for must carry a UTC offset"),
    (401, "unauthorized", "the token in $CLEANUP_TICK_TOKEN was refused"),
    (403, "the tick token opens runs of schedule 'e2e' only: schedule", "schedule 'e2e' only"),
    (404, "not found", "is $CLEANUP_URL the service's base URL?"),
    (302, None, "answered 302: (no error given)"),
])
async def test_other_answers_are_refused_at_once_naming_why(service, status, error, named):
    scripted, url = service
    scripted.answer = (status, {"error": error} if error else None,
                       {"Location": "/elsewhere"} if status == 302 else {})
    with pytest.raises(TickRefused) as info:
        await _send(url)
    assert f"answered {status}" in str(info.value)
    assert named in str(info.value)
    assert TOKEN not in str(info.value)
    assert len(scripted.requests) == 1  # a redirect is not followed


def test_settings_come_from_the_environment_and_name_what_is_missing(tmp_path):
    with pytest.raises(TickSettingsError) as info:
        TickTarget.from_env({})
    assert "$CLEANUP_URL is not set" in str(info.value)
    assert "$CLEANUP_TICK_TOKEN (or $CLEANUP_TICK_TOKEN_FILE) is not set" in str(info.value)
    with pytest.raises(TickSettingsError, match=r"\$CLEANUP_URL must be an http:// or https:// URL; "
                                                r"\$CLEANUP_TICK_TIMEOUT_SECONDS must be"):
        TickTarget.from_env({"CLEANUP_URL": "file:///etc/passwd", "CLEANUP_TICK_TOKEN": TOKEN,
                             "CLEANUP_TICK_TIMEOUT_SECONDS": "nan"})
    token_file = tmp_path / "tick"
    token_file.write_text(TOKEN + "\n")
    target = TickTarget.from_env({"CLEANUP_URL": "https://cleanup.internal:8080/",
                                  "CLEANUP_TICK_TOKEN_FILE": str(token_file),
                                  "CLEANUP_SCHEDULE": "weekly", "CLEANUP_TICK_TIMEOUT_SECONDS": "3"})
    assert (target.url, target.token.reveal(), target.schedule, target.timeout_s) == \
        ("https://cleanup.internal:8080", TOKEN, "weekly", 3.0)
    assert TOKEN not in repr(target)


def test_the_module_imports_without_celery():
    # Celery is the `celery` extra: the service (and its import checks) never load it.
    code = ("import sys, supervisor.callers.celery_beat, json; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('celery', 'kombu'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
