"""The alert rules, evaluated by Prometheus's own promtool on series written for them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"


def test_alert_rules_fire_and_stay_quiet_as_written() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found: apt-get install prometheus (.ci/run does)")
    done = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=PACKAGING,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
