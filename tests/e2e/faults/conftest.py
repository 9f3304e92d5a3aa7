"""Fixtures and report hooks of the fault suite; its harness is :mod:`tests.e2e.faults.harness`."""

from __future__ import annotations

import os
import random
import sys
import time
import zlib
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from tests.e2e.faults.harness import KEYS, NO_KEYS, REPORT, Fault, FaultRecord, Mode


@pytest.fixture(params=[KEYS, NO_KEYS], ids=lambda m: m.name)
def mode(request: pytest.FixtureRequest) -> Mode:
    chosen: Mode = request.param
    return chosen


# The adversarial script (test_adversarial.py) runs every shape in both modes. The older
# per-shape storms marked ``one_mode`` run in one mode each, so that ``make test`` fits
# CI's 30 minutes; this runs them in both.
EVERY_MODE = os.environ.get("CLEANUP_FAULTS_EVERY_MODE") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the modes a ``one_mode`` case does not run: the one it names, or, with
    ``alternate``, keys and no keys in turn across its other parameters (a batch shape)."""
    if EVERY_MODE:
        return
    kept, dropped = [], []
    order: dict[str, dict[str, int]] = {}  # per test, its other parameters' turn
    for item in items:
        marker = item.get_closest_marker("one_mode")
        spec = getattr(item, "callspec", None)
        if marker is None or spec is None or "mode" not in spec.params:
            kept.append(item)
            continue
        wanted = marker.args[0]
        if wanted == "alternate":
            turns = order.setdefault(item.nodeid.split("[")[0], {})
            others = repr(sorted((k, str(v)) for k, v in spec.params.items() if k != "mode"))
            index = turns.setdefault(others, len(turns))
            wanted = KEYS.name if index % 2 == 0 else NO_KEYS.name
        (kept if spec.params["mode"].name == wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def fault(request: pytest.FixtureRequest) -> Iterator[Fault]:
    forced = os.environ.get("FAULT_SEED")
    seed = int(forced) if forced else zlib.crc32(request.node.name.encode()) % 100_000
    record = FaultRecord(case=request.node.name, seed=seed)
    print(f"fault seed {seed} (rerun with FAULT_SEED={seed})")
    started = time.monotonic()
    try:
        yield Fault(seed, random.Random(seed), record)
    finally:
        record.seconds = time.monotonic() - started
        rep = getattr(request.node, "rep_call", None)
        record.status = "?" if rep is None else _status(rep)
        REPORT.append(record)
        if rep is not None and rep.failed:
            print(f"FAILED with fault seed {seed}: rerun with FAULT_SEED={seed} "
                  f"pytest '{request.node.nodeid}'", file=sys.stderr)


def _status(rep: pytest.TestReport) -> str:
    """passed, failed, or, for a case marked as failing on a known bug, xfail (it failed
    as expected) or xpass."""
    if hasattr(rep, "wasxfail"):
        return "xfail" if rep.skipped else "xpass"
    return rep.outcome


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    rep = yield
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not REPORT:
        return
    tr = terminalreporter
    tr.section("fault suite")
    tr.write_line(f"{'case':58} {'seed':>6} {'runs':>4} {'procs':>5} {'kills':>5} "
                  f"{'ops':>6} {'dups':>4} {'secs':>6}  status  notes")
    for r in REPORT:
        dups = "-" if r.duplicates is None else str(r.duplicates)
        notes = " ".join(f"{k}={v}" for k, v in r.notes.items())
        tr.write_line(f"{r.case[:58]:58} {r.seed:>6} {r.runs:>4} {r.processes:>5} "
                      f"{r.kills:>5} {r.operations:>6} {dups:>4} {r.seconds:>6.1f}  "
                      f"{r.status:6}  {notes}")
