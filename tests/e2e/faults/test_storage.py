"""Storage faults through a real process (issue 3, point 4).

The ledger cannot commit: the service says so in one clear log line (not one per write),
``/readyz`` turns 503, no message is acked whose outcome was not committed, and it
recovers by itself when the fault clears, finishing the run with nothing doubled.

* locked: a second connection holds ``BEGIN EXCLUSIVE`` on the ledger file;
* full disk: the data dir sits on a small tmpfs that a filler file fills to the last
  byte (needs root for ``mount``; skipped, saying why, where mounting is not allowed);
* read-only: the filesystem refuses every write with EROFS, as one remounted read-only
  after an error does. Linux refuses to remount a filesystem read-only while a file on
  it is open for writing (EBUSY, bind mounts too), so the case attaches ``strace`` to the
  running service and makes each ``pwrite64`` fail with EROFS, then detaches (skipped,
  saying why, where strace or ptrace is not available).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.faults.harness import KEYS, Fault, FaultService, fault_service, verify
from tests.e2e.harness import E2E, Sandbox
from tests.e2e.ledger_file import read_ledger, stranded

pytestmark = pytest.mark.e2e

POPULATION = 600
CONCURRENCY = 8


# What the consumers log, at DEBUG, for each write that fails while the fault holds.
FAILED_WRITE = (r"(could not (record operation \S+|claim messages)|component \S+ paused): "
                r"ledger commit failed")


def logged_at(line: str) -> float:
    """The time a service log line was written (its leading asctime)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


async def ledger_fault(svc: FaultService, sandbox: Sandbox, fault_line: str,
                       at_fault: dict[str, Any], ledger: Path, *, every_commit: bool) -> None:
    """While the fault holds: one clear line, not ready, triggers refused, more writes
    failing without more lines, nothing acked that was not committed, and, when no
    commit can succeed (``every_commit``), nothing sent that could not be recorded."""
    sp = svc.current
    assert sp is not None
    line = await sp.wait_for_line(r"ledger cannot commit", 30)
    assert fault_line in line, line
    assert " ERROR " in line, line
    status, doc = await svc.request("GET", "/readyz", auth=False)
    assert status == 503, doc
    assert doc["checks"]["ledger"] is False, doc
    status, doc = await svc.trigger()
    assert status == 503, doc
    # Writes keep failing while the fault holds, in later commits too (the per-write
    # record is at DEBUG)...
    mark = sp.lines.index(line) + 1
    while True:
        found = await sp.wait_for_new_line(FAILED_WRITE, mark, 30)
        assert " DEBUG " in found, found
        mark = sp.lines.index(found, mark) + 1
        if logged_at(found) - logged_at(line) >= 1.0:
            break
    # ... and the fault was said once.
    assert sp.count(r"ledger cannot commit") == 1, sp.tail()
    assert not [x for x in sp.lines if re.search(FAILED_WRITE, x) and " DEBUG " not in x]
    if every_commit:
        # No attempt could be recorded, so nothing new was sent: at most the requests
        # already recorded and on their way when the fault began. (A full disk lets some
        # commits through; what those record may be sent: verify() checks that every
        # request the partner saw has its attempt row.)
        during = await sandbox.stats()
        assert during["requests"] - at_fault["requests"] <= CONCURRENCY, (at_fault, during)
    # Operations that still need work but have no message: acked without an outcome.
    assert read_ledger(ledger).stranded == []


async def recovered(svc: FaultService) -> None:
    """The fault cleared: the service says so and is ready again, by itself."""
    sp = svc.current
    assert sp is not None
    await sp.wait_for_line(r"ledger writable again", 30)
    status, doc = await svc.request("GET", "/readyz", auth=False)
    assert status == 200, doc


def storage_service(e2e: E2E, sandbox: Sandbox, data_dir: Path | None = None) -> FaultService:
    overrides: dict[str, dict[str, Any]] = {
        # Short leases: messages whose outcome could not be committed come back soon.
        "queue": {"lease_seconds": 2.0},
        "limits": {"rate_per_second": 200, "concurrency": CONCURRENCY},
        "partner": {"request_timeout_seconds": 2.0, "connect_timeout_seconds": 1.0}}
    if data_dir is not None:
        overrides["service"] = {"data_dir": str(data_dir)}
    # DEBUG shows each write that fails while the fault holds, so the case can wait for
    # them; at INFO and above the fault is one line.
    return fault_service(e2e, sandbox, KEYS.overrides, overrides,
                         global_args=("--log-level", "debug"))


async def test_locked_ledger(e2e: E2E, fault: Fault) -> None:
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--seed", fault.seed,
                                "--rate", 1000, "--latency-ms", 10)
    svc = storage_service(e2e, sandbox)
    await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(30, executions=fault.rng.randint(POPULATION // 5, POPULATION // 2))

    locker = sqlite3.connect(svc.ledger_path, isolation_level=None, timeout=10,
                             check_same_thread=False)
    try:
        await asyncio.to_thread(locker.execute, "BEGIN EXCLUSIVE")
        at_lock = await sandbox.stats()
        # What was committed when the lock was taken is consistent.
        assert stranded(locker) == []
        await ledger_fault(svc, sandbox, "database is locked", at_lock, svc.ledger_path,
                           every_commit=True)
    finally:
        with contextlib.suppress(sqlite3.Error):
            locker.execute("ROLLBACK")
        locker.close()
    await recovered(svc)
    v = await verify(e2e, svc, sandbox, run_id, KEYS, fault)
    assert svc.count(r"ledger cannot commit") == 1
    # The requests in the air when the lock was taken were executed, but their outcome
    # could not be committed: their messages came back and the resend was replayed.
    fault.record.notes.update({"replays": v.stats["replays"]})


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MB tmpfs (root only). Request it before ``e2e`` so it is unmounted after
    every process is gone."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the full-disk case needs a small filesystem")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the full-disk "
                    "case needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def fill(path: Path) -> int:
    """Write ``path`` until the filesystem has not a byte left; return its size."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    written = 0
    try:
        for chunk in (1 << 20, 1 << 16, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    written += os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    return written


async def test_full_disk(small_disk: Path, e2e: E2E, fault: Fault) -> None:
    population = 1500
    # Slow pages, so the disk fills between two pages of the scan: a page of operations
    # and messages needs new space. (Once everything is discovered, a drain mostly reuses
    # the pages its acks free and may never need a new byte.)
    sandbox = await e2e.sandbox("--recipients", population, "--seed", fault.seed,
                                "--rate", 1000, "--latency-ms", 10, "--page-delay-ms", 300)
    svc = storage_service(e2e, sandbox, small_disk / "data")
    await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(30, pages=1)

    filler = small_disk / "filler"
    size = await asyncio.to_thread(fill, filler)
    at_full = await sandbox.stats()
    try:
        await ledger_fault(svc, sandbox, "database or disk is full", at_full,
                           svc.ledger_path, every_commit=False)
    finally:
        filler.unlink()
    await recovered(svc)
    await verify(e2e, svc, sandbox, run_id, KEYS, fault)
    assert svc.count(r"ledger cannot commit") == 1
    fault.record.notes.update({"filler_bytes": size})


@contextlib.asynccontextmanager
async def writes_refused(e2e: E2E, pid: int) -> AsyncIterator[None]:
    """Every ``pwrite64`` of process ``pid`` (all its threads) fails with EROFS until the
    block ends: strace attaches, injects, and detaches on SIGINT."""
    if shutil.which("strace") is None:
        pytest.skip("no strace: the read-only case injects EROFS through it")
    tracer = await asyncio.create_subprocess_exec(
        "strace", "-f", "-p", str(pid), "-o", "/dev/null", "-e", "trace=pwrite64",
        "-e", "inject=pwrite64:error=EROFS",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    e2e.processes.add(tracer)
    assert tracer.stderr is not None
    try:
        # "Process N attached with M threads", once every thread of the service is held
        # (threads born later are followed from their birth).
        async with asyncio.timeout(10):
            said = await tracer.stderr.readline()
        if b"attached" not in said:
            await tracer.wait()
            pytest.skip(f"strace cannot attach here: {said.decode().strip()}")
        yield
    finally:
        if tracer.returncode is None:
            tracer.send_signal(signal.SIGINT)  # detach; a SIGKILL could take the tracee along
            async with asyncio.timeout(10):
                await tracer.wait()


async def test_read_only_filesystem(e2e: E2E, fault: Fault) -> None:
    sandbox = await e2e.sandbox("--recipients", POPULATION, "--seed", fault.seed,
                                "--rate", 1000, "--latency-ms", 10)
    svc = storage_service(e2e, sandbox)
    sp = await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(30, executions=fault.rng.randint(POPULATION // 5, POPULATION // 2))
    async with writes_refused(e2e, sp.proc.pid):
        at_fault = await sandbox.stats()
        await ledger_fault(svc, sandbox, "disk I/O error", at_fault, svc.ledger_path,
                           every_commit=True)
    await recovered(svc)
    await verify(e2e, svc, sandbox, run_id, KEYS, fault)
    assert svc.count(r"ledger cannot commit") == 1
