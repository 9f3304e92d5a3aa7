"""``cleanup-supervisor demo --queue infrai``: the whole demo through the Infrai emulator,
as a user runs it, ending with duplicates=0 failed=0 and what Infrai billed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_the_demo_runs_through_infrai() -> None:
    # A caller's own Infrai key or queue setting must not leak into the demo.
    env = {**os.environ, "INFRAI_API_KEY": "ifr_a_real_key_must_not_be_used",
           "CLEANUP__QUEUE__BACKEND": "sqlite"}
    done = subprocess.run([sys.executable, "-m", "supervisor", "demo", "--queue", "infrai",
                           "--recipients", "400", "--rate", "200"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    last = dict(kv.split("=", 1) for kv in done.stdout.strip().splitlines()[-1].split())
    assert (last["discovered"], last["duplicates"], last["failed"]) == ("400", "0", "0")
    assert int(last["deleted"]) + int(last["already_absent"]) == 400
    assert 2.0 <= float(last["infrai_calls_per_op"]) < 3.0, last
    assert "queue infrai (Infrai emulator" in done.stdout


def test_the_managed_shape_end_to_end() -> None:
    """Infrai cron -> trigger -> publish -> pull -> delete -> events to three sinks."""
    done = subprocess.run([sys.executable, "-m", "supervisor", "demo", "--shape", "managed",
                           "--recipients", "200", "--rate", "200"],
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    last = dict(kv.split("=", 1) for kv in done.stdout.strip().splitlines()[-1].split())
    assert (last["discovered"], last["duplicates"], last["failed"]) == ("200", "0", "0")
    assert last["events"] == "201"  # each settled operation, and the finished run
    for sink in ("sink_warehouse", "sink_hook-0", "sink_hook-1"):
        assert last[sink] == "201", last
    assert "Infrai cron -> trigger -> run" in done.stdout
