"""``cleanup-supervisor dlq-redrive``: dead-lettered Infrai messages back to the queue,
through the console script against the emulator process."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import E2E, Infrai

pytestmark = pytest.mark.e2e


@pytest.fixture
async def emulator(e2e: E2E) -> Infrai:
    return await e2e.infrai("--nack-route", "/v1/queue/nack")


async def call(e2e: E2E, emu: Infrai, path: str, body: dict[str, object]) -> dict[str, Any]:
    async with e2e.http.post(emu.url + path, json=body,
                             headers={"Authorization": f"Bearer {emu.key}"}) as resp:
        answer: dict[str, Any] = await resp.json()
    return answer


async def test_dlq_redrive_moves_dead_letters_back(e2e: E2E, emulator: Infrai,
                                                   tmp_path: Path) -> None:
    await call(e2e, emulator, "/v1/queue/create", {"name": "ops-dlq"})
    await call(e2e, emulator, "/v1/queue/create", {"name": "ops", "dead_letter_queue": "ops-dlq",
                                                   "max_retries": 1})
    await call(e2e, emulator, "/v1/queue/publish",
               {"queue": "ops", "payload": {"operation_id": "op_1"}})
    [message] = (await call(e2e, emulator, "/v1/queue/consume", {"queue": "ops"})
                 )["data"]["messages"]
    await call(e2e, emulator, "/v1/queue/nack",
               {"queue": "ops", "message_id": message["message_id"]})
    assert (await call(e2e, emulator, "/v1/queue/consume", {"queue": "ops"})
            )["data"]["messages"] == []
    cfg = tmp_path / "cleanup.toml"
    cfg.write_text(f'[queue]\nbackend = "infrai"\n[infrai]\nbase_url = "{emulator.url}"\n'
                   'queue = "ops"\n', encoding="utf-8")
    env = {**os.environ, "INFRAI_API_KEY": emulator.key, "CLEANUP_TRIGGER_TOKEN": "t" * 32}
    code, out, err = await e2e.cli("dlq-redrive", "-c", str(cfg), env=env)
    assert code == 0, err
    assert json.loads(out) == {"queue": "ops", "result": {"moved": 1}}
    assert emulator.key not in out + err
    [back] = (await call(e2e, emulator, "/v1/queue/consume", {"queue": "ops"}))["data"]["messages"]
    assert back["payload"] == {"operation_id": "op_1"}


async def test_dlq_redrive_refuses_the_embedded_queue(e2e: E2E) -> None:
    env = {**os.environ, "CLEANUP_TRIGGER_TOKEN": "t" * 32}
    code, _, err = await e2e.cli("dlq-redrive", env=env)
    assert code == 2
    assert "queue.backend is not 'infrai'" in err


async def test_cron_apply_sends_the_tick_token_and_shows_no_token(
        e2e: E2E, emulator: Infrai, tmp_path: Path) -> None:
    cfg = tmp_path / "cleanup.toml"
    cfg.write_text(f'[schedule]\ncron = "0 2 * * 1"\nclock = "external"\n'
                   f'[infrai]\nbase_url = "{emulator.url}"\n'
                   'trigger_url = "https://cleanup.example.com/v1/runs"\n', encoding="utf-8")
    operator, tick = "o" * 32, "k" * 32
    env = {**os.environ, "INFRAI_API_KEY": emulator.key, "CLEANUP_TRIGGER_TOKEN": operator}
    apply = ("infrai", "cron", "apply", "-c", str(cfg))
    code, _, err = await e2e.cli(*apply, env=env)
    # Never the operator token at Infrai: without a tick token nothing is sent.
    assert code == 2
    assert "trigger.tick_token_env: $CLEANUP_TICK_TOKEN" in err
    code, out, err = await e2e.cli(*apply, env={**env, "CLEANUP_TICK_TOKEN": tick})
    assert code == 0, err
    assert json.loads(out)["result"] == "created"
    for secret in (operator, tick, emulator.key):
        assert secret not in out + err
    code, out, err = await e2e.cli("infrai", "cron", "status", "-c", str(cfg), env=env)
    assert code == 0, err  # status needs no tick token
    assert json.loads(out)["job"]["name"] == "cleanup-weekly"
