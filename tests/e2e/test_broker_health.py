"""An operator's view of the queue's broker (issue 21, point 7): with
``queue.backend = "redis"`` on a redis-server of the test's own, stopping the server turns
``/readyz`` to 503 with its ``queue`` check false and ``cleanup_queue_healthy`` to 0, the
service staying up; starting it again brings both back, and a run opened then finishes
(the server kept nothing: the group is made again, redrive republishes what was lost).
A broker URL the service cannot use is a startup error that names the key and never the
password."""

from __future__ import annotations

import asyncio
import shutil
import socket
from pathlib import Path

import pytest

from tests.e2e.harness import E2E, Service
from tests.unit.test_redis_queue import _redis_server

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _until_ready(svc: Service, ready: bool, within_s: float = 30.0) -> dict[str, object]:
    """/readyz and the gauge are evaluated every second: read until they say ``ready``."""
    async with asyncio.timeout(within_s):
        while True:
            status, doc = await svc.request("GET", "/readyz", auth=False)
            healthy = (await svc.metrics()).get("cleanup_queue_healthy")
            if (status == 200) is ready and (healthy == 1) is ready:
                return dict(doc)
            await asyncio.sleep(0.2)


async def test_a_stopped_broker_is_unready_and_a_restarted_one_ready_again(
        e2e: E2E, tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = _free_port()
    server = await _redis_server(port, tmp_path)
    sandbox = await e2e.sandbox("--recipients", 200, "--rate", 1000)
    svc = e2e.service(sandbox, {"queue": {"backend": "redis", "redis_key": "health",
                                          "redrive_interval_seconds": 1.0,
                                          "redrive_grace_seconds": 2.0}})
    svc.env["CLEANUP_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    try:
        await svc.start()
        await _until_ready(svc, True)
        server.kill()
        await server.wait()
        doc = await _until_ready(svc, False)
        assert doc["checks"]["queue"] is False, doc  # type: ignore[index]
        assert svc.current is not None
        assert svc.current.proc.returncode is None  # still up, only unready
        server = await _redis_server(port, tmp_path)
        await _until_ready(svc, True)
        run_id = await svc.open_run()
        run = await svc.wait_done(run_id, within_s=60)
        assert run["unfinished"] == 0, run
        assert run["counts"]["deleted"] + run["counts"]["already_absent"] == 200, run
    finally:
        if server.returncode is None:
            server.kill()
            await server.wait()


async def test_a_broker_url_that_cannot_be_used_names_the_key_not_the_password(
        e2e: E2E) -> None:
    port = _free_port()  # nothing listens there
    sandbox = await e2e.sandbox("--recipients", 10)
    svc = e2e.service(sandbox, {"queue": {"backend": "rabbitmq"}})
    svc.env["CLEANUP_RABBITMQ_URL"] = f"amqp://guest:pw-never-shown@127.0.0.1:{port}/"
    sp = await svc.spawn()
    code = await sp.proc.wait()
    out = "\n".join(sp.lines) + (await sp.proc.stderr.read()).decode() \
        if sp.proc.stderr is not None else ""
    assert code == 3, out
    assert "queue.backend = 'rabbitmq' cannot start" in out, out
    assert "pw-never-shown" not in out
