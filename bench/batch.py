"""Benchmark: batch partners (issue 19, point 8; docs/batch.md).

The article's 18,400 deletions at a partner limit of 20 requests per second, with 100 ids
per request, in each answer shape, against the partner simulator; and the same against a
partner whose limit counts ids (20 ids per second). Each cell prints its time against the
ideal, the partner requests and probes per operation, operations per second and peak RSS.

    ideal, per_item and accepted unprobed:  ceil(N / K) / R          (184 requests: 9.2 s)
    ideal, accepted (each id probed):       (ceil(N / K) + N) / R    (a probe costs a request)
    ideal, job:                             max(ceil(N / K) / R, ceil(ceil(N / K) / J) x D)
    ideal, a per-item cost:                 N / R

The cells whose ideal runs to a quarter of an hour (accepted with probes, the per-item
cost) use N = 2,000 unless --full: the ratio is the figure, and it does not improve with N.
The service runs in this process (peak RSS is this process's VmHWM, the harness included);
the simulator in its own.

Usage: python bench/batch.py [--full] [--only per_item,job]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from cleanup_sandbox.demo import demo_environ, sandbox_process, start_service
from supervisor import config, metrics
from supervisor.service import Service

ROOT = Path(__file__).resolve().parents[1]
K = 100
R = 20.0
VERBOSE = False


@dataclass(frozen=True)
class Cell:
    name: str
    shape: str
    n: int
    cost: str = "requests"
    unprobed: bool = False
    job_seconds: float = 0.0
    max_jobs: int = 4
    full_n: int | None = None  # N with --full
    target: float | None = None
    sandbox: tuple[str, ...] = field(default_factory=tuple)
    items_rate: float = 0.0  # the partner's second limit, on ids (cost "both")
    told_items_rate: float = 0.0  # what the service is told of it (batch.items_per_second)

    def ideal(self, n: int) -> float:
        requests = math.ceil(n / K)
        if self.cost == "items":
            return n / R
        if self.cost == "both":
            return max(requests / R, n / self.items_rate)
        if self.shape == "accepted" and not self.unprobed:
            return (requests + n) / R
        if self.shape == "job":
            return max(requests / R, math.ceil(requests / self.max_jobs) * self.job_seconds)
        return requests / R


CELLS = (
    Cell("per_item", "per_item", 18_400, target=1.10),
    Cell("accepted (probed)", "accepted", 2_000, full_n=18_400, target=1.10),
    Cell("accepted, unprobed", "accepted", 18_400, unprobed=True, target=1.10),
    Cell("job (2 s jobs, 4 at once)", "job", 18_400, job_seconds=2.0),
    Cell("per_item, cost per item", "per_item", 2_000, cost="items", full_n=18_400,
         target=1.05, sandbox=("--batch-cost", "item", "--burst", str(K))),
    # Two limits, 20 requests and 1,000 ids a second: the ids bind (18.4 s, not 9.2 s).
    # The partner's ids bucket holds two batches (a burst as Klaviyo's 75/s over 700/min)...
    Cell("per_item, two limits", "per_item", 18_400, cost="both", items_rate=1000.0,
         told_items_rate=1000.0, target=1.05, sandbox=("--batch-items-burst", str(2 * K))),
    # ...or exactly one (the worst case: any batch a millisecond early is refused).
    Cell("per_item, two limits, ids' bucket of one batch", "per_item", 18_400, cost="both",
         items_rate=1000.0, told_items_rate=1000.0),
    # The same partner, the service told 4,000 ids a second: the ids' limit is learnt
    # from its 429s (the worst case: a limit four times too high).
    Cell("per_item, two limits, ids' limit 4x too high", "per_item", 18_400, cost="both",
         items_rate=1000.0, told_items_rate=4000.0, sandbox=("--batch-items-burst", str(2 * K))),
)


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _probes() -> float:
    return sum(metrics.PROBES.labels(f)._value.get()  # type: ignore[attr-defined]
               for f in ("present", "absent", "unknown"))


def _job_polls() -> float:
    return sum(metrics.BATCH_JOB_POLLS.labels(f)._value.get()  # type: ignore[attr-defined]
               for f in ("running", "done", "expired", "error"))


async def run_cell(cell: Cell, n: int) -> dict[str, Any]:
    token, trigger = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    path = {"per_item": "/recipients/batch-delete", "accepted": "/recipients/batch-archive",
            "job": "/recipients/batch-jobs"}[cell.shape]
    args = ["--recipients", str(n), "--rate", str(R), "--burst", "2", "--batch", cell.shape,
            "--batch-max-items", str(K), "--batch-job-seconds", str(cell.job_seconds),
            "--batch-max-jobs", str(cell.max_jobs), *cell.sandbox]
    if cell.items_rate:
        args += ["--batch-items-per-second", str(cell.items_rate)]
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as data:
        async with sandbox_process(args, token) as sb:
            env = demo_environ(data, sb.url, token, trigger, {
                "CLEANUP__SERVICE__LISTEN": "127.0.0.1:0",
                "CLEANUP__SERVICE__LOG_LEVEL": "warning",
                "CLEANUP__LIMITS__RATE_PER_SECOND": str(R),
                "CLEANUP__BATCH__SHAPE": cell.shape, "CLEANUP__BATCH__PATH": path,
                "CLEANUP__BATCH__MAX_ITEMS": str(K), "CLEANUP__BATCH__COST": cell.cost,
                "CLEANUP__BATCH__MAX_JOBS_IN_FLIGHT": str(cell.max_jobs),
                **({"CLEANUP__BATCH__ITEMS_PER_SECOND": str(cell.told_items_rate)}
                   if cell.told_items_rate else {}),
                "CLEANUP__BATCH__SETTLE_ACCEPTED_UNPROBED_RISKING_SILENT_MISSES":
                    "true" if cell.unprobed else "false"})
            cfg = config.load(ROOT / "config" / "default.toml", env)
            service = Service(cfg)
            probes0, polls0 = _probes(), _job_polls()
            task = await start_service(service)
            try:
                assert service.url is not None
                auth = {"Authorization": f"Bearer {trigger}"}
                async with aiohttp.ClientSession() as s:
                    started = time.monotonic()
                    async with s.post(f"{service.url}/v1/runs", headers=auth,
                                      json={"schedule": "bench"}) as resp:
                        run_id = orjson.loads(await resp.read())["run"]["id"]
                    while True:
                        async with s.get(f"{service.url}/v1/runs/{run_id}?wait=done&timeout=1",
                                         headers=auth) as resp:
                            run = orjson.loads(await resp.read())
                        if VERBOSE:
                            print(f"  {time.monotonic() - started:5.1f}s {run['state']} "
                                  f"discovered={run['discovered']} {run['counts']}",
                                  file=sys.stderr)
                        if run["state"] == "done":
                            break
                    seconds = time.monotonic() - started
                    async with s.get(f"{sb.url}/_sandbox/stats",
                                     headers={"Authorization": f"Bearer {token}"}) as resp:
                        stats = orjson.loads(await resp.read())
            finally:
                service.request_stop()
                with contextlib.suppress(Exception):
                    await task
    probes, polls = _probes() - probes0, _job_polls() - polls0
    ideal = cell.ideal(n)
    requests = stats["batch_requests"] + probes + polls
    c = run["counts"]
    return {"cell": cell.name, "n": n, "seconds": round(seconds, 2), "ideal": round(ideal, 2),
            "ratio": round(seconds / ideal, 3), "target": cell.target,
            "ops_per_s": round(n / seconds, 1),
            "batch_requests": stats["batch_requests"], "probes": int(probes),
            "job_polls": int(polls), "requests_per_op": round(requests / n, 4),
            "rate_limited": stats["rate_limited"], "duplicates": stats["duplicates"],
            "settled": c["deleted"] + c["already_absent"], "failed": c["failed"],
            "ambiguous": c["ambiguous"], "peak_rss_mb": round(peak_rss_mb(), 1)}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| cell | N | time (s) | ideal (s) | ratio | target | ops/s | batch requests | "
            "probes | job polls | requests/op | 429s | doubled | peak RSS (MB) |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
            "---: | ---: | ---: |\n")
    return head + "".join(
        f"| {r['cell']} | {r['n']:,} | {r['seconds']} | {r['ideal']} | {r['ratio']} | "
        f"{'≤ ' + str(r['target']) if r['target'] else 'reported'} | {r['ops_per_s']} | "
        f"{r['batch_requests']} | {r['probes']} | {r['job_polls']} | {r['requests_per_op']} | "
        f"{r['rate_limited']} | {r['duplicates']} | {r['peak_rss_mb']} |\n" for r in rows)


async def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="every cell at N = 18,400")
    p.add_argument("--only", help="comma-separated cell shapes or names")
    p.add_argument("-v", "--verbose", action="store_true", help="the run's progress each second")
    args = p.parse_args(argv)
    global VERBOSE
    VERBOSE = args.verbose
    rows = []
    for cell in CELLS:
        if args.only and not any(w in (cell.shape, cell.name) for w in args.only.split(",")):
            continue
        n = cell.full_n if args.full and cell.full_n else cell.n
        print(f"{cell.name}: N = {n:,}, ideal {cell.ideal(n):.1f} s", file=sys.stderr,
              flush=True)
        rows.append(await run_cell(cell, n))
        print(orjson.dumps(rows[-1]).decode(), file=sys.stderr, flush=True)
    print(table(rows))
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch.json").write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
