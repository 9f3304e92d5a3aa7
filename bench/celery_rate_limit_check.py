"""How fast does a Celery task with ``rate_limit`` actually run? (A no-op, no partner.)

Evidence for the Celery rows of the benchmark table: it starts a worker (thread pool,
8 threads, Redis broker) for a task that only increments a Redis counter, enqueues N of
them, and reports the achieved rate next to the configured ``rate_limit``.

Usage: python bench/celery_rate_limit_check.py [--rate 100/s] [--n 300] [--seconds 20]
       [--pool threads|prefork|solo]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis
from celery import Celery

BROKER_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
QUEUE = "bench-rate-limit-check"
app = Celery("celery_rate_limit_check", broker=BROKER_URL)
app.conf.update(task_default_queue=QUEUE, task_ignore_result=True,
                broker_connection_retry_on_startup=True)
counter = redis.Redis.from_url(BROKER_URL)


@app.task(rate_limit=os.environ.get("CHECK_RATE_LIMIT") or None)
def noop() -> None:
    counter.incr("check:done")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="100/s", help="the task's rate_limit ('' for none)")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--pool", default="threads")
    args = p.parse_args()
    here = Path(__file__).resolve().parent
    if counter.dbsize() and not counter.exists("cleanup-bench:owned"):
        raise SystemExit(f"{BROKER_URL} holds keys the bench did not write")
    counter.flushdb()
    counter.set("cleanup-bench:owned", "1")
    env = {**os.environ, "CHECK_RATE_LIMIT": args.rate}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_rate_limit_check", "worker",
         "--pool", args.pool, "-c", "8", "-Q", QUEUE, "--loglevel", "WARNING",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        cwd=here, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(4)  # worker start-up
        for _ in range(args.n):
            noop.delay()
        t0 = time.monotonic()
        done = 0
        while done < args.n and time.monotonic() - t0 < args.seconds:
            time.sleep(0.05)
            done = int(counter.get("check:done") or 0)
        elapsed = time.monotonic() - t0
    finally:
        worker.send_signal(signal.SIGQUIT)
        worker.wait(20)
        counter.flushdb()
        counter.set("cleanup-bench:owned", "1")
    print(f"rate_limit={args.rate or 'none'} pool={args.pool}: {done}/{args.n} no-op tasks "
          f"in {elapsed:.1f} s = {done / elapsed:.1f} tasks/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
