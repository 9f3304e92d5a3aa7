"""The [status] section: an optional read-only token, and its checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import config
from supervisor.config import Secret, StatusConfig
from supervisor.errors import ConfigError

TOKEN_ENV = {"CLEANUP_TRIGGER_TOKEN": "trigger-secret"}


def problems(environ: dict[str, str], text: str = "", tmp_path: Path | None = None) -> list[str]:
    path = None
    if tmp_path is not None:
        path = tmp_path / "c.toml"
        path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        config.load(path, environ=environ)
    return info.value.problems


def test_the_page_is_on_and_a_missing_read_only_token_is_no_problem() -> None:
    cfg = config.load(None, environ=TOKEN_ENV)
    assert cfg.status == StatusConfig()
    assert cfg.status.enabled
    assert cfg.status.token is None
    assert not cfg.status.secure_cookie


def test_the_read_only_token_comes_from_its_variable_or_file(tmp_path: Path) -> None:
    cfg = config.load(None, environ={**TOKEN_ENV, "CLEANUP_STATUS_TOKEN": "viewer"})
    assert cfg.status.token == Secret("viewer")
    secret = tmp_path / "viewer"
    secret.write_text("from-file\n", encoding="utf-8")
    cfg = config.load(None, environ={**TOKEN_ENV, "CLEANUP_STATUS_TOKEN_FILE": str(secret)})
    assert cfg.status.token == Secret("from-file")
    path = tmp_path / "c.toml"
    path.write_text('[status]\ntoken_env = "ONCALL_TOKEN"\n', encoding="utf-8")
    cfg = config.load(path, environ={**TOKEN_ENV, "ONCALL_TOKEN": "o"})
    assert cfg.status.token == Secret("o")


def test_an_empty_read_only_token_is_a_problem() -> None:
    assert problems({**TOKEN_ENV, "CLEANUP_STATUS_TOKEN": " "}) == [
        "status.token_env: $CLEANUP_STATUS_TOKEN is empty"]


def test_the_read_only_token_must_not_be_the_trigger_token() -> None:
    found = problems({**TOKEN_ENV, "CLEANUP_STATUS_TOKEN": "trigger-secret"})
    assert found == ["status.token_env: $CLEANUP_STATUS_TOKEN holds the trigger token; the "
                     "read-only token must differ from it"]
    assert not any("trigger-secret" in p for p in found)


def test_a_token_in_the_file_is_refused(tmp_path: Path) -> None:
    found = problems(TOKEN_ENV, '[status]\ntoken = "x"\n', tmp_path)
    assert any(p.startswith("status.token is not a known key (secrets come from") for p in found)


@pytest.mark.parametrize(("text", "fragment"), [
    ("session_seconds = 0", "status.session_seconds must be > 0"),
    ("login_failures_per_minute = 0", "status.login_failures_per_minute must be > 0"),
    ('origin = "cleanup.example.com"', "status.origin must be scheme://host[:port]"),
    ('origin = "https://cleanup.example.com/status"', "status.origin must be scheme://host[:port]"),
    ("secure_cookie = 1", "status.secure_cookie must be true or false"),
])
def test_values_are_checked_with_their_key(tmp_path: Path, text: str, fragment: str) -> None:
    found = problems(TOKEN_ENV, f"[status]\n{text}\n", tmp_path)
    assert any(fragment in p for p in found), found


def test_overrides_from_the_environment() -> None:
    cfg = config.load(None, environ={**TOKEN_ENV, "CLEANUP__STATUS__SECURE_COOKIE": "true",
                                     "CLEANUP__STATUS__ORIGIN": "https://c.example:8443"})
    assert cfg.status.secure_cookie is True
    assert cfg.status.origin == "https://c.example:8443"
