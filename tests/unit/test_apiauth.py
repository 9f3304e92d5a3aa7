"""supervisor/apiauth.py on its own, with an injected clock: tokens to roles, the failure
throttle's buckets, the bounded failure log, client keys and the Host allow-list; and the
masking of Infrai's cron records."""

from __future__ import annotations

import ipaddress
import logging

import pytest

from supervisor import config
from supervisor.apiauth import MAX_CLIENTS, FailureThrottle, Guard, Role, client_key
from supervisor.configtypes import Secret
from supervisor.infrai.cron import masked

OPERATOR = "operator-token-0123456789abcdef0123"
TICK = "tick-token-0123456789abcdef01234567"
VIEWER = "viewer-token-0123456789abcdef012345"


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def guard(clock: Clock | None = None, **env: str) -> Guard:
    cfg = config.load(None, environ={"CLEANUP_TRIGGER_TOKEN": OPERATOR,
                                     "CLEANUP_TICK_TOKEN": TICK, **env})
    return Guard(cfg, clock or Clock())


@pytest.mark.parametrize(("supplied", "role"), [
    (OPERATOR, Role.OPERATOR), (f" {OPERATOR}\n", Role.OPERATOR), (TICK, Role.TICK),
    ("", None), (OPERATOR[:-1], None), (OPERATOR + "x", None), ("\x00", None),
    ("x" * 10_000, None), ("caf\udcc3\udca9", None),
])
def test_a_token_proves_its_role(supplied: str, role: Role | None) -> None:
    assert guard().identify(supplied) is role


def test_an_unset_token_is_proven_by_nothing() -> None:
    g = guard()  # no viewer or metrics token configured
    assert g.identify(VIEWER) is None
    assert g.identify("\x00") is None
    assert guard(CLEANUP_STATUS_TOKEN=VIEWER).identify(VIEWER) is Role.VIEWER


def test_a_client_has_a_burst_then_one_failure_per_interval() -> None:
    clock = Clock()
    throttle = FailureThrottle(per_client=3, total=1000, clock=clock)
    for _ in range(3):
        assert throttle.retry_after("a") == 0
        throttle.failed("a")
    assert throttle.retry_after("a") == pytest.approx(20.0)  # 60 s / 3
    assert throttle.retry_after("b") == 0  # per client
    clock.t += 20.0
    assert throttle.retry_after("a") == 0
    throttle.failed("a")
    assert throttle.retry_after("a") == pytest.approx(20.0)
    clock.t += 60.0
    assert throttle.retry_after("a") == 0
    assert "a" not in throttle._clients  # refilled: forgotten


def test_all_clients_together_have_one_limit_a_proven_client_is_spared() -> None:
    clock = Clock()
    throttle = FailureThrottle(per_client=100, total=2, clock=clock)
    throttle.succeeded("cron")
    throttle.failed("x")
    throttle.failed("y")
    assert throttle.retry_after("new") == pytest.approx(30.0)  # 60 s / 2
    assert throttle.retry_after("cron") == 0
    clock.t += 30.0
    assert throttle.retry_after("new") == 0


def test_the_throttle_remembers_a_bounded_number_of_clients() -> None:
    throttle = FailureThrottle(per_client=1, total=10**9, clock=Clock())
    for i in range(MAX_CLIENTS + 50):
        throttle.failed(f"c{i}")
    assert len(throttle._clients) == MAX_CLIENTS
    assert throttle.retry_after("c0") == 0  # the oldest forgotten first
    assert throttle.retry_after(f"c{MAX_CLIENTS + 49}") > 0


def test_failures_are_logged_at_most_once_per_ten_seconds_with_the_count_held_back(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="supervisor.apiauth")
    clock = Clock()
    g = guard(clock)
    for _ in range(50):
        g.failed("203.0.113.1", "/v1/runs")
        clock.t += 0.1
    assert [r.getMessage() for r in caplog.records] == [
        "authentication failed on /v1/runs from 203.0.113.1 (0 more not logged in the "
        "last 10 s)"]
    clock.t = 1010.0
    g.failed("203.0.113.2", "/login")
    assert caplog.records[-1].getMessage() == (
        "authentication failed on /login from 203.0.113.2 (49 more not logged in the last "
        "10 s)")


def test_an_ipv6_client_is_its_64_and_a_mapped_ipv4_is_the_ipv4() -> None:
    assert client_key(ipaddress.ip_address("2001:db8:1:2:3:4:5:6")) == "2001:db8:1:2::/64"
    assert client_key(ipaddress.ip_address("203.0.113.9")) == "203.0.113.9"
    assert client_key(None) == "unknown"


@pytest.mark.parametrize(("allowed", "host", "ok"), [
    ('["*"]', "anything.example", True),
    ('["cleanup.example.com"]', "Cleanup.Example.COM:8443", True),
    ('["cleanup.example.com"]', "cleanup.example.com.", True),
    ('["cleanup.example.com"]', "evil.example", False),
    ('["cleanup.example.com"]', "xcleanup.example.com", False),
    ('[".example.com"]', "a.example.com", True),
    ('[".example.com"]', "example.com", True),
    ('[".example.com"]', "badexample.com", False),
    ('["cleanup.example.com"]', "192.0.2.1:80", True),
    ('["cleanup.example.com"]', "[2001:db8::1]:80", True),
    ('["cleanup.example.com"]', "[2001:db8::1", False),
    ('["cleanup.example.com"]', "caf\udcc3.example", False),
])
def test_the_host_allow_list(allowed: str, host: str, ok: bool) -> None:
    g = guard(CLEANUP__SERVICE__ALLOWED_HOSTS=allowed)
    assert g.host_allowed(host) is ok
    assert g.host_allowed(None) is True  # HTTP/1.0 without Host: no browser sends that


def test_cron_records_are_masked_at_every_depth() -> None:
    token = Secret(TICK)
    record = {
        "job": {"name": "cleanup-weekly", "headers": {"Authorization": f"Bearer {TICK}"},
                "task": {"url": "https://h/v1/runs", "Headers": {"X": "y"},
                         "auth": f"Bearer {TICK}"}},
        "recent_runs": [{"request": {"authorization": "Bearer other"}, "output": "ok",
                         "echo": [f"sent {TICK}"]}],
        "next_run_at": 5,
    }
    out = masked(record, [token, None])
    assert out == {
        "job": {"name": "cleanup-weekly", "headers": "***",
                "task": {"url": "https://h/v1/runs", "Headers": "***", "auth": "***"}},
        "recent_runs": [{"request": {"authorization": "***"}, "output": "ok",
                         "echo": ["***"]}],
        "next_run_at": 5,
    }
    assert TICK not in repr(out)
