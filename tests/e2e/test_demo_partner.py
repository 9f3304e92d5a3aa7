"""``cleanup-supervisor demo --partner batch|accepted|job``: the demo against each batch
partner, as a user runs it. Its last line counts every request the service made to the
partner (batch submissions, probes, job polls) per operation, and its ideal is what
``cleanup-supervisor plan`` works out, a job partner's own rounds included."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from cleanup_sandbox.demo import BATCH_SIZE, JOB_SECONDS, MAX_JOBS, SILENT_MISS_SHARE

pytestmark = pytest.mark.e2e

K = BATCH_SIZE
# Rounding of each printed per-operation figure (three decimals), summed over four.
ROUNDING = 4 * 0.0005


def _demo(partner: str, n: int) -> dict[str, float]:
    """Run the demo; the last line's key=value figures, after the run's own checks."""
    done = subprocess.run([sys.executable, "-m", "supervisor", "demo", "--partner", partner,
                           "--recipients", str(n), "--rate", "100"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    pairs = (kv.split("=", 1) for kv in done.stdout.strip().splitlines()[-1].split())
    last = {k: float(v) for k, v in pairs}
    assert (last["discovered"], last["failed"], last["duplicates"]) == (n, 0, 0), last
    # Where the requests went adds up to all of them.
    parts = last["batch_requests_per_op"] + last["probes_per_op"] \
        + last.get("job_polls_per_op", 0.0)
    assert last["requests_per_op"] == pytest.approx(parts, abs=ROUNDING), last
    return last


def test_a_per_item_partner_costs_a_request_per_batch() -> None:
    n = 300
    last = _demo("batch", n)
    # At least one request per K ids; a per-item answer needs no probe.
    assert math.ceil(n / K) / n <= last["requests_per_op"] < 1, last
    assert last["batch_requests_per_op"] >= math.ceil(n / K) / n - ROUNDING, last


def test_an_accepted_partner_costs_a_probe_per_id() -> None:
    n = 300
    last = _demo("accepted", n)
    least = (math.ceil(n / K) + n) / n  # a request per K ids and a probe for each id
    # An id the partner silently left in place goes in another batch and is probed again:
    # two requests each, allowing three times the share the simulator misses.
    most = least + 2 * 3 * SILENT_MISS_SHARE
    assert least - ROUNDING <= last["requests_per_op"] <= most, last
    assert last["probes_per_op"] >= 1, last


def test_a_job_partner_ideal_includes_the_jobs_own_time() -> None:
    n = 450  # five jobs: two rounds of at most four
    last = _demo("job", n)
    jobs = math.ceil(n / K)
    # Each job submitted, then read at least once (the read that finds it done).
    assert 2 * jobs / n - ROUNDING <= last["requests_per_op"] < 1, last
    assert last["job_polls_per_op"] >= jobs / n - ROUNDING, last
    assert last["ideal_seconds"] >= math.ceil(jobs / MAX_JOBS) * JOB_SECONDS, last
