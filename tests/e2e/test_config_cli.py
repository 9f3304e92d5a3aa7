"""An invalid configuration (issue #2, test 8): ``check-config`` and ``serve`` exit 2 and
report every problem at once, each naming its key; ``serve`` starts nothing."""

from __future__ import annotations

import asyncio
import re
import socket
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import toml_text
from tests.helpers import free_port

pytestmark = pytest.mark.e2e

EXPECTED = [
    r"limits\.rate_per_second must be > 0, got -1(\.0)?$",
    r"limits\.colour is not a known key$",
    r"partner\.request_timeout_seconds must be a number, got 'ten'$",
    r"unknown section \[bogus\]",
]


def _problems(stderr: str) -> list[str]:
    return [line.strip()[2:] for line in stderr.splitlines() if line.strip().startswith("- ")]


def _assert_reports_exactly(stderr: str, expected: list[str]) -> None:
    problems = _problems(stderr)
    assert re.search(rf"\b{len(expected)} problem\(s\)", stderr), stderr
    assert len(problems) == len(expected), stderr
    for pattern in expected:
        assert sum(bool(re.search(pattern, p)) for p in problems) == 1, (pattern, stderr)


async def test_invalid_config_is_refused_naming_every_key(e2e, tmp_path):
    port = free_port()
    data_dir = tmp_path / "never-created"
    valid = {
        "service": {"listen": f"127.0.0.1:{port}", "data_dir": str(data_dir)},
        "source": {"kind": "inline"},
        "limits": {"rate_per_second": 20.0},
    }
    good = tmp_path / "good.toml"
    good.write_text(toml_text(valid), encoding="utf-8")
    bad = tmp_path / "bad.toml"
    bad.write_text(toml_text({
        **valid,
        "limits": {"rate_per_second": -1, "colour": "blue"},
        "partner": {"request_timeout_seconds": "ten"},
        "bogus": {"x": 1},
    }), encoding="utf-8")

    code, out, err = await e2e.cli("check-config", str(good))
    assert code == 0, err
    assert out.startswith("ok:"), out

    code, out, err = await e2e.cli("check-config", str(bad))
    assert code == 2, (out, err)
    _assert_reports_exactly(err, EXPECTED)

    # The installed console script is the same program.
    script = Path(sys.executable).parent / "cleanup-supervisor"
    proc = await asyncio.create_subprocess_exec(
        str(script), "check-config", str(bad), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=e2e.env)
    e2e.processes.add(proc)
    _, script_err = await proc.communicate()
    assert proc.returncode == 2
    _assert_reports_exactly(script_err.decode(), EXPECTED)

    # serve refuses the same file the same way, before it takes the data dir or the port.
    code, out, err = await e2e.cli("serve", "--config", str(bad))
    assert code == 2, (out, err)
    _assert_reports_exactly(err, EXPECTED)
    assert not data_dir.exists()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing listens there

    # Environment overrides are checked like the file, and a missing secret is a problem.
    env = {k: v for k, v in e2e.env.items() if k != "CLEANUP_TRIGGER_TOKEN"}
    env["CLEANUP__LIMITS__CONCURRENCY"] = "0"
    code, out, err = await e2e.cli("check-config", str(good), env=env)
    assert code == 2, (out, err)
    _assert_reports_exactly(err, [r"limits\.concurrency must be > 0, got 0$",
                                  r"trigger\.token_env: \$CLEANUP_TRIGGER_TOKEN .*not set"])
    # A secret is never printed, whatever else is.
    for text in (out, err):
        assert e2e.partner_token not in text

