"""Configuration: defaults, one-pass validation naming every key, env overrides, secrets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from supervisor import config
from supervisor.config import Config
from supervisor.configtypes import Secret
from supervisor.errors import EXIT_USAGE, ConfigError

TOKEN_ENV = {"CLEANUP_TRIGGER_TOKEN": "trigger-secret-0123456789abcdef0123"}
REPO_ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(path: Path | None, environ: dict[str, str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config.load(path, environ=environ)
    assert info.value.exit_code == EXIT_USAGE
    return info.value.problems


# -- defaults ------------------------------------------------------------------------


def test_defaults_load_without_a_file() -> None:
    cfg = config.load(None, environ=TOKEN_ENV)
    # On loopback the safe defaults decided at load: a Host allow-list, no HSTS, a cookie
    # that travels over plain http.
    service = dataclasses.replace(Config().service, allowed_hosts=("localhost",),
                                  hsts_seconds=0)
    status = dataclasses.replace(Config().status, secure_cookie=False)
    assert cfg == dataclasses.replace(Config(), trigger=cfg.trigger, service=service,
                                      status=status)
    assert cfg.limits.rate_per_second == 20.0
    assert cfg.limits.burst == 1.25
    assert cfg.service.host == "127.0.0.1"
    assert cfg.service.port == 8080
    assert cfg.ledger_path == Path("./var") / "cleanup.sqlite3"
    assert cfg.trigger.token == Secret("trigger-secret-0123456789abcdef0123")
    assert cfg.partner.token is None  # optional: some partners need none


def test_the_shipped_default_file_loads() -> None:
    cfg = config.load(REPO_ROOT / "config" / "default.toml", environ=TOKEN_ENV)
    assert cfg.source.kind == "http"
    assert cfg.limits.rate_per_second == 100.0


def test_an_empty_file_is_all_defaults(tmp_path: Path) -> None:
    assert config.load(write(tmp_path, ""), environ=TOKEN_ENV) == config.load(None, TOKEN_ENV)


def test_integers_are_accepted_for_float_keys(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, "[limits]\nrate_per_second = 7\n"), environ=TOKEN_ENV)
    assert cfg.limits.rate_per_second == 7.0
    assert isinstance(cfg.limits.rate_per_second, float)


def test_config_is_frozen() -> None:
    cfg = config.load(None, environ=TOKEN_ENV)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.limits.rate_per_second = 1.0  # type: ignore[misc]


# -- every problem at once, each with its key -----------------------------------------------


def test_every_problem_is_reported_at_once_with_its_key(tmp_path: Path) -> None:
    path = write(tmp_path, """
[service]
listen = "nowhere"
shutdown_grace_seconds = 0

[schedule]
cron = "not a cron"
timezone = "Mars/Olympus"
overlap = "sometimes"

[limits]
rate_per_second = -1
concurrency = "eight"
colour = "blue"

[partner]
base_url = "ftp://partner"
delete_path = "/recipients"
idempotency_keys = "yes"

[queue]
lease_seconds = 0

[bogus]
x = 1
""")
    problems = problems_of(path, {})
    text = "\n".join(problems)
    expected = [
        "service.listen must be HOST:PORT, got 'nowhere'",
        "service.shutdown_grace_seconds must be > 0, got 0",
        "schedule.cron is not a valid cron expression, got 'not a cron'",
        "schedule.overlap must be one of 'skip', 'allow', got 'sometimes'",
        "limits.concurrency must be an integer, got 'eight'",
        "limits.colour is not a known key",
        "partner.idempotency_keys must be true or false, got 'yes'",
        "queue.lease_seconds must be > 0, got 0.0",
        "unknown section [bogus]",
        "trigger.token_env: $CLEANUP_TRIGGER_TOKEN",
    ]
    for fragment in expected:
        assert fragment in text, fragment
    # Value problems of a section are reported even when another key in it is mistyped
    # (the operator fixes everything in one edit, not one problem per restart).
    assert "limits.rate_per_second must be > 0, got -1" in text


def test_value_problems_of_a_well_typed_section(tmp_path: Path) -> None:
    path = write(tmp_path, """
[schedule]
cron = "61 * * * *"
timezone = "Mars/Olympus"

[limits]
rate_per_second = -1
decrease_factor = 1.5
floor_per_second = 0

[partner]
base_url = "ftp://partner"
delete_path = "/recipients"
probe_path = "/probe"
""")
    text = "\n".join(problems_of(path, TOKEN_ENV))
    for fragment in [
        "schedule.cron is not a valid cron expression, got '61 * * * *'",
        "schedule.timezone is not a known time zone, got 'Mars/Olympus'",
        "limits.rate_per_second must be > 0, got -1.0",
        "limits.decrease_factor must be > 0 and < 1, got 1.5",
        "limits.floor_per_second must be > 0, got 0.0",
        "partner.base_url must be an http(s) URL, got 'ftp://partner'",
        "partner.delete_path must contain {recipient_id}, got '/recipients'",
        "partner.probe_path must contain {recipient_id}, got '/probe'",
    ]:
        assert fragment in text, fragment


@pytest.mark.parametrize(("toml", "fragment"), [
    ('[limits]\nrate_per_second = "fast"', "limits.rate_per_second must be a number, got 'fast'"),
    ("[limits]\nrate_per_second = true", "limits.rate_per_second must be a number, got True"),
    ("[limits]\nconcurrency = 2.5", "limits.concurrency must be an integer, got 2.5"),
    ("[limits]\nconcurrency = true", "limits.concurrency must be an integer, got True"),
    ("[service]\nlisten = 8080", "service.listen must be a string, got 8080"),
    ("[service]\ndata_dir = 3", "service.data_dir must be a path string, got 3"),
    ('[service]\nlog_level = "loud"', "service.log_level must be one of"),
    ("[partner]\nidempotency_keys = 1", "partner.idempotency_keys must be true or false, got 1"),
    ("limits = 3", "limits must be a table ([limits]), got int"),
    ("[nope]", "unknown section [nope]"),
    ("[limits]\nrate = 3", "limits.rate is not a known key"),
    ('[source]\nkind = "file"', "source.path is required when source.kind = 'file'"),
    ('[source]\nkind = "http"', "source.url is required when source.kind = 'http'"),
    ('[source]\nkind = "http"\nurl = "file:///etc/passwd"', "source.url must be an http(s) URL"),
    ("[source]\nmax_page_retries = -1", "source.max_page_retries must be >= 0, got -1"),
    # Every grant takes one whole token: a bucket that cannot hold one never grants.
    ("[limits]\nburst = 0.5", "limits.burst must be >= 1, got 0.5"),
    ("[limits]\nburst = 0", "limits.burst must be >= 1, got 0.0"),
    ("[limits]\nrate_per_second = 1\nfloor_per_second = 2",
     "limits.floor_per_second must be <= limits.rate_per_second, got 2.0 > 1.0"),
    ("[limits]\nheadroom = 0.7", "limits.headroom must be >= 0 and < 0.5, got 0.7"),
    ("[limits]\nquota = 5", "limits.quota must be an array of tables ([[limits.quota]])"),
    ("[[limits.quota]]\nlimit = 0\nperiod_seconds = 60", "limits.quota[0].limit must be > 0"),
    ("[[limits.quota]]\nlimit = 10", "limits.quota[0].period_seconds must be > 0"),
    ("[[limits.quota]]\nlimit = 10\nperiod_seconds = 60\nwindow = 3",
     "limits.quota[0].window is not a known key"),
    ('[[limits.quota]]\nlimit = "many"\nperiod_seconds = 60',
     "limits.quota[0].limit must be an integer, got 'many'"),
    ("[[limits.quota]]\nlimit = 1\nperiod_seconds = 60\n"
     "[[limits.quota]]\nlimit = 2\nperiod_seconds = 60",
     "limits.quota[1].name '60s' is used twice"),
    # One rule for schedule names (L10): what the trigger and exclusions accept.
    ('[schedule]\nname = "weekly digest"', "schedule.name must be 1 to 100 visible ASCII"),
    ('[schedule]\nname = "w\u00f6chentlich"', "schedule.name must be 1 to 100 visible ASCII"),
    ('[schedule]\nname = "a#b"', "schedule.name must be 1 to 100 visible ASCII"),
    # The caps on reads held open (M7).
    ("[api]\nmax_long_polls = 0", "api.max_long_polls must be > 0, got 0"),
    ("[api]\nmax_long_polls = 10\nmax_long_polls_per_token = 11",
     "api.max_long_polls_per_token must be <= api.max_long_polls, got 11 > 10"),
    ("[api]\nmax_exclusion_reads_per_token = 33",
     "api.max_exclusion_reads_per_token must be <= api.max_exclusion_reads, got 33 > 32"),
    ("[api]\nmax_exclusion_reads = 2.5", "api.max_exclusion_reads must be an integer"),
    # Matched whole (L7): a trailing newline is not part of an SQL identifier.
    ('[ledger]\nschema = "cleanup\\n"', "ledger.schema must be a lower-case SQL identifier"),
])
def test_single_problem(tmp_path: Path, toml: str, fragment: str) -> None:
    problems = problems_of(write(tmp_path, toml + "\n"), TOKEN_ENV)
    assert any(fragment in p for p in problems), problems


@pytest.mark.parametrize("listen", ["nowhere", ":8080", "host:", "host:http", "host:70000",
                                    "host:-1"])
def test_bad_listen(tmp_path: Path, listen: str) -> None:
    problems = problems_of(write(tmp_path, f'[service]\nlisten = "{listen}"\n'), TOKEN_ENV)
    assert problems == [f"service.listen must be HOST:PORT, got {listen!r}"]


@pytest.mark.parametrize(("listen", "host", "port"), [
    ("0.0.0.0:0", "0.0.0.0", 0), ("[::1]:9000", "::1", 9000), ("localhost:65535", "localhost", 65535),
])
def test_good_listen(tmp_path: Path, listen: str, host: str, port: int) -> None:
    cfg = config.load(write(tmp_path, f'[service]\nlisten = "{listen}"\n'), environ=TOKEN_ENV)
    assert (cfg.service.host, cfg.service.port) == (host, port)


def test_a_missing_file_is_one_clear_problem(tmp_path: Path) -> None:
    problems = problems_of(tmp_path / "absent.toml", TOKEN_ENV)
    assert problems == [f"config file {tmp_path / 'absent.toml'} does not exist"]


def test_invalid_toml_is_one_clear_problem(tmp_path: Path) -> None:
    problems = problems_of(write(tmp_path, "[limits\n"), TOKEN_ENV)
    assert len(problems) == 1
    assert "is not valid TOML" in problems[0]


# -- environment overrides --------------------------------------------------------------


def test_env_overrides_file_values(tmp_path: Path) -> None:
    path = write(tmp_path, "[limits]\nrate_per_second = 10\nconcurrency = 2\n")
    cfg = config.load(path, environ={**TOKEN_ENV,
                                     "CLEANUP__LIMITS__RATE_PER_SECOND": "50",
                                     "CLEANUP__SERVICE__LISTEN": "0.0.0.0:9090",
                                     "CLEANUP__PARTNER__IDEMPOTENCY_KEYS": "false",
                                     "CLEANUP__SERVICE__DATA_DIR": "/srv/cleanup"})
    assert cfg.limits.rate_per_second == 50.0
    assert cfg.limits.concurrency == 2  # untouched file value
    assert cfg.service.listen == "0.0.0.0:9090"
    assert cfg.partner.idempotency_keys is False
    assert cfg.service.data_dir == Path("/srv/cleanup")


def test_env_override_values_are_validated_with_their_key() -> None:
    problems = problems_of(None, {**TOKEN_ENV, "CLEANUP__LIMITS__RATE_PER_SECOND": "-1",
                                  "CLEANUP__LIMITS__CONCURRENCY": "many"})
    assert "limits.rate_per_second must be > 0, got -1" in "\n".join(problems)
    assert "limits.concurrency must be an integer, got 'many'" in "\n".join(problems)


@pytest.mark.parametrize(("var", "fragment"), [
    ("CLEANUP__LIMITS", "must look like CLEANUP__SECTION__KEY"),
    ("CLEANUP__LIMITS__RATE__X", "must look like CLEANUP__SECTION__KEY"),
    ("CLEANUP____RATE", "must look like CLEANUP__SECTION__KEY"),
    ("CLEANUP__NOPE__X", "unknown section [nope]"),
    ("CLEANUP__LIMITS__NOPE", "limits.nope is not a known key"),
    ("CLEANUP__TRIGGER__TOKEN", "secrets are set through *token_env"),
])
def test_bad_env_overrides(var: str, fragment: str) -> None:
    problems = problems_of(None, {**TOKEN_ENV, var: "1"})
    assert any(fragment in p for p in problems), problems


def test_unrelated_env_is_ignored() -> None:
    cfg = config.load(None, environ={**TOKEN_ENV, "CLEANUPX": "1", "PATH": "/bin",
                                     "cleanup__limits__rate_per_second": "3"})
    assert cfg.limits.rate_per_second == 20.0


# -- secrets -------------------------------------------------------------------------------


def test_secret_from_env_named_by_token_env(tmp_path: Path) -> None:
    path = write(tmp_path, '[partner]\ntoken_env = "MY_PARTNER"\n')
    cfg = config.load(path, environ={**TOKEN_ENV, "MY_PARTNER": "  p-token \n"})
    assert cfg.partner.token is not None
    assert cfg.partner.token.reveal() == "p-token"


def test_secret_from_file(tmp_path: Path) -> None:
    secret_file = tmp_path / "token"
    secret_file.write_text("from-file-0123456789abcdef0123456789\n", encoding="utf-8")
    cfg = config.load(None, environ={"CLEANUP_TRIGGER_TOKEN_FILE": str(secret_file)})
    assert cfg.trigger.token is not None
    assert cfg.trigger.token.reveal() == "from-file-0123456789abcdef0123456789"


def test_env_wins_over_file_for_a_secret(tmp_path: Path) -> None:
    secret_file = tmp_path / "token"
    secret_file.write_text("from-file-0123456789abcdef0123456789", encoding="utf-8")
    cfg = config.load(None, environ={"CLEANUP_TRIGGER_TOKEN": "from-env-0123456789abcdef0123456789",
                                     "CLEANUP_TRIGGER_TOKEN_FILE": str(secret_file)})
    assert cfg.trigger.token == Secret("from-env-0123456789abcdef0123456789")


def test_unreadable_or_empty_secret_file_is_a_problem(tmp_path: Path) -> None:
    problems = problems_of(None, {"CLEANUP_TRIGGER_TOKEN_FILE": str(tmp_path / "missing")})
    assert problems
    assert problems[0].startswith(
        "trigger.token_env: $CLEANUP_TRIGGER_TOKEN_FILE cannot be read")
    empty = tmp_path / "empty"
    empty.write_text("\n", encoding="utf-8")
    assert problems_of(None, {"CLEANUP_TRIGGER_TOKEN_FILE": str(empty)}) == [
        "trigger.token_env: $CLEANUP_TRIGGER_TOKEN_FILE is empty"]
    assert problems_of(None, {"CLEANUP_TRIGGER_TOKEN": "  "}) == [
        "trigger.token_env: $CLEANUP_TRIGGER_TOKEN is empty"]


@pytest.mark.parametrize("section", ["trigger", "partner", "source"])
def test_a_token_key_in_the_file_is_rejected(tmp_path: Path, section: str) -> None:
    problems = problems_of(write(tmp_path, f'[{section}]\ntoken = "in-the-file"\n'), TOKEN_ENV)
    assert any(p.startswith(f"{section}.token is not a known key (secrets come from the "
                            "environment") for p in problems), problems
    assert not any("in-the-file" in p for p in problems)


def test_missing_trigger_token_is_a_problem() -> None:
    problems = problems_of(None, {})
    assert len(problems) == 1
    assert problems[0].startswith("trigger.token_env: $CLEANUP_TRIGGER_TOKEN (or "
                                  "$CLEANUP_TRIGGER_TOKEN_FILE) is not set")


def test_trigger_token_env_can_be_renamed(tmp_path: Path) -> None:
    path = write(tmp_path, '[trigger]\ntoken_env = "CRON_TOKEN"\n')
    assert problems_of(path, TOKEN_ENV)[0].startswith("trigger.token_env: $CRON_TOKEN")
    cfg = config.load(path, environ={"CRON_TOKEN": "c" * 32})
    assert cfg.trigger.token == Secret("c" * 32)


def test_secret_never_shows_its_value() -> None:
    secret = Secret("hunter2-hunter2-hunter2-hunter2-h")
    assert "hunter2-hunter2-hunter2-hunter2-h" not in repr(secret)
    assert "hunter2-hunter2-hunter2-hunter2-h" not in str(secret)
    assert "hunter2-hunter2-hunter2-hunter2-h" not in f"{secret}"
    assert secret.reveal() == "hunter2-hunter2-hunter2-hunter2-h"
    assert secret == Secret("hunter2-hunter2-hunter2-hunter2-h")
    assert secret != Secret("other")
    assert secret != "hunter2-hunter2-hunter2-hunter2-h"
    cfg = config.load(None, environ={"CLEANUP_TRIGGER_TOKEN": "hunter2-hunter2-hunter2-hunter2-h",
                                     "CUSTOMER_API_TOKEN": "hunter3"})
    assert "hunter2-hunter2-hunter2-hunter2-h" not in repr(cfg)
    assert "hunter3" not in repr(cfg)


def test_problems_never_contain_a_secret(tmp_path: Path) -> None:
    path = write(tmp_path, '[limits]\nrate_per_second = -1\n')
    problems = problems_of(path, {"CLEANUP_TRIGGER_TOKEN": "hunter2-hunter2-hunter2-hunter2-h"})
    assert not any("hunter2-hunter2-hunter2-hunter2-h" in p for p in problems)
    with pytest.raises(ConfigError) as info:
        config.load(path, environ={"CLEANUP_TRIGGER_TOKEN": "hunter2-hunter2-hunter2-hunter2-h"})
    assert "hunter2-hunter2-hunter2-hunter2-h" not in str(info.value)


def test_a_check_naming_a_mistyped_key_is_not_reported_against_its_default(tmp_path: Path) -> None:
    # rate_per_second is mistyped: judging floor_per_second against the default rate
    # would blame the wrong number.
    path = write(tmp_path, '[limits]\nrate_per_second = "x"\nfloor_per_second = 30\n'
                           "concurrency = 0\n")
    assert problems_of(path, TOKEN_ENV) == [
        "limits.rate_per_second must be a number, got 'x'",
        "limits.concurrency must be > 0, got 0",
    ]


def test_digest_cutoff_must_be_positive(tmp_path: Path) -> None:
    path = write(tmp_path, "[schedule]\ndigest_cutoff_seconds = 0\n")
    assert problems_of(path, TOKEN_ENV) == ["schedule.digest_cutoff_seconds must be > 0, got 0.0"]
    ok = config.load(write(tmp_path, "[schedule]\ndigest_cutoff_seconds = 3600\n"), TOKEN_ENV)
    assert ok.schedule.digest_cutoff_seconds == 3600.0


def test_env_text_for_a_text_key_is_taken_as_text() -> None:
    """An environment variable is text: a schedule named 2024 is a name, not a number."""
    cfg = config.load(None, environ={**TOKEN_ENV,
                                     "CLEANUP__SCHEDULE__NAME": "2024",
                                     "CLEANUP__SOURCE__ID_FIELD": "nan",
                                     "CLEANUP__SOURCE__ITEMS_FIELD": "1979-05-27",
                                     "CLEANUP__SERVICE__DATA_DIR": "42",
                                     "CLEANUP__SOURCE__NEXT_CURSOR_FIELD": '"quoted"'})
    assert cfg.schedule.name == "2024"
    assert cfg.source.id_field == "nan"
    assert cfg.source.items_field == "1979-05-27"
    assert cfg.service.data_dir == Path("42")
    assert cfg.source.next_cursor_field == "quoted"  # a TOML string still works
    # Typed keys still parse their text.
    typed = config.load(None, environ={**TOKEN_ENV, "CLEANUP__LIMITS__CONCURRENCY": "3",
                                       "CLEANUP__SCHEDULE__DIGEST_CUTOFF_SECONDS": "60"})
    assert typed.limits.concurrency == 3
    assert typed.schedule.digest_cutoff_seconds == 60.0


def test_quotas_load_as_typed_entries_and_from_the_environment(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, (
        '[[limits.quota]]\nname = "day"\nlimit = 50000\nperiod_seconds = 86400\n'
        "[[limits.quota]]\nlimit = 3000\nperiod_seconds = 3600\n")), environ=TOKEN_ENV)
    assert [(q.name, q.limit, q.period_seconds) for q in cfg.limits.quotas] == [
        ("day", 50000, 86400.0), ("3600s", 3000, 3600.0)]
    env = {**TOKEN_ENV, "CLEANUP__LIMITS__QUOTA": "[{limit = 5, period_seconds = 2}]"}
    assert config.load(None, environ=env).limits.quotas[0].limit == 5


# -- the Infrai queue ------------------------------------------------------------------


def test_infrai_needs_its_project_key(tmp_path: Path) -> None:
    path = write(tmp_path, '[queue]\nbackend = "infrai"\n')
    problems = problems_of(path, TOKEN_ENV)
    assert problems == ["infrai.token_env: $INFRAI_API_KEY (or $INFRAI_API_KEY_FILE) is not "
                        "set; queue.backend = 'infrai' needs the project key"]
    # The embedded queue does not need one.
    assert config.load(None, environ=TOKEN_ENV).infrai.token is None


def test_infrai_key_from_a_file_and_defaults(tmp_path: Path) -> None:
    key = tmp_path / "infrai_key"
    key.write_text("ifr_secret\n", encoding="utf-8")
    path = write(tmp_path, '[queue]\nbackend = "infrai"\n[infrai]\nqueue = "weekly-ops"\n')
    cfg = config.load(path, environ={**TOKEN_ENV, "INFRAI_API_KEY_FILE": str(key)})
    assert cfg.infrai.token == Secret("ifr_secret")
    assert "ifr_secret" not in repr(cfg)
    assert cfg.infrai.dlq == "weekly-ops-dlq"  # unset: <queue>-dlq
    assert not cfg.infrai.nack_path
    assert not cfg.infrai.extend_path


def test_infrai_keys_are_checked(tmp_path: Path) -> None:
    path = write(tmp_path, '[queue]\nbackend = "kafka"\n[infrai]\nbase_url = "ftp://x"\n'
                 'nack_path = "v1/queue/nack"\nmax_batch = 0\nredrive_path = "/v1/redrive"\n')
    problems = problems_of(path, {**TOKEN_ENV, "INFRAI_API_KEY": "k"})
    assert ("queue.backend must be one of 'sqlite', 'infrai', 'postgres', 'redis', 'rabbitmq', "
            "got 'kafka'") in problems
    assert "infrai.base_url must be an http(s) URL, got 'ftp://x'" in problems
    assert "infrai.nack_path must start with '/', got 'v1/queue/nack'" in problems
    assert "infrai.max_batch must be > 0, got 0" in problems
    assert "infrai.redrive_path must contain {queue}, got '/v1/redrive'" in problems


# -- [events] and [[events.sink]] ------------------------------------------------------------

EVENTS_TOML = (
    '[infrai]\nqueue = "ops"\n'
    '[[events.sink]]\nname = "audit"\nkind = "infrai"\nqueue = "cleanup-events"\n'
    '[[events.sink]]\nname = "crm"\nkind = "webhook"\nurl = "https://crm.example.com/hook"\n'
    'secret_env = "CRM_SECRET"\nbatch_size = 20\ntimeout_seconds = 5\n'
)


def test_events_default_to_no_sinks() -> None:
    events = config.load(None, environ=TOKEN_ENV).events
    assert events.sink == ()
    assert (events.poll_interval_seconds, events.backoff_initial_seconds,
            events.backoff_max_seconds) == (1.0, 0.5, 60.0)
    assert (events.retain_seconds, events.prune_interval_seconds, events.prune_batch) == \
        (86400.0, 60.0, 1000)


def test_event_sinks_load_as_typed_entries_with_their_secrets(tmp_path: Path) -> None:
    secret_file = tmp_path / "crm_secret"
    secret_file.write_text("whsec_from_file\n", encoding="utf-8")
    env = {**TOKEN_ENV, "INFRAI_API_KEY": "ifr_k", "CRM_SECRET_FILE": str(secret_file),
           "CLEANUP__EVENTS__POLL_INTERVAL_SECONDS": "0.25"}
    cfg = config.load(write(tmp_path, EVENTS_TOML), environ=env)
    audit, crm = cfg.events.sink
    assert (audit.name, audit.kind, audit.queue, audit.batch_size, audit.secret) == \
        ("audit", "infrai", "cleanup-events", 100, None)
    assert (crm.name, crm.kind, crm.url, crm.batch_size, crm.timeout_seconds, crm.signed) == \
        ("crm", "webhook", "https://crm.example.com/hook", 20, 5.0, "timestamp_body")
    assert crm.secret == Secret("whsec_from_file")
    assert "whsec_from_file" not in repr(cfg)
    assert cfg.events.poll_interval_seconds == 0.25
    env = {**TOKEN_ENV, "INFRAI_API_KEY": "ifr_k", "CRM_SECRET": "whsec_env"}
    assert config.load(write(tmp_path, EVENTS_TOML), environ=env).events.sink[1].secret == \
        Secret("whsec_env")


def test_event_sinks_are_checked_each_by_its_key(tmp_path: Path) -> None:
    path = write(tmp_path, (
        '[events]\nretain_seconds = -1\nbackoff_initial_seconds = 5\nbackoff_max_seconds = 1\n'
        '[[events.sink]]\nname = "q"\nkind = "infrai"\n'
        '[[events.sink]]\nname = "q"\nkind = "webhook"\nurl = "ftp://x"\n'
        '[[events.sink]]\nname = "bad name"\nkind = "kafka"\n'
        '[[events.sink]]\nname = "w"\nkind = "webhook"\nbatch_size = 501\n'
        '[[events.sink]]\nname = "x"\nkind = "webhook"\nurl = "https://x/"\n'
        'secret_env = "X_SECRET"\n'))
    problems = problems_of(path, TOKEN_ENV)
    assert problems == [
        "events.retain_seconds must be >= 0, got -1.0",
        "events.backoff_max_seconds must be >= events.backoff_initial_seconds, got 1.0 < 5.0",
        "events.sink[0].queue is required when kind = 'infrai'",
        "events.sink[1].url must be an http(s) URL, got 'ftp://x'",
        "events.sink[1].secret_env is required when kind = 'webhook': every delivery is signed",
        "events.sink[1].name 'q' is used twice",
        "events.sink[2].name must be 1 to 64 letters, digits, '_', '.' or '-' (starting with "
        "a letter or digit), got 'bad name'",
        "events.sink[2].kind must be one of 'infrai', 'webhook', got 'kafka'",
        "events.sink[3].batch_size must be <= 500, got 501",
        "events.sink[3].url is required when kind = 'webhook'",
        "events.sink[3].secret_env is required when kind = 'webhook': every delivery is signed",
        "events.sink[0]: kind = 'infrai' needs the Infrai project key (infrai.token_env: "
        "$INFRAI_API_KEY is not set)",
        "events.sink[4].secret_env: $X_SECRET (or $X_SECRET_FILE) is not set; the webhook "
        "signs with it",
    ]


def test_event_sink_secrets_never_come_from_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[[events.sink]]\nname = "w"\nkind = "webhook"\nurl = "https://x/"\n'
                           'secret_env = "W_SECRET"\nsecret = "in-the-file"\nsigned = "md5"\n')
    assert problems_of(path, {**TOKEN_ENV, "W_SECRET": "s"}) == [
        "events.sink[0].secret is not a known key; events.sink[0].signed must be one of "
        "'timestamp_body', 'body', got 'md5'"]
    path = write(tmp_path, '[[events.sink]]\nname = "w"\nkind = "webhook"\nurl = "https://x/"\n'
                           'secret_env = "W_SECRET"\n')
    assert problems_of(path, {**TOKEN_ENV, "W_SECRET": " "}) == [
        "events.sink[0].secret_env: $W_SECRET is empty"]
    problems = problems_of(path, {**TOKEN_ENV, "CLEANUP__EVENTS__SECRET": "x"})
    assert "environment variable CLEANUP__EVENTS__SECRET: secrets are set through *token_env" \
        in problems
    problems = problems_of(write(tmp_path, '[events]\nsink = 3\n'), TOKEN_ENV)
    assert problems == ["events.sink must be an array of tables ([[events.sink]]), got 3"]


def test_replicas_dead_after_must_outlast_a_request(tmp_path: Path) -> None:
    """A request in the air must be over (by its own timeouts) before its replica can be
    declared dead and its operation sent again by a peer."""
    env = {**TOKEN_ENV, "CLEANUP_DATABASE_URL": "postgresql://u@h/db"}
    base = '[ledger]\nbackend = "postgres"\n[queue]\nbackend = "postgres"\n'
    problems = problems_of(write(tmp_path, '[ledger]\nbackend = "postgres"\n'
                                 'dead_after_seconds = 14\n[queue]\nbackend = "postgres"\n'), env)
    assert problems == [
        "ledger.dead_after_seconds (14) must exceed partner.connect_timeout_seconds + "
        "partner.request_timeout_seconds + ledger.heartbeat_seconds (14): a request must be "
        "over before its replica's peers may declare it dead and send the operation again"]
    # The defaults hold; shorter partner timeouts allow a shorter dead time.
    assert config.load(write(tmp_path, base), environ=env).ledger.dead_after_seconds == 20
    quick = config.load(write(tmp_path, '[ledger]\nbackend = "postgres"\n'
                              'dead_after_seconds = 3\nheartbeat_seconds = 0.5\n'
                              '[queue]\nbackend = "postgres"\n[partner]\n'
                              'connect_timeout_seconds = 0.5\nrequest_timeout_seconds = 1.5\n'),
                        environ=env)
    assert quick.ledger.dead_after_seconds == 3
    # One process (SQLite) has no peers: nothing to outlast.
    assert config.load(write(tmp_path, '[ledger]\ndead_after_seconds = 2\n'),
                       environ=TOKEN_ENV).ledger.dead_after_seconds == 2



def test_accepted_batches_need_a_probe_or_the_named_risk(tmp_path: Path) -> None:
    toml = "[batch]\nshape = 'accepted'\n"
    found = problems_of(write(tmp_path, toml + "[partner]\nprobe_path = ''\n"), TOKEN_ENV)
    assert any("batch.shape = 'accepted'" in p and "partner.probe_path" in p
               for p in found), found
    risked = toml + "settle_accepted_unprobed_risking_silent_misses = true\n" \
        "[partner]\nprobe_path = ''\n"
    assert config.load(write(tmp_path, risked), environ=TOKEN_ENV).batch.shape == "accepted"


def test_two_limits_need_the_ids_limit_and_only_two_limits_read_it(tmp_path: Path) -> None:
    both = "[batch]\nshape = 'per_item'\ncost = 'both'\n"
    found = problems_of(write(tmp_path, both), TOKEN_ENV)
    assert any("batch.items_per_second must be > 0" in p for p in found), found
    stray = "[batch]\nshape = 'per_item'\ncost = 'items'\nitems_per_second = 100\n"
    found = problems_of(write(tmp_path, stray), TOKEN_ENV)
    assert any("batch.items_per_second is read only when batch.cost = 'both'" in p
               for p in found), found
    cfg = config.load(write(tmp_path, both + "items_per_second = 500\n"), environ=TOKEN_ENV)
    assert (cfg.batch.cost, cfg.batch.items_per_second) == ("both", 500.0)
    found = problems_of(write(tmp_path, "[batch]\ncost = 'all'\n"), TOKEN_ENV)
    assert any("batch.cost" in p for p in found), found


def test_verdicts_that_are_not_statuses_are_checked_key_by_key(tmp_path: Path) -> None:
    salesforce = ("[batch]\nshape = 'per_item'\nmethod = 'DELETE'\nids_in = 'query'\n"
                  "results_field = ''\nitem_order = 'position'\nitem_verdict = 'success'\n")
    cfg = config.load(write(tmp_path, salesforce), environ=TOKEN_ENV).batch
    assert (cfg.item_verdict, cfg.item_order, cfg.item_success_field, cfg.item_errors_field,
            cfg.item_error_code_field) == ("success", "position", "success", "errors",
                                           "statusCode")
    assert "ENTITY_IS_DELETED" in cfg.absent_codes
    assert "UNABLE_TO_LOCK_ROW" in cfg.retry_codes
    assert cfg.throttled_codes == ("REQUEST_LIMIT_EXCEEDED",)
    bad = ("[batch]\nshape = 'job'\nitem_verdict = 'success'\nitem_order = 'position'\n"
           "results_field = ''\nitem_success_field = ''\nabsent_codes = ['X', '']\n"
           "retry_codes = ['X']\n")
    found = problems_of(write(tmp_path, bad), TOKEN_ENV)
    for wanted in ("batch.item_success_field must not be empty",
                   "batch.item_order = 'position' is not supported with batch.shape = 'job'",
                   "batch.results_field must name the job status's array of results",
                   "batch.absent_codes holds an empty code",
                   "batch.retry_codes and batch.absent_codes both hold 'X'"):
        assert any(wanted in p for p in found), (wanted, found)
    found = problems_of(write(tmp_path, "[batch]\nitem_verdict = 'bool'\nitem_order = 'index'\n"
                              "throttled_codes = 'REQUEST_LIMIT_EXCEEDED'\n"), TOKEN_ENV)
    for key in ("batch.item_verdict", "batch.item_order", "batch.throttled_codes"):
        assert any(p.startswith(key) for p in found), (key, found)
    # By id, the id field is what matches a result: it cannot be empty.
    found = problems_of(write(tmp_path, "[batch]\nitem_id_field = ''\n"), TOKEN_ENV)
    assert any("batch.item_id_field must not be empty" in p for p in found), found


def test_the_redis_queue_needs_its_url_from_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, '[queue]\nbackend = "redis"\n')
    problems = problems_of(path, TOKEN_ENV)
    assert any(p.startswith("queue.redis_dsn_env:") and "CLEANUP_REDIS_URL" in p
               for p in problems), problems
    cfg = config.load(path, environ={**TOKEN_ENV,
                                     "CLEANUP_REDIS_URL": "redis://:pw-123@10.0.0.5:6379/2"})
    assert cfg.queue.redis_dsn == Secret("redis://:pw-123@10.0.0.5:6379/2")
    assert "pw-123" not in repr(cfg)


def test_redis_keys_are_checked_and_the_password_never_echoed(tmp_path: Path) -> None:
    path = write(tmp_path, '[queue]\nbackend = "redis"\nredis_key = "has space"\n')
    problems = problems_of(path, {**TOKEN_ENV, "CLEANUP_REDIS_URL": "http://u:pw-123@host/0"})
    assert "queue.redis_key must be 1 to 64 letters, digits or _.:{}-, got 'has space'" in problems
    assert any("queue.redis_dsn_env" in p and "got scheme 'http'" in p for p in problems)
    assert not any("pw-123" in p for p in problems), problems
    secret = write(tmp_path, '[queue]\nbackend = "redis"\nredis_dsn = "redis://x"\n')
    assert any("queue.redis_dsn is not a known key" in p
               for p in problems_of(secret, TOKEN_ENV))


def test_the_rabbitmq_queue_is_checked_and_the_password_never_echoed(tmp_path: Path) -> None:
    path = write(tmp_path, '[queue]\nbackend = "rabbitmq"\nrabbitmq_queue = "amq.mine"\n'
                 'lease_seconds = 3600\n')
    assert any(p.startswith("queue.rabbitmq_dsn_env:") and "CLEANUP_RABBITMQ_URL" in p
               for p in problems_of(path, TOKEN_ENV))
    problems = problems_of(path, {**TOKEN_ENV, "CLEANUP_RABBITMQ_URL": "redis://u:pw-77@h/"})
    assert any("queue.rabbitmq_dsn_env" in p and "got scheme 'redis'" in p for p in problems)
    assert any(p.startswith("queue.rabbitmq_queue must be") and "'amq.mine'" in p
               for p in problems), problems
    assert any(p.startswith("queue.lease_seconds (3600) must stay under RabbitMQ's "
                            "consumer_timeout") for p in problems), problems
    assert not any("pw-77" in p for p in problems), problems
    ok = write(tmp_path, '[queue]\nbackend = "rabbitmq"\n')
    cfg = config.load(ok, environ={**TOKEN_ENV,
                                   "CLEANUP_RABBITMQ_URL": "amqp://u:pw-77@h:5672/v"})
    assert cfg.queue.rabbitmq_queue == "cleanup-operations"
    assert "pw-77" not in repr(cfg)
