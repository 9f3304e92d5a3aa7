"""A year of weekly runs must cost what day one costs: the per-second and hot-path ledger
calls timed with and without 5 million historic operations (issue 8).

Two ledgers are built in a fresh process each: "day one" holds only the current run (the
article's 18,400 operations, half of them still queued); "a year" holds the same current
run after 52 weekly runs of history (5 million settled operations with their attempts,
some still ambiguous), bulk-inserted with SQL. Then each call the service makes every
second (the monitor: ledger stats, queue stats from the ledger, closing runs) or per
message (a receive's bookkeeping, begin_attempt, settle, the outbox read) and per redrive
sweep is timed on the service's own SqliteLedger, and its median compared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from paths import PY, REPO

HISTORY = 5_000_000
WEEKS = 52
CURRENT = 18_400
REPEATS = 30


def build(path: Path, history: int) -> None:
    """Runs, operations and attempts by bulk SQL, on the service's own schema."""
    import sqlite3

    from supervisor.sqlite import sql

    conn = sqlite3.connect(path)
    conn.executescript(sql.SCHEMA)
    conn.execute(sql.ACTIVE_INDEX)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    week = 7 * 86400.0
    start = time.time() - WEEKS * week
    per_run = history // WEEKS if history else 0
    for w in range(WEEKS if history else 0):
        run_id = f"run_hist_{w:03d}"
        at = start + w * week
        conn.execute(sql.INSERT_RUN, (run_id, f"weekly@{w}", "weekly", at, "done", "{}", at))
        conn.execute("UPDATE runs SET finished_at = ? WHERE id = ?", (at + 1000, run_id))
        # 95 % deleted, 4 % already absent, 1 % failed; a few never resolved.
        conn.execute(f"""
            WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {per_run})
            INSERT INTO operations (id, run_id, recipient_id, state, attempts, created_at,
                                    updated_at, due_at, message_id)
            SELECT printf('op_h%03d_%08d', {w}, x), '{run_id}', printf('r-%08d', x),
                   CASE WHEN x % 100 < 95 THEN 'deleted' WHEN x % 100 < 99 THEN 'already_absent'
                        WHEN x % 5000 = 1 THEN 'ambiguous' ELSE 'failed' END,
                   1, {at}, {at} + 900, {at}, printf('op_h%03d_%08d', {w}, x) FROM c""")
        conn.execute(f"""
            INSERT INTO attempts (operation_id, n, kind, started_at, finished_at, status,
                                  outcome, detail)
            SELECT id, 1, 'delete', {at}, {at} + 1, 204, 'deleted', 'HTTP 204'
            FROM operations WHERE run_id = '{run_id}'""")
        conn.commit()
    now = time.time()
    conn.execute(sql.INSERT_RUN, ("run_current", "weekly@now", "weekly", now, "draining", "{}",
                                  now))
    conn.execute(f"""
        WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {CURRENT})
        INSERT INTO operations (id, run_id, recipient_id, state, attempts, created_at,
                                updated_at, due_at, message_id)
        SELECT printf('op_c_%08d', x), 'run_current', printf('r-%08d', x),
               CASE WHEN x % 2 = 0 THEN 'deleted' ELSE 'queued' END, x % 2, {now}, {now},
               {now}, printf('op_c_%08d', x) FROM c""")
    conn.execute(f"""
        INSERT INTO messages (operation_id, run_id, recipient_id, available_at, enqueued_at)
        SELECT id, run_id, recipient_id, {now}, {now} FROM operations
        WHERE run_id = 'run_current' AND state = 'queued'""")
    conn.commit()
    conn.execute("ANALYZE")
    conn.close()


async def timings(path: Path) -> dict[str, float]:
    from supervisor.model import Settlement
    from supervisor.sqlite.database import Database
    from supervisor.sqlite.ledger import SqliteLedger
    from supervisor.sqlite.queue import SqliteQueue
    from supervisor.states import OpState

    db = Database(path)
    await db.open()
    ledger = SqliteLedger(db, owns_queue=True)
    queue = SqliteQueue(db)
    out: dict[str, float] = {}

    async def timed(name: str, call: Callable[[], Awaitable[Any]]) -> None:
        await call()  # warm the page cache as the running service has it
        samples = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            await call()
            samples.append(time.perf_counter() - t0)
        out[name] = statistics.median(samples) * 1000

    async def monitor() -> None:
        await ledger.finish_runs()
        await ledger.stats()
        await ledger.queue_stats()

    async def one_message() -> None:
        [d] = await queue.receive(1, 60)
        await ledger.note_received([d], 60)
        attempt = await ledger.begin_attempt(d.message.operation_id, "delete",
                                             owner=d.receipt, busy_s=30)
        await ledger.settle([Settlement(d.message.operation_id, OpState.DELETED, d,
                                        attempt_id=attempt, status=204, outcome="deleted")])

    async def redrive_page() -> None:
        now = time.time()
        await ledger.overdue(now - 120, now - 10, 0, 1000)

    await timed("monitor pass (finish_runs + stats + queue_stats)", monitor)
    await timed("one message (receive, note, begin, settle)", one_message)
    await timed("redrive page (overdue, 1000)", redrive_page)
    await timed("outbox read (unpublished 500)", lambda: ledger.unpublished(500))
    await timed("run counts (current run)", lambda: ledger.run_counts("run_current"))
    await timed("runs list (20)", lambda: ledger.list_runs(20))
    await db.close()
    return out


def one(history: int, data_dir: Path) -> None:
    import uvloop

    path = data_dir / "cleanup.sqlite3"
    t0 = time.monotonic()
    build(path, history)
    built_s = time.monotonic() - t0
    result = uvloop.run(timings(path))
    size = sum(p.stat().st_size for p in data_dir.glob("cleanup.sqlite3*"))
    print(json.dumps({"history": history, "built_s": built_s, "bytes": size,
                      "ms": result}), flush=True)


def measure(history: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-history-") as tmp:
        proc = subprocess.run([PY, __file__, "--one", str(history), tmp], capture_output=True,
                              text=True, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"history {history}: exit {proc.returncode}: {proc.stderr[-500:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run_history(history: int = HISTORY) -> str:
    day_one = measure(0)
    year = measure(history)
    lines = [f"ledger with {history:,} historic operations ({WEEKS} weekly runs, "
             f"{year['bytes'] / 1e9:.2f} GB, built in {year['built_s']:.0f} s) vs day one "
             f"(the current run of {CURRENT:,} only); median of {REPEATS} calls",
             "", "| call | day one ms | a year ms | ratio |", "| --- | ---: | ---: | ---: |"]
    for name, ms in day_one["ms"].items():
        y = year["ms"][name]
        lines.append(f"| {name} | {ms:.3f} | {y:.3f} | {y / ms:.2f} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        one(int(sys.argv[2]), Path(sys.argv[3]))
        return 0
    history = int(sys.argv[1]) if len(sys.argv) > 1 else HISTORY
    print(run_history(history))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
