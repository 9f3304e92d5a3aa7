"""The [status] section: an optional read-only token, and its checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from supervisor import config
from supervisor.authsettings import StatusConfig
from supervisor.configtypes import Secret
from supervisor.errors import ConfigError

TOKEN_ENV = {"CLEANUP_TRIGGER_TOKEN": "trigger-secret-0123456789abcdef0123"}


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
    assert cfg.status == dataclasses.replace(StatusConfig(), secure_cookie=False)
    assert cfg.status.enabled
    assert cfg.status.token is None
    assert not cfg.status.secure_cookie  # on loopback: the demo works over plain http


def test_the_read_only_token_comes_from_its_variable_or_file(tmp_path: Path) -> None:
    cfg = config.load(None, environ={**TOKEN_ENV, "CLEANUP_STATUS_TOKEN": "viewer" * 6})
    assert cfg.status.token == Secret("viewer" * 6)
    secret = tmp_path / "viewer"
    secret.write_text("from-file-0123456789abcdef0123456789\n", encoding="utf-8")
    cfg = config.load(None, environ={**TOKEN_ENV, "CLEANUP_STATUS_TOKEN_FILE": str(secret)})
    assert cfg.status.token == Secret("from-file-0123456789abcdef0123456789")
    path = tmp_path / "c.toml"
    path.write_text('[status]\ntoken_env = "ONCALL_TOKEN"\n', encoding="utf-8")
    cfg = config.load(path, environ={**TOKEN_ENV, "ONCALL_TOKEN": "o" * 32})
    assert cfg.status.token == Secret("o" * 32)


def test_an_empty_read_only_token_is_a_problem() -> None:
    assert problems({**TOKEN_ENV, "CLEANUP_STATUS_TOKEN": " "}) == [
        "status.token_env: $CLEANUP_STATUS_TOKEN is empty"]


def test_the_read_only_token_must_not_be_the_trigger_token() -> None:
    found = problems({**TOKEN_ENV, "CLEANUP_STATUS_TOKEN": "trigger-secret-0123456789abcdef0123"})
    assert found == ["status.token_env: $CLEANUP_STATUS_TOKEN holds the trigger token; the "
                     "read-only token must differ from it"]
    assert not any("trigger-secret-0123456789abcdef0123" in p for p in found)


def test_a_token_in_the_file_is_refused(tmp_path: Path) -> None:
    found = problems(TOKEN_ENV, '[status]\ntoken = "x"\n', tmp_path)
    assert any(p.startswith("status.token is not a known key (secrets come from") for p in found)


@pytest.mark.parametrize(("text", "fragment"), [
    ("session_seconds = 0", "status.session_seconds must be > 0"),
    ("login_failures_per_minute = 10", "status.login_failures_per_minute is now "
                                       "service.auth_failures_per_minute"),
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


# -- tokens and safe defaults (supervisor/authsettings.py) ----------------------------------

LONG = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(("var", "key"), [
    ("CLEANUP_TRIGGER_TOKEN", "trigger.token_env"),
    ("CLEANUP_TICK_TOKEN", "trigger.tick_token_env"),
    ("CLEANUP_STATUS_TOKEN", "status.token_env"),
    ("CLEANUP_METRICS_TOKEN", "service.metrics_token_env"),
])
def test_a_token_under_32_bytes_is_a_problem_naming_its_key(var: str, key: str) -> None:
    short = "s" * 31
    found = problems({**TOKEN_ENV, var: short})
    assert found == [f"{key}: ${var} holds 31 bytes; a token must be at least 32 bytes "
                     "(e.g. openssl rand -hex 32)"]
    assert not any(short in p for p in found)
    config.load(None, environ={**TOKEN_ENV, var: "s" * 32})  # 32 is enough


def test_every_token_must_differ_from_the_others() -> None:
    found = problems({**TOKEN_ENV, "CLEANUP_TICK_TOKEN": LONG, "CLEANUP_METRICS_TOKEN": LONG})
    assert found == ["service.metrics_token_env: $CLEANUP_METRICS_TOKEN holds the tick token; "
                     "the metrics token must differ from it"]
    found = problems({**TOKEN_ENV, "CLEANUP_TICK_TOKEN": TOKEN_ENV["CLEANUP_TRIGGER_TOKEN"]})
    assert found == ["trigger.tick_token_env: $CLEANUP_TICK_TOKEN holds the trigger token; "
                     "the tick token must differ from it"]


def test_the_tick_and_metrics_tokens_are_optional_and_never_from_the_file(
        tmp_path: Path) -> None:
    cfg = config.load(None, environ=TOKEN_ENV)
    assert cfg.trigger.tick_token is None
    assert cfg.service.metrics_token is None
    cfg = config.load(None, environ={**TOKEN_ENV, "CLEANUP_TICK_TOKEN": LONG})
    assert cfg.trigger.tick_token == Secret(LONG)
    found = problems(TOKEN_ENV, f'[trigger]\ntick_token = "{LONG}"\n', tmp_path)
    assert any(p.startswith("trigger.tick_token is not a known key") for p in found)
    found = problems({**TOKEN_ENV, "CLEANUP__SERVICE__METRICS_TOKEN": LONG})
    assert any("secrets are set through *token_env" in p for p in found)


def test_off_loopback_cookies_are_secure_and_hsts_is_on() -> None:
    for listen, secure, hsts in (("127.0.0.1:8080", False, 0), ("[::1]:8080", False, 0),
                                 ("localhost:8080", False, 0),
                                 ("0.0.0.0:8080", True, 31536000),
                                 ("10.1.2.3:8080", True, 31536000)):
        cfg = config.load(None, environ={**TOKEN_ENV, "CLEANUP__SERVICE__LISTEN": listen})
        assert (cfg.status.secure_cookie, cfg.service.hsts_seconds) == (secure, hsts), listen
    cfg = config.load(None, environ={**TOKEN_ENV, "CLEANUP__SERVICE__LISTEN": "0.0.0.0:8080",
                                     "CLEANUP__STATUS__SECURE_COOKIE": "false",
                                     "CLEANUP__SERVICE__HSTS_SECONDS": "0"})
    assert (cfg.status.secure_cookie, cfg.service.hsts_seconds) == (False, 0)


def test_the_host_allow_list_defaults_by_where_the_service_listens() -> None:
    cfg = config.load(None, environ={
        **TOKEN_ENV, "CLEANUP__STATUS__ORIGIN": "https://Cleanup.Example.com:8443",
        "CLEANUP__INFRAI__TRIGGER_URL": "https://hooks.example.com/v1/runs"})
    assert cfg.service.allowed_hosts == ("localhost", "cleanup.example.com",
                                         "hooks.example.com")
    cfg = config.load(None, environ={**TOKEN_ENV, "CLEANUP__SERVICE__LISTEN": "0.0.0.0:8080"})
    assert cfg.service.allowed_hosts == ("*",)
    cfg = config.load(None, environ={**TOKEN_ENV, "CLEANUP__SERVICE__LISTEN": "0.0.0.0:8080",
                                     "CLEANUP__SERVICE__ALLOWED_HOSTS": '["a.example"]'})
    assert cfg.service.allowed_hosts == ("a.example",)


@pytest.mark.parametrize(("text", "fragment"), [
    ('trusted_proxies = ["10.0.0.0/8", "not-an-ip"]',
     "service.trusted_proxies[1] must be an IP address or CIDR, got 'not-an-ip'"),
    ('trusted_proxies = "10.0.0.0/8"', "service.trusted_proxies must be a list of strings"),
    ('allowed_hosts = ["cleanup.example.com:8080"]', "service.allowed_hosts[0] must be a host"),
    ("auth_failures_per_minute = 0", "service.auth_failures_per_minute must be > 0"),
    ("auth_failures_per_minute_total = 0", "service.auth_failures_per_minute_total must be > 0"),
    ("hsts_seconds = -1", "service.hsts_seconds must be >= 0"),
])
def test_access_keys_are_checked_with_their_key(tmp_path: Path, text: str, fragment: str
                                                ) -> None:
    found = problems(TOKEN_ENV, f"[service]\n{text}\n", tmp_path)
    assert any(fragment in p for p in found), found
