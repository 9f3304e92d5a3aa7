"""``cleanup-supervisor dlq-redrive``: dead-lettered Infrai messages back to the queue,
through the console script against the emulator process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.request import Request, urlopen

import pytest

pytestmark = pytest.mark.e2e

KEY, CONTROL = "ifr_cli_key", "control-key"


@pytest.fixture
def emulator() -> Iterator[str]:
    env = {**os.environ, "EMU_KEY": KEY, "EMU_CONTROL": CONTROL}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cleanup_sandbox.infrai", "--port", "0", "--key-env",
         "EMU_KEY", "--control-key-env", "EMU_CONTROL", "--nack-route", "/v1/queue/nack"],
        stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    try:
        yield json.loads(proc.stdout.readline())["url"]
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        proc.stdout.close()


def call(url: str, path: str, body: dict[str, object]) -> dict[str, object]:
    req = Request(url + path, data=json.dumps(body).encode(), method="POST",
                  headers={"Authorization": f"Bearer {KEY}",
                           "Content-Type": "application/json"})
    with urlopen(req, timeout=10) as resp:
        answer: dict[str, object] = json.loads(resp.read())
    return answer


def test_dlq_redrive_moves_dead_letters_back(emulator: str, tmp_path: Path) -> None:
    call(emulator, "/v1/queue/create", {"name": "ops-dlq"})
    call(emulator, "/v1/queue/create", {"name": "ops", "dead_letter_queue": "ops-dlq",
                                        "max_retries": 1})
    call(emulator, "/v1/queue/publish", {"queue": "ops", "payload": {"operation_id": "op_1"}})
    [message] = call(emulator, "/v1/queue/consume", {"queue": "ops"})["data"]["messages"]
    call(emulator, "/v1/queue/nack", {"queue": "ops", "message_id": message["message_id"]})
    assert call(emulator, "/v1/queue/consume", {"queue": "ops"})["data"]["messages"] == []
    cfg = tmp_path / "cleanup.toml"
    cfg.write_text(f'[queue]\nbackend = "infrai"\n[infrai]\nbase_url = "{emulator}"\n'
                   'queue = "ops"\n', encoding="utf-8")
    env = {**os.environ, "INFRAI_API_KEY": KEY, "CLEANUP_TRIGGER_TOKEN": "t" * 32}
    done = subprocess.run([sys.executable, "-m", "supervisor", "dlq-redrive", "-c", str(cfg)],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"queue": "ops", "result": {"moved": 1}}
    assert KEY not in done.stdout + done.stderr
    [back] = call(emulator, "/v1/queue/consume", {"queue": "ops"})["data"]["messages"]
    assert back["payload"] == {"operation_id": "op_1"}


def test_dlq_redrive_refuses_the_embedded_queue(tmp_path: Path) -> None:
    env = {**os.environ, "CLEANUP_TRIGGER_TOKEN": "t" * 32}
    done = subprocess.run([sys.executable, "-m", "supervisor", "dlq-redrive"],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 2
    assert "queue.backend is not 'infrai'" in done.stderr


def test_cron_apply_sends_the_tick_token_and_shows_no_token(emulator: str,
                                                            tmp_path: Path) -> None:
    cfg = tmp_path / "cleanup.toml"
    cfg.write_text(f'[schedule]\ncron = "0 2 * * 1"\nclock = "external"\n'
                   f'[infrai]\nbase_url = "{emulator}"\n'
                   'trigger_url = "https://cleanup.example.com/v1/runs"\n', encoding="utf-8")
    operator, tick = "o" * 32, "k" * 32
    env = {**os.environ, "INFRAI_API_KEY": KEY, "CLEANUP_TRIGGER_TOKEN": operator}
    argv = [sys.executable, "-m", "supervisor", "infrai", "cron", "apply", "-c", str(cfg)]
    refused = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60,
                             check=False)
    # Never the operator token at Infrai: without a tick token nothing is sent.
    assert refused.returncode == 2
    assert "trigger.tick_token_env: $CLEANUP_TICK_TOKEN" in refused.stderr
    done = subprocess.run(argv, capture_output=True, text=True,
                          env={**env, "CLEANUP_TICK_TOKEN": tick}, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["result"] == "created"
    for secret in (operator, tick, KEY):
        assert secret not in done.stdout + done.stderr
    status = subprocess.run([*argv[:5], "status", "-c", str(cfg)], capture_output=True,
                            text=True, env=env, timeout=60, check=False)
    assert status.returncode == 0, status.stderr  # status needs no tick token
    assert json.loads(status.stdout)["job"]["name"] == "cleanup-weekly"
