"""A team's own Celery app, set up as docs/operations.md's recipe says: the cleanup task
registered on it and one beat entry. tests/e2e/test_celery_beat.py runs ``celery -A
tests.e2e.celery_team_app worker|beat`` on it, and sends duplicates through the same app.

Configured from the environment the test gives its processes: ``E2E_CELERY_BROKER``,
``E2E_CELERY_QUEUE`` (a queue of the test's own), ``E2E_CELERY_KEYPREFIX`` (Redis: every
key the test's processes write starts with it), ``E2E_CELERY_EVERY_S`` (the beat entry's
interval) and ``E2E_CELERY_BACKOFF_S`` (the task's first retry wait). The task itself
reads ``CLEANUP_URL`` and ``CLEANUP_TICK_TOKEN``, as in production.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from celery import Celery

from supervisor.callers.celery_beat import beat_entry, register


def make_app(env: Mapping[str, str]) -> Celery:
    app = Celery("team", broker=env["E2E_CELERY_BROKER"])
    transport: dict[str, Any] = {}
    if env.get("E2E_CELERY_KEYPREFIX"):
        transport["global_keyprefix"] = env["E2E_CELERY_KEYPREFIX"]
    app.conf.update(
        task_default_queue=env["E2E_CELERY_QUEUE"],
        task_ignore_result=True,
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        # Nothing shared with other users of the broker: no pidbox, no events.
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        beat_schedule={"cleanup-tick": beat_entry(
            timedelta(seconds=float(env.get("E2E_CELERY_EVERY_S", "1"))))},
    )
    register(app, backoff_s=float(env.get("E2E_CELERY_BACKOFF_S", "2")), backoff_max_s=2.0,
             max_retries=8)
    return app


# What `celery -A` looks for; absent where the test imports make_app for its own sends.
if "E2E_CELERY_BROKER" in os.environ:
    app = make_app(os.environ)
