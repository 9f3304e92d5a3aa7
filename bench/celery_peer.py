"""Peer 2: Celery with the Redis broker, written as a competent Celery user would.

* the task has ``rate_limit`` set to the partner's documented limit, ``acks_late=True``;
* a 429 retries the task after ``Retry-After`` (delay-seconds or HTTP-date) with
  ``self.retry(countdown=...)``; a 5xx or a connection error retries with backoff;
* the operation ID, assigned when the task is enqueued, is the ``Idempotency-Key``;
* 404 counts as done.

Configured from the environment (the bench harness sets it):
``BENCH_BROKER_URL``, ``BENCH_QUEUE``, ``BENCH_PARTNER_URL``, ``BENCH_TOKEN_ENV``,
``BENCH_RATE_LIMIT`` (e.g. ``200/s``; empty = none), ``BENCH_TAG`` (key prefix of the
completion counters in Redis) and ``BENCH_READY_FILE`` (written when the worker is ready).

Worker: ``celery -A celery_peer worker --pool threads -c 8 -Q $BENCH_QUEUE`` (cwd bench/).
Producer (the cron tick): ``python celery_peer.py produce`` pages the stale list and
enqueues one task per recipient; it prints ``{"event": "started", "t0": <monotonic>}``
first, then ``{"event": "produced", ...}``.
"""

from __future__ import annotations

import email.utils
import json
import os
import random
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
import requests
from celery import Celery, Task
from celery.signals import worker_ready

BROKER_URL = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/13")
QUEUE = os.environ.get("BENCH_QUEUE", "bench")
PARTNER_URL = os.environ.get("BENCH_PARTNER_URL", "http://127.0.0.1:9000")
TOKEN = os.environ.get(os.environ.get("BENCH_TOKEN_ENV", "CUSTOMER_API_TOKEN"), "")
RATE_LIMIT = os.environ.get("BENCH_RATE_LIMIT") or None
TAG = os.environ.get("BENCH_TAG", "bench")

app = Celery("celery_peer", broker=BROKER_URL)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    task_acks_late=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    # A task held for a countdown must not be redelivered to another worker meanwhile.
    broker_transport_options={"visibility_timeout": 3600},
)
if os.environ.get("BENCH_TIMER_PRECISION"):
    app.conf.worker_timer_precision = float(os.environ["BENCH_TIMER_PRECISION"])

_counters = redis.Redis.from_url(BROKER_URL)
_local = threading.local()


def _session() -> requests.Session:
    # One keep-alive session per worker thread: requests.Session is not thread-safe.
    session: requests.Session | None = getattr(_local, "session", None)
    if session is None:
        session = _local.session = requests.Session()
        session.headers["Authorization"] = f"Bearer {TOKEN}"
    return session


def retry_after_s(response: requests.Response, default: float) -> float:
    value = response.headers.get("Retry-After")
    if not value:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return default
        return max(0.0, when.timestamp() - time.time())


class CountingTask(Task):  # type: ignore[misc]
    """Counts a task that gave up (max retries, terminal answer) as failed."""

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any,
                   einfo: Any) -> None:
        _counters.incr(f"bench:{TAG}:failed")


@app.task(bind=True, base=CountingTask, acks_late=True, rate_limit=RATE_LIMIT, max_retries=50,
          autoretry_for=(requests.ConnectionError, requests.Timeout), retry_backoff=True,
          retry_jitter=True)
def delete_recipient(self: Task, operation_id: str, recipient_id: str) -> None:
    url = f"{PARTNER_URL}/recipients/{quote(recipient_id, safe='')}"
    resp = _session().delete(url, headers={"Idempotency-Key": operation_id}, timeout=10)
    if resp.status_code == 429:
        raise self.retry(countdown=retry_after_s(resp, 1.0))
    if resp.status_code >= 500 or resp.status_code in (408, 409):
        backoff = min(60.0, 0.5 * 2**self.request.retries)
        raise self.retry(countdown=backoff / 2 + random.uniform(0, backoff / 2))
    if resp.ok or resp.status_code in (404, 410):
        _counters.incr(f"bench:{TAG}:done")
        return
    raise RuntimeError(f"partner answered {resp.status_code}")


@worker_ready.connect
def _ready(**_: Any) -> None:
    path = os.environ.get("BENCH_READY_FILE")
    if path:
        Path(path).write_text(str(os.getpid()))


def produce() -> None:
    """The cron tick's job: page the stale list, enqueue one task per recipient."""
    t0 = time.monotonic()
    print(json.dumps({"event": "started", "t0": t0}), flush=True)
    session = _session()
    run_id = uuid.uuid4()
    cursor: str | None = None
    n = 0
    while True:
        params = {"limit": "1000"}
        if cursor:
            params["cursor"] = cursor
        resp = session.get(f"{PARTNER_URL}/stale-recipients", params=params, timeout=30)
        resp.raise_for_status()
        doc = resp.json()
        for item in doc["items"]:
            delete_recipient.delay(str(uuid.uuid5(run_id, item["id"])), item["id"])
            n += 1
        cursor = doc.get("next_cursor")
        if not cursor:
            break
    print(json.dumps({"event": "produced", "n": n, "seconds": time.monotonic() - t0}), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["produce"]:
    # Import under the module's own name, so the tasks are named as the worker knows them
    # (celery_peer.delete_recipient, not __main__.delete_recipient).
    import celery_peer

    celery_peer.produce()
