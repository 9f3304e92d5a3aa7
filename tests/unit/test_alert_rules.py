"""The alert rules, evaluated by Prometheus's own promtool on series written for them, and
held to having, each, a case where it fires and one where it stays quiet."""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"
# The rules counting days are evaluated hourly in a file of their own (promtool steps
# through every evaluation from time 0: minutes over 10 days take it 20 s).
TEST_FILES = ("alerts_test.yml", "alerts_test_days.yml")


def _alerts() -> list[str]:
    doc = yaml.safe_load((PACKAGING / "alerts.yml").read_text())
    return [rule["alert"] for group in doc["groups"] for rule in group["rules"]
            if "alert" in rule]


def _cases() -> dict[str, set[str]]:
    """alertname -> the kinds of case the test files have for it: 'fires', 'quiet'."""
    kinds: dict[str, set[str]] = defaultdict(set)
    for name in TEST_FILES:
        doc: dict[str, Any] = yaml.safe_load((PACKAGING / name).read_text())
        assert doc["rule_files"] == ["alerts.yml"], name
        for test in doc["tests"]:
            for case in test.get("alert_rule_test", []):
                kinds[case["alertname"]].add("fires" if case.get("exp_alerts") else "quiet")
    return kinds


def test_alert_rules_fire_and_stay_quiet_as_written() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found: apt-get install prometheus (.ci/run does)")
    done = subprocess.run([promtool, "test", "rules", *TEST_FILES], cwd=PACKAGING,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_rule_has_a_case_that_fires_and_one_that_stays_quiet() -> None:
    alerts = _alerts()
    assert len(alerts) == len(set(alerts)), "an alert name is used twice"
    cases = _cases()
    missing = {name: sorted({"fires", "quiet"} - cases.get(name, set())) for name in alerts}
    assert {name: kinds for name, kinds in missing.items() if kinds} == {}


def test_every_case_names_a_rule_that_exists() -> None:
    # promtool accepts a case for an alert no rule defines: an empty exp_alerts passes,
    # and a renamed rule would keep its quiet cases green while testing nothing.
    assert set(_cases()) - set(_alerts()) == set()
