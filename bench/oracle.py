"""The oracle: what this machine can do against a cell without a single 429.

A sender that knows the partner's true limit R and shape sends N DELETEs straight to a
fresh partner (``python -m cleanup_sandbox``, the cell's flags), the request the service
sends (``DELETE /recipients/{id}`` with an ``Idempotency-Key``, IDs the partner lists),
on an exact absolute schedule t0 + k / r: it sleeps until ~3 ms before each departure,
then spins on ``time.perf_counter`` (asyncio's sleep wakes up to a millisecond late), and
a late departure never shifts the ones after it. A few requests may be in flight at once
(``CONCURRENCY``) so a slow answer does not hold the next departure back.

It starts at r = R; a trial that meets a 429 stops there and the next (a fresh partner
process, so every bucket starts clean) is paced ``STEP`` x R slower, until one whole run
of N gets no 429 at all. That r is the cell's physical limit on this machine: a partner
clocks arrivals, and the jitter between departure and arrival is what a bucket of one
token (or a sliding second) cannot absorb. The oracle's time for a scenario is what a
client pacing at r needs, following the scenario's changes scaled by r / R and its pauses
unchanged (``Scenario.oracle_s``); each row's ``ratio vs oracle`` is its time over that.

A long cell (the article's 18,400 at 20/s) needs more: over a quarter of an hour a strict
partner meets the host's jitter now and then at any pace a short trial finds clean, and a
client that knows the limit still pays each refusal's pause. ``--whole`` runs that client:
the scenario's whole N at each of ``--paces``, a refused request sent again at the end, and
every 429's ``Retry-After`` honoured (departures wait, then the schedule starts afresh from
the end of the pause; a bare 429 asks for no pause and gets none). The fastest of those
whole runs is the cell's oracle time for that N, which a row of the same N is measured
against instead of N over the short trial's pace.

Measured once per (cell, R) and kept in bench/out/oracle.json (with the N it was measured
with: a full run does not reuse a ``--quick`` one's shorter measurement; ``--remeasure``
measures again). ``make bench`` measures the cells it has no entry for.

Usage: python bench/oracle.py [--cells a,b] [--rate R] [--quick] [--remeasure] [--n N]
       python bench/oracle.py --whole --cells bucket-1 --rate 20 --n 18400 --paces 19.5,19.25
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any
from urllib.parse import quote

import aiohttp

from matrix import Cell, select_cells
from paths import OUT
from processes import Partner, cpu_s, sandbox
from scenario import Result, Scenario
from supervisor.httputil import parse_retry_after

ORACLE_FILE = OUT / "oracle.json"
STEP = 0.005  # each failed trial paces this share of R slower
FLOOR = 0.85  # below this share of R the oracle gives up (something else is wrong)
CONCURRENCY = 4  # requests in flight at most; at R = 50-100/s one is the rule
# The last stretch before a departure, spun rather than slept: asyncio's sleep wakes up
# to 1 ms after its time (epoll's timeout is whole milliseconds) and the host adds its
# own delay. Measured at 50/s (departure late p99 / CPU of a core): 1.5 ms ahead
# 0.9-1.9 ms / 7 %; 3 ms ahead 0.35-0.45 ms / 16 %; 5 ms ahead 0.2 ms / 27 %.
SPIN_S = 0.003
START_DELAY_S = 0.05  # t0 is this far after the schedule is set up
WARM_UP = True
WARM_UP_GAP_S = 1.05  # > 1 s: past a sliding second and the fixed second it fell in
MAX_PAUSE_S = 60.0  # a whole run honours no Retry-After longer than this (nonsense)


def key(cell: str, partner_rate: float) -> str:
    return f"{cell}@{partner_rate:g}"


def trial_n(partner_rate: float, quick: bool) -> int:
    """N of a trial: the known-limit scenario's (30 s at R; quick: 6 s)."""
    return max(1, round(partner_rate * 30.0 * (0.2 if quick else 1.0)))


def rates(partner_rate: float, step: float = STEP, floor: float = FLOOR) -> list[float]:
    """The paces tried, in order: R, then STEP x R slower each time, down to the floor."""
    out, k = [], 0
    while 1.0 - k * step >= floor - 1e-12:
        out.append(round(partner_rate * (1.0 - k * step), 6))
        k += 1
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- one trial ------------------------------------------------------------------------------


async def _until(due: float) -> None:
    """Sleep until ~SPIN_S before ``due``, then spin: epoll's timeout is whole ms."""
    while (left := due - time.perf_counter()) > SPIN_S:  # noqa: ASYNC110 - a clock, not an event
        await asyncio.sleep(left - SPIN_S)
    while time.perf_counter() < due:
        pass


class Schedule:
    """Departures at anchor + k / rate; a pause moves the anchor to its end and restarts k.

    A whole run (``--whole``) uses it: a refused request goes to the back of the line, and
    its ``Retry-After`` holds every later departure, as the partner asked. ``guard_s``
    holds the second departure after a pause back by that much (and the rest with it): a
    partner idle for a whole second clocks the first arrival late and the next on time,
    which a bucket of one refuses as a close arrival."""

    def __init__(self, rate: float, t0: float, guard_s: float = 0.0) -> None:
        self.rate, self.anchor, self.k = rate, t0, 0
        self.guard_s = guard_s
        self.resume_at = 0.0
        self.paused_s = 0.0  # > 0 once a pause has restarted the schedule

    def pause_until(self, t: float) -> None:
        self.resume_at = max(self.resume_at, t)

    def due(self) -> float:
        due = self.anchor + self.k / self.rate
        if self.resume_at > due:
            self.paused_s += self.resume_at - due
            self.anchor, self.k = self.resume_at, 0
            due = self.anchor
        return due

    def sent(self) -> None:
        if self.k == 0 and self.paused_s > 0:
            self.anchor += self.guard_s
        self.k += 1


def k_bucket(k: int) -> str:
    """Where in its stretch between pauses a refused departure was (0: the first)."""
    return str(k) if k < 3 else "3-9" if k < 10 else "10-99" if k < 100 else "100+"


async def _send(ids: Sequence[str], schedule: Schedule, slots: asyncio.Semaphore,
                one: Callable[[float, str], Coroutine[Any, Any, None]],
                tasks: set[asyncio.Task[None]], again: deque[str], k_of: dict[str, int],
                stopped: Callable[[], bool]) -> None:
    """Every ID at the schedule's next departure, and every one ``one`` puts back in
    ``again`` (a whole run's refused ones), until each is answered or ``stopped()``;
    ``k_of``: each ID's place in its stretch between pauses when it last left."""
    line = deque(ids)
    while line or again or tasks:
        if not line and not again:
            await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
            continue
        await slots.acquire()
        due = schedule.due()
        await _until(due)
        if stopped():
            slots.release()
            return
        if schedule.resume_at > due:  # a 429 came back while this one waited
            slots.release()
            continue
        rid = line.popleft() if line else again.popleft()
        task = asyncio.create_task(one(due, rid))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        k_of[rid] = schedule.k
        schedule.sent()
        # Let it reach the socket now, before this loop spins towards the next departure.
        await asyncio.sleep(0)


async def _list_ids(http: aiohttp.ClientSession, partner: Partner) -> list[str]:
    ids: list[str] = []
    cursor: str | None = None
    headers = {"Authorization": f"Bearer {partner.token}"}
    while True:
        params = {"limit": "1000", **({"cursor": cursor} if cursor else {})}
        async with http.get(f"{partner.url}/stale-recipients", params=params,
                            headers=headers) as resp:
            resp.raise_for_status()
            doc = await resp.json()
        ids += [item["id"] for item in doc["items"]]
        cursor = doc.get("next_cursor")
        if not cursor:
            return ids


async def pace(http: aiohttp.ClientSession, partner: Partner, ids: Sequence[str],
               rate: float, stop_on_429: bool = True, whole: bool = False,
               guard_s: float = 0.0) -> dict[str, Any]:
    """DELETE ``ids`` at t0 + k / rate; what came back, and how late the departures were.
    ``whole``: every ID to the end, a refused one sent again after the pause it asked for."""
    slots = asyncio.Semaphore(CONCURRENCY)
    first_429: list[float] = []
    statuses: dict[int, int] = {}
    late: list[float] = []
    tasks: set[asyncio.Task[None]] = set()
    again: deque[str] = deque()
    auth = f"Bearer {partner.token}"
    run = uuid.uuid4()
    k_of: dict[str, int] = {}
    refused_k: dict[str, int] = {}

    async def one(due: float, rid: str) -> None:
        late.append(time.perf_counter() - due)
        status, pause = 0, None
        try:
            async with http.delete(f"{partner.api_url}/recipients/{quote(rid, safe='')}",
                                   headers={"Authorization": auth,
                                            "Idempotency-Key": str(uuid.uuid5(run, rid))},
                                   ) as resp:
                await resp.read()
                status = resp.status
                pause = parse_retry_after(resp.headers.get("Retry-After"), time.time(),
                                          MAX_PAUSE_S)
        except (aiohttp.ClientError, TimeoutError):
            status = 0
        finally:
            slots.release()
        statuses[status] = statuses.get(status, 0) + 1
        if status == 429 and not first_429:
            first_429.append(time.perf_counter() - t0)
        if whole and status in (0, 429):
            if status == 429:
                where = k_bucket(k_of.get(rid, 0))
                refused_k[where] = refused_k.get(where, 0) + 1
            again.append(rid)
            if pause:
                schedule.pause_until(time.perf_counter() + pause)

    gc.collect()
    gc.disable()  # a collection in the middle of a spin would be a late departure
    cpu0, t0 = time.process_time(), time.perf_counter() + START_DELAY_S
    # A short trial never pauses (its one() puts nothing back): t0 + k / rate throughout.
    schedule = Schedule(rate, t0, guard_s if whole else 0.0)
    try:
        await _send(ids, schedule, slots, one, tasks, again, k_of,
                    lambda: bool(first_429) and stop_on_429 and not whole)
    finally:
        gc.enable()
    if tasks:
        await asyncio.gather(*set(tasks))
    wall = time.perf_counter() - t0
    return {"rate": rate, "sent": len(late), "statuses": {str(k): v for k, v in statuses.items()},
            "first_429_s": first_429[0] if first_429 else None, "wall_s": wall,
            "paused_s": schedule.paused_s if whole else None,
            "refused_at_k": refused_k if whole else None,
            "guard_ms": guard_s * 1000.0 if whole else None,
            "cpu_share": (time.process_time() - cpu0) / wall if wall > 0 else None,
            "late_p50_ms": _ms(percentile(late, 0.5)), "late_p99_ms": _ms(percentile(late, 0.99)),
            "late_max_ms": _ms(max(late, default=None))}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


async def _keep_warm(partner: Partner, seconds: float) -> None:
    """Ask for the partner's stats (not rate limited) every 20 ms for ``seconds``: after a
    second of idling, both processes' first wake-up was measured 1.3 ms late or more,
    which made even 0.94 R fail at its second request against a bucket of one."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        await partner.stats()
        await asyncio.sleep(0.02)


async def trial(cell: Cell, partner_rate: float, rate: float, n: int,
                whole: bool = False, guard_s: float = 0.0) -> dict[str, Any]:
    """One trial on a fresh partner process: N paced at ``rate``; ok when no 429 at all
    (``whole``: every ID answered, its 429s honoured and sent again; see ``pace``)."""
    sc = Scenario("oracle", "oracle", n=n, partner_rate=partner_rate, ceiling=rate, cell=cell,
                  matrix=True)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY + 2)
    async with aiohttp.ClientSession(connector=connector) as http, \
            sandbox(sc, http, "oracle") as partner:
        ids = await _list_ids(http, partner)
        # Open the connections now: a TCP connect at a departure would be jitter of its own.
        await asyncio.gather(*(partner.stats() for _ in range(CONCURRENCY)))
        if WARM_UP:
            # One DELETE of an ID the partner does not list, so its first DELETE is not a
            # slow one at a departure; it spends a unit of the limit, so the run begins
            # when every shape has given it back (a bucket's refill, a sliding second, the
            # fixed second it fell in).
            async with http.delete(f"{partner.api_url}/recipients/oracle-warm-up",
                                   headers={"Authorization": f"Bearer {partner.token}"}) as r:
                await r.read()
            await _keep_warm(partner, WARM_UP_GAP_S)
        result = await asyncio.wait_for(pace(http, partner, ids, rate, whole=whole,
                                             guard_s=guard_s),
                                        n / rate * 1.5 + 30)
        stats = await partner.stats()
        result["partner_cpu_s"] = cpu_s(partner.pid)
    result.update(n=len(ids), partner_requests=stats.get("requests"),
                  partner_429=stats.get("rate_limited"),
                  partner_requests_in_announced_wait=stats.get("requests_during_announced_wait"))
    answered = sum(v for k, v in result["statuses"].items() if k in ("204", "404", "200"))
    result["measured"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    result["ok"] = ((whole or (not stats.get("rate_limited") and result["first_429_s"] is None))
                    and answered == len(ids))
    return result


async def measure_whole(cell: Cell, partner_rate: float, n: int,
                        paces: Sequence[float], guard_s: float = 0.0) -> dict[str, Any]:
    """Whole runs of N at each pace, 429s honoured: the fastest is the oracle's time.
    Each run is kept as it ends (a quarter of an hour each), with the cell's earlier
    whole runs of the same N and shape."""
    k = key(cell.name, partner_rate)
    entry: dict[str, Any] = {}
    for rate in paces:
        try:
            t = await trial(cell, partner_rate, rate, n, whole=True, guard_s=guard_s)
        except TimeoutError:
            t = {"rate": rate, "ok": False, "wall_s": None, "error": "did not finish in time"}
        print(f"  oracle {cell.name:<12} R={partner_rate:g} r={rate:g}, whole run of {n:,}: "
              + (f"{t['wall_s']:.1f} s, {t.get('partner_429') or 0} 429s, paused "
                 f"{t.get('paused_s') or 0:.1f} s, "
                 f"{t.get('partner_requests_in_announced_wait') or 0} sent in an announced "
                 f"wait, refused at place {t.get('refused_at_k')} after a pause "
                 f"(late p99 {t['late_p99_ms']} ms)" if t.get("wall_s") else t["error"])
              + ("" if t["ok"] else f", failed {t.get('statuses')}"), file=sys.stderr, flush=True)
        cache = load_cache()
        old = cache.get(k) or {}
        before = (old.get("whole") or {}) if old.get("cell") == cell.as_dict() else {}
        earlier = before.get("runs", []) if before.get("n") == n else []
        entry = whole_entry(n, [*earlier, t])
        cache[k] = {**old, "cell": cell.as_dict(), "partner_rate": partner_rate,
                    "n": old.get("n", 0), "whole": entry}
        save_cache(cache)
    return entry


def whole_entry(n: int, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the cache keeps of whole runs of N: each, and the fastest that finished."""
    done = [t for t in runs if t.get("ok")]
    best = min(done, key=lambda t: float(t["wall_s"])) if done else None
    return {"n": n, "runs": [{k: t.get(k) for k in (
                "rate", "wall_s", "partner_429", "paused_s", "late_p99_ms", "ok",
                "partner_requests_in_announced_wait", "refused_at_k", "guard_ms",
                "measured")} for t in runs],
            "wall_s": best["wall_s"] if best else None, "rate": best["rate"] if best else None,
            "partner_429": best.get("partner_429") if best else None,
            "in_announced_wait": (best.get("partner_requests_in_announced_wait")
                                  if best else None),
            "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


async def measure(cell: Cell, partner_rate: float, n: int,
                  step: float = STEP) -> dict[str, Any]:
    """Step the pace down from R until a whole trial of N meets no 429."""
    trials = []
    found: dict[str, Any] | None = None
    for rate in rates(partner_rate, step):
        t = await trial(cell, partner_rate, rate, n)
        trials.append(t)
        first = t["first_429_s"]
        print(f"  oracle {cell.name:<12} R={partner_rate:g} r={rate:g}: "
              + ("no 429" if t["ok"] else
                 f"429 at {first:.2f} s" if first is not None else f"failed {t['statuses']}")
              + f" (late p99 {t['late_p99_ms']} ms, max {t['late_max_ms']} ms, "
              f"CPU {t['cpu_share'] or 0:.0%})", file=sys.stderr, flush=True)
        if t["ok"]:
            found = t
            break
    return {"cell": cell.as_dict(), "partner_rate": partner_rate, "n": n,
            "rate": found["rate"] if found else None,
            "share": found["rate"] / partner_rate if found else None,
            "cpu_share": found["cpu_share"] if found else None,
            "late_p99_ms": found["late_p99_ms"] if found else None,
            "late_max_ms": found["late_max_ms"] if found else None,
            "trials": trials, "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


# -- the cache ------------------------------------------------------------------------------


def load_cache() -> dict[str, dict[str, Any]]:
    try:
        doc = json.loads(ORACLE_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return dict(doc) if isinstance(doc, dict) else {}


def save_cache(entries: dict[str, dict[str, Any]]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    ORACLE_FILE.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")


def keep_whole(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """A cell measured again keeps its whole runs (measured apart, and far longer)."""
    if old and old.get("whole") and old.get("cell") == new.get("cell"):
        new["whole"] = old["whole"]
    return new


def usable(entry: dict[str, Any] | None, cell: Cell, n: int) -> bool:
    """A cached entry serves when it was measured on this shape with at least this N."""
    return (entry is not None and entry.get("cell") == cell.as_dict()
            and int(entry.get("n", 0)) >= n)


def missing(cells: Iterable[Cell], partner_rate: float, n: int,
            remeasure: bool = False) -> list[Cell]:
    cache = load_cache()
    return [c for c in cells
            if remeasure or not usable(cache.get(key(c.name, partner_rate)), c, n)]


def estimate_s(cells: Sequence[Cell], partner_rate: float, n: int) -> float:
    """One whole trial per cell plus a few short failed ones, with the partner's start."""
    return len(cells) * (n / partner_rate + 10.0)


async def ensure(cells: Sequence[Cell], partner_rate: float, n: int,
                 remeasure: bool = False) -> dict[str, dict[str, Any]]:
    """The oracle of every cell at R (measured where the cache has none), by cell name."""
    todo = missing(cells, partner_rate, n, remeasure)
    cache = load_cache()
    for cell in todo:
        print(f"oracle: measuring {cell.name} at R = {partner_rate:g}/s, N = {n:,}",
              file=sys.stderr, flush=True)
        k = key(cell.name, partner_rate)
        cache[k] = keep_whole(cache.get(k), await measure(cell, partner_rate, n))
        save_cache(cache)  # after each cell: an interrupted run keeps what it measured
    return {c.name: cache[key(c.name, partner_rate)] for c in cells
            if key(c.name, partner_rate) in cache}


def attach(results: Iterable[Result], entries: dict[str, dict[str, Any]] | None = None) -> None:
    """Give each row whose (cell, R) was measured its oracle (rate, time for its
    scenario; a whole run's own time where one of the row's N was run), unless it has
    one; ``entries`` by ``key`` (default: the cache, so an old results.json gets them)."""
    entries = load_cache() if entries is None else entries
    for r in results:
        spec = r.scenario_spec()
        if "oracle" in r.extra or spec is None or spec.unlimited:
            continue
        e = entries.get(key(r.cell, spec.partner_rate))
        if e is None:
            continue
        whole = e.get("whole") or {}
        if whole.get("wall_s") and whole.get("n") == spec.n and not spec.events:
            # Whole runs of this very N, their refusals paid: the oracle's own time.
            r.extra["oracle"] = {"rate": whole["rate"], "partner_rate": spec.partner_rate,
                                 "s": float(whole["wall_s"]), "n": spec.n, "whole": True,
                                 "partner_429": whole.get("partner_429"),
                                 "in_announced_wait": whole.get("in_announced_wait"),
                                 "trials": len(whole.get("runs", ())),
                                 "measured": whole.get("measured")}
            continue
        if not e.get("rate"):
            continue
        r.extra["oracle"] = {"rate": e["rate"], "partner_rate": spec.partner_rate,
                             "s": spec.oracle_s(float(e["rate"])), "n": e.get("n"),
                             "cpu_share": e.get("cpu_share"),
                             "late_p99_ms": e.get("late_p99_ms"),
                             "trials": len(e.get("trials", ())), "measured": e.get("measured")}


def by_key(entries: dict[str, dict[str, Any]], partner_rate: float) -> dict[str, dict[str, Any]]:
    """``ensure``'s answer (by cell name) keyed as ``attach`` reads it."""
    return {key(name, partner_rate): e for name, e in entries.items()}


# -- the command line -----------------------------------------------------------------------


def describe(entry: dict[str, Any]) -> str:
    rate = entry.get("rate")
    if not rate:
        return f"no pace without a 429 down to {FLOOR:.0%} of R"
    trials = entry.get("trials", [])
    return (f"{rate:g}/s ({entry['share']:.1%} of R) after {len(trials)} trial(s); "
            f"N {entry['n']:,}, departures late p99 {entry.get('late_p99_ms')} ms, "
            f"max {entry.get('late_max_ms')} ms; CPU {entry.get('cpu_share') or 0:.1%} of a core")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", help="comma-separated partner cells (default: all 8)")
    p.add_argument("--rate", type=float, default=50.0, help="the partner's R per second")
    p.add_argument("--quick", action="store_true", help="a trial of 6 s at R, not 30 s")
    p.add_argument("--n", type=int, help="requests per trial (default: 30 s at R)")
    p.add_argument("--step", type=float, default=STEP, help="share of R slower per trial")
    p.add_argument("--remeasure", action="store_true", help="ignore bench/out/oracle.json")
    p.add_argument("--whole", action="store_true",
                   help="whole runs of N at each of --paces, 429s honoured (a long cell)")
    p.add_argument("--paces", help="comma-separated paces per second for --whole")
    p.add_argument("--guard-ms", type=float, default=0.0,
                   help="--whole: hold the second departure after a pause back this much")
    args = p.parse_args()
    cells = select_cells(args.cells)
    n = args.n or trial_n(args.rate, args.quick)
    cache = load_cache()
    if args.whole:
        if not args.paces:
            p.error("--whole needs --paces (e.g. 19.5,19.25)")
        paces = [float(v) for v in args.paces.split(",")]
        for cell in cells:
            entry = asyncio.run(measure_whole(cell, args.rate, n, paces,
                                              args.guard_ms / 1000.0))
            print(f"{cell.name:<12} R={args.rate:g}, whole runs of {n:,}: "
                  + (f"{entry['wall_s']:.1f} s at {entry['rate']:g}/s "
                     f"({entry['partner_429']} 429s)" if entry["wall_s"] else "none finished"))
        return 0
    for cell in cells:
        k = key(cell.name, args.rate)
        if args.remeasure or not usable(cache.get(k), cell, n):
            print(f"oracle: measuring {cell.name} at R = {args.rate:g}/s, N = {n:,}",
                  file=sys.stderr, flush=True)
            cache[k] = keep_whole(cache.get(k), asyncio.run(measure(cell, args.rate, n,
                                                                    args.step)))
            save_cache(cache)
        print(f"{cell.name:<12} R={args.rate:g}: {describe(cache[k])}")
    shares = [cache[key(c.name, args.rate)].get("share") for c in cells]
    known = [s for s in shares if s]
    if known:
        print(f"mean share of R: {statistics.fmean(known):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
