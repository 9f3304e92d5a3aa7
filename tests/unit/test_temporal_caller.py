"""The Temporal activity's configuration and argument checks (supervisor/callers/temporal.py):
each bad value is refused with its name, and the token is never shown. Its behaviour
against a real Temporal server and the service is tests/e2e/test_temporal.py."""

from __future__ import annotations

import pytest

from tests.conftest import unavailable

try:
    from temporalio.exceptions import ApplicationError

    from supervisor.callers.temporal import REFUSED, CleanupActivity, _slot
except ImportError:
    HAVE_TEMPORALIO = False
else:
    HAVE_TEMPORALIO = True

TOKEN = "t0ken-never-shown-0123456789abcdef"


@pytest.fixture(autouse=True)
def _temporalio(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HAVE_TEMPORALIO:
        unavailable("temporalio is not installed: pip install temporalio", "CLEANUP_REQUIRE_TEMPORAL")
    monkeypatch.setenv("CLEANUP_TRIGGER_TOKEN", TOKEN)


def test_the_token_is_read_from_its_variable_and_never_shown() -> None:
    activity = CleanupActivity("http://127.0.0.1:8080/")
    assert activity.service_url == "http://127.0.0.1:8080"
    assert TOKEN not in repr(activity)


def test_a_missing_token_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CLEANUP_TRIGGER_TOKEN")
    with pytest.raises(ValueError, match=r"\$CLEANUP_TRIGGER_TOKEN is empty"):
        CleanupActivity("http://127.0.0.1:8080")

    monkeypatch.setenv("CLEANUP_TRIGGER_TOKEN", TOKEN)
    with pytest.raises(ValueError, match=r"\$VIEWER is empty"):
        CleanupActivity("http://127.0.0.1:8080", read_token_env="VIEWER")


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"service_url": "127.0.0.1:8080"}, "service_url"),
    ({"service_url": "ftp://host"}, "service_url"),
    ({"poll_s": 0}, "poll_s"),
    ({"poll_s": 61}, "poll_s"),
    ({"poll_s": 2.5}, "poll_s"),
    ({"request_timeout_s": 0}, "request_timeout_s"),
    ({"token_env": ""}, "token_env"),
])
def test_bad_configuration_names_its_field(kwargs: dict[str, object], field: str) -> None:
    args = {"service_url": "http://127.0.0.1:8080", **kwargs}
    with pytest.raises(ValueError, match=field) as err:
        CleanupActivity(**args)  # type: ignore[arg-type]
    assert TOKEN not in str(err.value)


def test_a_slot_is_sent_as_an_instant_with_its_offset() -> None:
    assert _slot("2026-12-07T03:00:00+01:00") == "2026-12-07T03:00:00+01:00"
    assert _slot("2026-12-07T02:00:00Z") == "2026-12-07T02:00:00+00:00"


@pytest.mark.parametrize(("slot", "why"), [
    ("2026-12-07T02:00:00", "needs a UTC offset"),
    ("next monday", "not an ISO 8601 instant"),
    (1796954400, "must be an ISO 8601 string"),
])
def test_a_bad_slot_is_refused_for_good(slot: object, why: str) -> None:
    with pytest.raises(ApplicationError, match=why) as err:
        _slot(slot)  # type: ignore[arg-type]
    assert err.value.type == REFUSED
    assert err.value.non_retryable
