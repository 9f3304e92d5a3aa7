"""Celery beat as the clock (docs/operations.md): a real ``celery beat`` and a real
``celery worker`` (tests/e2e/celery_team_app.py, the recipe's app) open runs of the service
through ``POST /v1/runs`` with the tick token, on Redis and on RabbitMQ.

Each test has a broker namespace of its own (Redis: a key prefix on every key; RabbitMQ: a
queue and exchange), removed afterwards. Synchronisation is on the worker's log lines and
the service's runs; nothing waits a fixed time.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from supervisor.callers.celery_beat import TASK_NAME
from tests.conftest import require_redis, unavailable
from tests.e2e.harness import E2E, Service, ServiceProcess
from tests.helpers import eventually

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SCHEDULE = "e2e"  # the harness's schedule.name
# The worker's task log format: "... <task name>[<task id>]: <message>".
ANSWER = re.compile(r"\[(?P<task>[0-9a-f-]{36})\]: cleanup tick: slot=(?P<slot>\S+) "
                    r"status=(?P<status>\d+) (?:created=(?P<created>true|false) run=(?P<run>\S+)"
                    r"|skipped: run (?P<active>\S+) is unfinished)")


def rabbitmq_url() -> str:
    return os.environ.get("CLEANUP_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _require_celery(var: str) -> None:
    if importlib.util.find_spec("celery") is None:
        unavailable("celery is not installed: pip install -e '.[celery]' to test the Celery "
                    "beat caller", var)


@dataclass
class Broker:
    kind: str
    url: str
    queue: str
    keyprefix: str = ""  # Redis only

    def env(self) -> dict[str, str]:
        return {"E2E_CELERY_BROKER": self.url, "E2E_CELERY_QUEUE": self.queue,
                "E2E_CELERY_KEYPREFIX": self.keyprefix}


def _rabbitmq_up() -> bool:
    from kombu import Connection
    from kombu.exceptions import OperationalError

    conn = Connection(rabbitmq_url(), connect_timeout=3)
    try:
        conn.connect()
    except (OSError, OperationalError, *conn.connection_errors):
        return False
    finally:
        conn.release()
    return True


def _rabbitmq_drop(queue: str) -> None:
    from kombu import Connection

    with Connection(rabbitmq_url(), connect_timeout=3) as conn:
        channel = conn.default_channel
        channel.queue_delete(queue)
        channel.exchange_delete(queue)


@pytest.fixture(params=["redis", "rabbitmq"])
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    tag = f"cleanup-tick-{secrets.token_hex(4)}"
    if request.param == "redis":
        url = await require_redis()
        _require_celery("CLEANUP_REQUIRE_REDIS")
        yield Broker("redis", url, tag, keyprefix=f"{tag}:")
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        try:
            keys = [k async for k in client.scan_iter(match=f"{tag}:*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
    else:
        _require_celery("CLEANUP_REQUIRE_RABBITMQ")
        if not await asyncio.to_thread(_rabbitmq_up):
            unavailable("RabbitMQ not reachable at 127.0.0.1:5672 (guest/guest): start one "
                        "(apt-get install rabbitmq-server) or set CLEANUP_TEST_RABBITMQ_URL to "
                        "run the Celery tests on AMQP", "CLEANUP_REQUIRE_RABBITMQ")
        yield Broker("rabbitmq", rabbitmq_url(), tag)
        await asyncio.to_thread(_rabbitmq_drop, tag)


@dataclass
class Celeries:
    """The worker and beat processes of one test, on one broker and one service."""

    e2e: E2E
    broker: Broker
    env: dict[str, str]
    procs: list[tuple[str, ServiceProcess]] = field(default_factory=list)

    async def _spawn(self, name: str, *args: str) -> ServiceProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "celery", "-A", "tests.e2e.celery_team_app", *args,
            "--loglevel", "INFO", cwd=ROOT, env=self.env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        self.e2e.processes.add(proc)
        sp = ServiceProcess(proc)  # reads stderr line by line: Celery logs there
        self.procs.append((name, sp))
        return sp

    async def worker(self) -> ServiceProcess:
        sp = await self._spawn("worker", "worker", "--pool", "solo", "-Q", self.broker.queue,
                               "--hostname", f"{self.broker.queue}@%h", "--without-mingle",
                               "--without-gossip", "--without-heartbeat")
        await sp.wait_for_line(r"\bready\.")
        return sp

    async def beat(self, name: str) -> ServiceProcess:
        return await self._spawn(name, "beat", "--schedule",
                                 str(self.e2e.tmp_path / f"{name}-schedule"), "--max-interval", "1")

    def send(self, *args: Any) -> None:
        """What a second beat, a redelivery or an operator's `celery call` does: send the
        task again, through the team's own app (blocking: call in a thread)."""
        from tests.e2e.celery_team_app import make_app

        app = make_app(self.env)
        try:
            app.send_task(TASK_NAME, args=list(args), queue=self.broker.queue)
        finally:
            app.close()

    def tails(self) -> Iterator[str]:
        for name, sp in self.procs:
            yield f"--- celery {name} (exit {sp.proc.returncode}) ---\n{sp.tail(400)}"


@pytest.fixture
async def celeries(e2e: E2E, broker: Broker) -> AsyncIterator[Celeries]:
    env = {k: v for k, v in e2e.env.items() if k != "CLEANUP_TRIGGER_TOKEN"}
    env.update(broker.env(), E2E_CELERY_EVERY_S="1", E2E_CELERY_BACKOFF_S="0.2")
    c = Celeries(e2e, broker, env)
    try:
        yield c
    finally:
        for _, sp in c.procs:
            await sp.close()
        for text in c.tails():  # shown by pytest only when the test failed
            print(text, file=sys.stderr)


async def _service(e2e: E2E, celeries: Celeries, sandbox: Any, **overrides: Any) -> Service:
    """The service with a tick token, the only secret the Celery processes hold."""
    svc = e2e.service(sandbox, overrides)
    tick_token = secrets.token_urlsafe(24)
    svc.env["CLEANUP_TICK_TOKEN"] = tick_token
    await svc.start()
    celeries.env.update(CLEANUP_URL=svc.url, CLEANUP_TICK_TOKEN=tick_token)
    return svc


def _answer(line: str) -> re.Match[str]:
    m = ANSWER.search(line)
    assert m is not None, line
    return m


def _answers(worker: ServiceProcess) -> list[re.Match[str]]:
    return [m for line in worker.lines if (m := ANSWER.search(line))]


async def _runs(svc: Service) -> list[dict[str, Any]]:
    status, doc = await svc.request("GET", "/v1/runs?limit=200")
    assert status == 200, doc
    return list(doc["runs"])


async def _assert_one_run_per_slot(svc: Service, worker: ServiceProcess) -> None:
    """Every run the service lists was opened by one tick (created=true in the worker's
    log), each slot's run is listed once, and every answer for a slot names its run."""
    runs = await _runs(svc)
    keys = [r["tick_key"] for r in runs]
    assert len(keys) == len(set(keys)), keys
    run_of = {r["tick_key"].removeprefix(f"{SCHEDULE}@"): r["id"] for r in runs}

    def created() -> set[str]:
        return {m["run"] for m in _answers(worker) if m["created"] == "true"}

    # A run's 201 is in the log a moment after the service opened it.
    await eventually(lambda: created() >= set(run_of.values()), what="a log line per run opened")
    opened = [m for m in _answers(worker) if m["created"] == "true"]
    assert len(opened) == len({m["slot"] for m in opened}), "a slot opened two runs"
    for m in _answers(worker):
        if m["run"] is not None:
            assert run_of.get(m["slot"], m["run"]) == m["run"], m.group(0)


async def test_beat_opens_runs_a_busy_slot_is_skipped_and_a_duplicate_opens_nothing(e2e, celeries):
    # Two source pages a second and a half each: a run lasts three seconds or more, so the
    # beat's next ticks (every second) arrive while it is unfinished.
    sandbox = await e2e.sandbox("--recipients", 40, "--rate", 400, "--page-delay-ms", 1500)
    svc = await _service(e2e, celeries, sandbox, source={"page_size": 20})
    worker = await celeries.worker()
    beat = await celeries.beat("beat")

    first = _answer(await worker.wait_for_line(r"cleanup tick: slot=\S+ status=201 created=true"))
    slot, run_id = first["slot"], first["run"]
    status, run = await svc.request("GET", f"/v1/runs/{run_id}")
    assert status == 200, run
    assert (run["tick_key"], run["schedule"]) == (f"{SCHEDULE}@{slot}", SCHEDULE)

    # A tick while that run is unfinished: 409, the task done with a warning, not retried.
    skipped = _answer(await worker.wait_for_line(rf"status=409 skipped: run {run_id} is unfinished"))
    assert skipped["slot"] > slot, skipped.group(0)
    await worker.wait_for_line(rf"{TASK_NAME}\[{skipped['task']}\] succeeded")

    done = await svc.wait_done(run_id)
    await e2e.assert_complete(svc, done, sandbox)
    await sandbox.control(page_delay_ms=0)
    # A slot after the run finished opens the next run.
    second = _answer(await worker.wait_for_line(rf"status=201 created=true run=(?!{re.escape(run_id)} )"))
    assert second["slot"] > skipped["slot"], second.group(0)
    beat.send(signal.SIGTERM)
    await beat.wait_exit()

    # The first slot sent again (a second beat, a redelivered message): the same run.
    await asyncio.to_thread(celeries.send, slot)
    await worker.wait_for_line(rf"slot={re.escape(slot)} status=200 created=false run={run_id} ")

    # A tick the service refuses (400, naming the field) fails at once, never retried.
    await asyncio.to_thread(celeries.send, "next-monday")
    line = await worker.wait_for_line(r"slot=next-monday refused: .*answered 400: "
                                      r"scheduled_for must be an ISO 8601 time")
    task = re.search(r"\[([0-9a-f-]{36})\]", line)
    assert task is not None, line
    await worker.wait_for_line(rf"{TASK_NAME}\[{task[1]}\] raised unexpected: TickRefused")

    assert not [x for x in worker.lines if " retry=" in x or "Retry in" in x], worker.tail()
    assert celeries.env["CLEANUP_TICK_TOKEN"] not in "\n".join(worker.lines)
    await _assert_one_run_per_slot(svc, worker)


async def test_two_beats_open_one_run_per_slot_and_a_service_restart_is_retried(e2e, celeries):
    sandbox = await e2e.sandbox("--recipients", 10, "--rate", 400)
    svc = await _service(e2e, celeries, sandbox)
    worker = await celeries.worker()
    # Two beat processes, each with its schedule file: both fire every second, so most
    # slots are sent twice, each from its own beat's clock.
    await celeries.beat("beat-1")
    await celeries.beat("beat-2")

    def twice() -> str | None:
        """A slot both beats sent, which opened one run: the second sender found it
        (created=false), or the first was skipped while the previous slot's run was
        unfinished and the second opened it. Which of the two depends on the beats'
        phases: one that fires 0.9 s after the other meets the run the other opened
        0.1 s earlier still unfinished, on every slot."""
        by_slot: dict[str, list[re.Match[str]]] = {}
        for m in _answers(worker):
            by_slot.setdefault(m["slot"], []).append(m)
        for slot, answers in by_slot.items():
            outcomes = [m["created"] or "skipped" for m in answers]
            if outcomes in (["true", "false"], ["skipped", "true"]):
                return slot
        return None

    slot = await eventually(twice, within_s=30, what="a slot both beats sent")
    runs = [r for r in await _runs(svc) if r["tick_key"] == f"{SCHEDULE}@{slot}"]
    assert len(runs) == 1, runs
    # Sent once more (a third beat, a redelivery), whatever the phases: the same run.
    await asyncio.to_thread(celeries.send, slot)
    await worker.wait_for_line(
        rf"slot={re.escape(slot)} status=200 created=false run={runs[0]['id']} ")

    # The service dies: ticks fail to connect and are retried with Celery's retry; the
    # service back on the same port and ledger, a retried tick reaches it (and opens its
    # slot's run, finds it, or is skipped while the run the kill interrupted resumes).
    await svc.kill()
    after = len(worker.lines)
    line = await worker.wait_for_line(r"cleanup tick: slot=\S+ retry=\d+/8 in=", after=after)
    retried = re.search(r"\[([0-9a-f-]{36})\]: cleanup tick: slot=(\S+) retry=", line)
    assert retried is not None, line
    await svc.start()
    line = await worker.wait_for_line(
        rf"\[{retried[1]}\]: cleanup tick: slot={re.escape(retried[2])} status=(20[01]|409) ",
        after=after)
    await worker.wait_for_line(rf"{TASK_NAME}\[{retried[1]}\] succeeded", after=after)

    for name, sp in celeries.procs:
        if name.startswith("beat"):
            await sp.close()
    await _assert_one_run_per_slot(svc, worker)
