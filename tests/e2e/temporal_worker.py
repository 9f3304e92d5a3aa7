"""A Temporal worker for the cleanup workflow and activity, as a process of its own, so a
test can SIGKILL it in the middle of an activity (tests/e2e/test_temporal.py).

``python -m tests.e2e.temporal_worker <temporal address> <task queue> <service url>``;
the token comes from ``$E2E_CLEANUP_TOKEN``. Prints one line once the worker is built
and about to poll, then runs until killed.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from supervisor.callers.temporal import CleanupActivity
from supervisor.callers.temporal_workflow import CleanupWorkflow

TOKEN_ENV = "E2E_CLEANUP_TOKEN"
# Heartbeats reach the server at most this long after the activity records them: a short
# heartbeat timeout in the tests needs them sent promptly.
HEARTBEAT_THROTTLE = timedelta(seconds=0.3)


def worker(client: Client, task_queue: str, activity: CleanupActivity) -> Worker:
    """The workflow and ``activity`` on ``task_queue``: ``async with`` it to run it."""
    return Worker(client, task_queue=task_queue, workflows=[CleanupWorkflow],
                  activities=[activity.run],
                  max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
                  default_heartbeat_throttle_interval=HEARTBEAT_THROTTLE)


async def main(address: str, task_queue: str, service_url: str) -> None:
    client = await Client.connect(address)
    w = worker(client, task_queue, CleanupActivity(service_url, token_env=TOKEN_ENV))
    print("worker ready", flush=True)
    await w.run()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
