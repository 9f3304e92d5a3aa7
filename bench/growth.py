"""Benchmark: growth. Scan and publish only, at 10k, 100k and 1M candidates.

Each size runs in a fresh process (so its peak RSS is its own): a JSONL file source of N
recipient IDs, then the service's own Scanner and Publisher on an SqliteLedger and
SqliteQueue sharing one database file, as ``serve`` builds them, with no consumers. It
reports the time until every candidate is an operation (scan) and until every operation
has a message (publish), the peak RSS, and the ledger's bytes per operation (the SQLite
file after close: runs, operations, messages and indexes).

Usage: python bench/growth.py [--sizes 10000,100000,1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paths import PY, REPO
from processes import vm_hwm_mb
from report import environment, save, table
from scenario import Result

SIZES = (10_000, 100_000, 1_000_000)


def write_candidates(path: Path, n: int) -> None:
    width = max(6, len(str(n)))
    with path.open("w") as fh:
        for i in range(1, n + 1):
            fh.write(f'{{"id": "r-{i:0{width}d}"}}\n')


async def scan_and_publish(source: Path, data_dir: Path) -> dict[str, float]:
    from supervisor import config
    from supervisor.scan import Publisher, Scanner
    from supervisor.sqlite.database import Database
    from supervisor.sqlite.ledger import SqliteLedger
    from supervisor.sqlite.queue import SqliteQueue
    from supervisor.states import RunState

    cfg = config.load(REPO / "config/default.toml", {
        "CLEANUP_TRIGGER_TOKEN": "unused" * 8, "CLEANUP__SERVICE__DATA_DIR": str(data_dir),
        "CLEANUP__SOURCE__KIND": "file", "CLEANUP__SOURCE__PATH": str(source)})
    db = Database(cfg.ledger_path)
    await db.open()
    queue = SqliteQueue(db)
    ledger = SqliteLedger(db, owns_queue=True)
    scan_wakeup, publish_wakeup = asyncio.Event(), asyncio.Event()
    scanner = Scanner(cfg, ledger, scan_wakeup, publish_wakeup)
    publisher = Publisher(ledger, queue, publish_wakeup)
    t0 = time.monotonic()
    opened = await ledger.open_run("growth@bench", "growth", None, {"kind": "file"},
                                   skip_if_unfinished=False)
    assert opened.run is not None
    run_id = opened.run.id
    tasks = [asyncio.create_task(scanner.run()), asyncio.create_task(publisher.run())]
    scan_wakeup.set()
    # Polling is the measurement here: the ledger offers no change signal to wait on.
    while (run := await ledger.get_run(run_id)) is not None and run.state is RunState.SCANNING:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    scan_s = time.monotonic() - t0
    while await ledger.unpublished(1):  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    publish_s = time.monotonic() - t0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    stats = await queue.stats()
    await db.close()
    return {"scan_s": scan_s, "total_s": publish_s, "discovered": run.discovered if run else 0,
            "queued": stats.depth, "ledger_bytes": ledger_bytes(data_dir),
            "maxrss_kb": (vm_hwm_mb(os.getpid()) or 0) * 1024}


def ledger_bytes(data_dir: Path) -> int:
    return sum(p.stat().st_size for p in data_dir.glob("cleanup.sqlite3*"))


def one(n: int, source: Path, data_dir: Path) -> None:
    import uvloop

    report = uvloop.run(scan_and_publish(source, data_dir))
    print(json.dumps({"n": n, **report}), flush=True)


def measure(n: int) -> Result:
    result = Result("growth", "service (scan+publish)", n, "—", None)
    with tempfile.TemporaryDirectory(prefix="bench-growth-") as tmp:
        source = Path(tmp) / "candidates.jsonl"
        write_candidates(source, n)
        proc = subprocess.run([PY, __file__, "--one", str(n), "--source", str(source),
                               "--data-dir", str(Path(tmp) / "var")],
                              capture_output=True, text=True, cwd=REPO, check=False)
    if proc.returncode != 0:
        result.notes.append(f"error: exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
        return result
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    result.wall_s = result.elapsed_s = r["total_s"]
    result.completed = r["queued"]
    result.peak_rss_mb = r["maxrss_kb"] / 1024
    result.extra.update(r)
    result.notes.append(
        f"scan {r['scan_s']:.1f} s + publish → {r['total_s']:.1f} s; "
        f"{r['total_s'] / n * 1e6:.0f} µs/op; {r['ledger_bytes'] / n:.0f} ledger B/op"
        + ("" if r["queued"] == n == r["discovered"] else
           f"; discovered {r['discovered']}, queued {r['queued']}"))
    return result


def run_growth(sizes: tuple[int, ...] = SIZES) -> list[Result]:
    results = []
    for n in sizes:
        result = measure(n)
        print(f"  growth {n:>9,}  {'; '.join(result.notes)}; "
              f"rss={result.peak_rss_mb or 0:.0f}MB", file=sys.stderr, flush=True)
        results.append(result)
    done = [r for r in results if r.wall_s]
    if len(done) >= 2:
        first, last = done[0], done[-1]
        assert first.wall_s is not None
        assert last.wall_s is not None
        growth = (last.wall_s / last.n) / (first.wall_s / first.n)
        last.notes.append(f"time per op x{growth:.2f} vs {first.n:,}")
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--source", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args.one, args.source, args.data_dir)
        return 0
    results = run_growth(tuple(int(s) for s in args.sizes.split(",")))
    env = environment()
    text = (f"commit {env['commit']}, {env['cpus']} x {env['cpu']}, {env['date']}\n\n"
            + table(results))
    save(results, "growth", text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
