"""Typed settings: a TOML file, ``CLEANUP__SECTION__KEY`` environment overrides, secrets.

Configuration is inert data. :func:`load` builds frozen dataclasses in one pass and raises
:class:`~supervisor.errors.ConfigError` listing *every* problem, each naming its key.
Secrets never come from the file: only from the environment variable a ``*token_env`` key
names, or from the file that ``<VAR>_FILE`` points to.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter

from supervisor.api_settings import ApiConfig
from supervisor.authsettings import (
    StatusConfig,
    TriggerConfig,
    resolve_access,
    service_problems,
    token_problems,
)
from supervisor.batchsettings import BatchConfig
from supervisor.budget.settings import LimitsConfig
from supervisor.configtypes import (
    MISSING_SECRET,
    Secret,
    _positive,
    missing_secret,
    read_secret,
)
from supervisor.errors import ConfigError
from supervisor.events.settings import EventsConfig, resolve_sinks
from supervisor.infrai.settings import InfraiConfig, resolve_push_secret
from supervisor.ledger.settings import LedgerConfig
from supervisor.queue.settings import QueueConfig
from supervisor.tickrules import SCHEDULE_RULE, check_schedule

ENV_PREFIX = "CLEANUP__"

# One shape: a section owned by a package lives in that package's settings module
# ([ledger] ledger/, [queue] queue/, [limits] budget/, [infrai] infrai/, [events] events/),
# the HTTP layer's access sections in authsettings.py ([trigger], [status]) and
# api_settings.py ([api]); the sections of the core modules that are no package
# ([service], [schedule], [source], [partner]) live here, beside the loader. Each type is
# imported from where it is defined (tests/unit/test_config_imports.py), never through here.
__all__ = ["Config", "PartnerConfig", "ScheduleConfig", "ServiceConfig", "SourceConfig", "load"]


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    data_dir: Path = Path("./var")
    listen: str = "127.0.0.1:8080"
    shutdown_grace_seconds: float = 20.0
    max_body_bytes: int = 256 * 1024
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # "json": one object per line (a log shipper parses it); "text": key=value after the message.
    log_format: Literal["text", "json"] = "text"
    restart_backoff_seconds: float = 0.5
    restart_backoff_max_seconds: float = 30.0
    max_restarts: int = 5
    restart_window_seconds: float = 60.0
    # Who may call (supervisor/authsettings.py decides the unset defaults at load).
    # Peers whose X-Forwarded-For names the client (CIDRs): a proxy in front.
    trusted_proxies: tuple[str, ...] = ()
    # Host header names answered (IP literals always are); unset: loopback names and the
    # configured origin's host when listening on loopback, any host elsewhere.
    allowed_hosts: tuple[str, ...] = ()
    # Optional Bearer token for /metrics.
    metrics_token_env: str = "CLEANUP_METRICS_TOKEN"
    metrics_token: Secret | None = None
    # Strict-Transport-Security max-age; unset: a year off loopback, none on it; 0: never.
    hsts_seconds: int | None = None
    # Failed authentications (Bearer or login form) a client, and all clients, may make
    # in a minute before 429.
    auth_failures_per_minute: int = 10
    auth_failures_per_minute_total: int = 100

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    def problems(self) -> list[str]:
        out = []
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            out.append(f"service.listen must be HOST:PORT, got {self.listen!r}")
        out += _positive("service", self, "shutdown_grace_seconds", "max_body_bytes",
                         "restart_backoff_seconds", "restart_backoff_max_seconds",
                         "max_restarts", "restart_window_seconds")
        return out + service_problems(self)


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    name: str = "weekly"
    cron: str | None = None
    timezone: str = "UTC"
    # skip: ticks missed while the service was down are dropped; latest: the most recent
    # missed slot runs once at start-up.
    missed: Literal["skip", "latest"] = "skip"
    # skip: a tick while a run is unfinished is skipped and counted; allow: it opens a run.
    overlap: Literal["skip", "allow"] = "skip"
    # embedded: this process fires the cron ticks; external: a clock elsewhere (Infrai cron,
    # a system cron) calls the trigger, and the expression only names the slot each tick
    # stands for, so a late or retried tick opens no second run.
    clock: Literal["embedded", "external"] = "embedded"
    # The drain must end this long after the run's slot (e.g. before the digest is built);
    # exported as cleanup_digest_cutoff_timestamp_seconds so an alert can compare.
    digest_cutoff_seconds: float | None = None

    def problems(self) -> list[str]:
        out = []
        if self.cron is not None and not croniter.is_valid(self.cron):
            out.append(f"schedule.cron is not a valid cron expression, got {self.cron!r}")
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            out.append(f"schedule.timezone is not a known time zone, got {self.timezone!r}")
        if self.clock == "external" and self.cron is None:
            out.append("schedule.clock = 'external' needs schedule.cron: the expression names "
                       "the slot of each incoming tick")
        if self.digest_cutoff_seconds is not None and self.digest_cutoff_seconds <= 0:
            out.append(f"schedule.digest_cutoff_seconds must be > 0, got {self.digest_cutoff_seconds}")
        if check_schedule(self.name) is not None:
            out.append(f"schedule.name must be {SCHEDULE_RULE}, got {self.name!r}")
        return out


@dataclass(frozen=True, slots=True)
class SourceConfig:
    kind: Literal["inline", "file", "http"] = "inline"
    # file source
    path: Path | None = None
    format: Literal["jsonl", "csv"] = "jsonl"
    # http source: GET url?{cursor_param}=..&{limit_param}=.. -> {items_field: [...], next_cursor_field: ...}
    url: str | None = None
    cursor_param: str = "cursor"
    limit_param: str = "limit"
    items_field: str = "items"
    next_cursor_field: str = "next_cursor"
    token_env: str | None = None
    token: Secret | None = None
    timeout_seconds: float = 30.0
    # both: which field of an item holds the recipient ID, and how many per page
    id_field: str = "id"
    page_size: int = 500
    max_page_retries: int = 5

    def problems(self) -> list[str]:
        out = _positive("source", self, "page_size", "timeout_seconds")
        if self.max_page_retries < 0:
            out.append(f"source.max_page_retries must be >= 0, got {self.max_page_retries}")
        if self.kind == "file" and self.path is None:
            out.append("source.path is required when source.kind = 'file'")
        if self.kind == "http":
            if self.url is None:
                out.append("source.url is required when source.kind = 'http'")
            elif urlsplit(self.url).scheme not in ("http", "https"):
                out.append(f"source.url must be an http(s) URL, got {self.url!r}")
        return out


@dataclass(frozen=True, slots=True)
class PartnerConfig:
    base_url: str = "http://127.0.0.1:9000"
    delete_path: str = "/recipients/{recipient_id}"
    # GET this to learn whether a recipient still exists (reconciling ambiguous outcomes);
    # "" disables probing: ambiguous operations then wait for an operator.
    probe_path: str = "/recipients/{recipient_id}"
    # Probe only this long after the ambiguous attempt, so a slow partner has finished.
    probe_settle_seconds: float = 30.0
    probe_interval_seconds: float = 10.0
    # An inconclusive probe (neither present nor absent) puts the next one off: by
    # probe_settle_seconds, then twice as long after each further one, up to this.
    probe_backoff_max_seconds: float = 21600.0
    token_env: str = "CUSTOMER_API_TOKEN"
    token: Secret | None = None
    idempotency_keys: bool = True
    connect_timeout_seconds: float = 3.0
    request_timeout_seconds: float = 10.0
    max_attempts: int = 8
    backoff_initial_seconds: float = 0.5
    backoff_max_seconds: float = 60.0
    # A Retry-After beyond this is clamped: the pause stops here and an alert can fire.
    max_retry_after_seconds: float = 900.0

    @property
    def request_bound_seconds(self) -> float:
        """How long one request can take by its own timeouts: connecting, then answering."""
        return self.connect_timeout_seconds + self.request_timeout_seconds

    def problems(self) -> list[str]:
        out = _positive("partner", self, "connect_timeout_seconds", "request_timeout_seconds",
                        "probe_settle_seconds", "probe_interval_seconds",
                        "probe_backoff_max_seconds",
                        "max_attempts", "backoff_initial_seconds", "backoff_max_seconds",
                        "max_retry_after_seconds")
        if self.probe_backoff_max_seconds < self.probe_settle_seconds:
            out.append(f"partner.probe_backoff_max_seconds must be >= "
                       f"partner.probe_settle_seconds, got {self.probe_backoff_max_seconds:g} "
                       f"< {self.probe_settle_seconds:g}")
        if urlsplit(self.base_url).scheme not in ("http", "https"):
            out.append(f"partner.base_url must be an http(s) URL, got {self.base_url!r}")
        if "{recipient_id}" not in self.delete_path:
            out.append(f"partner.delete_path must contain {{recipient_id}}, got {self.delete_path!r}")
        if self.probe_path and "{recipient_id}" not in self.probe_path:
            out.append(f"partner.probe_path must contain {{recipient_id}}, got {self.probe_path!r}")
        return out


@dataclass(frozen=True, slots=True)
class Config:
    service: ServiceConfig = field(default_factory=ServiceConfig)
    trigger: TriggerConfig = field(default_factory=TriggerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    source: SourceConfig = field(default_factory=SourceConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    infrai: InfraiConfig = field(default_factory=InfraiConfig)
    partner: PartnerConfig = field(default_factory=PartnerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    status: StatusConfig = field(default_factory=StatusConfig)
    api: ApiConfig = field(default_factory=ApiConfig)

    @property
    def ledger_path(self) -> Path:
        return self.service.data_dir / "cleanup.sqlite3"


_SECTIONS: dict[str, type[Any]] = {f.name: f.type for f in dataclasses.fields(Config)}  # type: ignore[misc]
_SECRET_FIELDS = {"token", "tick_token", "metrics_token", "secret", "push_secret", "dsn",
                  "redis_dsn", "rabbitmq_dsn"}



def load(path: Path | None, environ: Mapping[str, str] | None = None,
         require_secrets: bool = True) -> Config:
    """Read ``path`` (or only defaults when None), apply environment overrides, validate.

    Raises ConfigError listing every problem found, each naming its key. With
    ``require_secrets=False`` an unset secret is not a problem (``plan`` reads the
    configuration's numbers; it serves nothing and sends nothing that needs them).
    """
    env = os.environ if environ is None else environ
    problems: list[str] = []
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError([f"config file {path} does not exist"]) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError([f"config file {path} cannot be read: {exc}"]) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([f"config file {path} is not valid TOML: {exc}"]) from None
    problems += _apply_env_overrides(raw, env)

    sections: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in _SECTIONS:
            problems.append(f"unknown section [{name}]; known: {', '.join(_SECTIONS)}")
        elif not isinstance(value, dict):
            problems.append(f"{name} must be a table ([{name}]), got {type(value).__name__}")
    for name in _SECTIONS:
        cls = typing.get_type_hints(Config)[name]
        table = raw.get(name, {})
        built, section_problems, bad_keys = _build(name, cls,
                                                   table if isinstance(table, dict) else {}, env)
        problems += section_problems
        sections[name] = built
        # Value checks run even when another key of the section is mistyped, so one edit
        # fixes everything; a check that names a mistyped key would judge its default.
        problems += [p for p in built.problems()
                     if not any(re.search(rf"\b{re.escape(name)}\.{k}\b", p) for k in bad_keys)]
    sections["events"], more = resolve_sinks(sections["events"], sections["infrai"], env)
    problems += more
    sections["infrai"], more = resolve_push_secret(sections["infrai"], env)
    problems += more
    problems += _across(sections)
    sections["service"], sections["status"] = resolve_access(sections)
    if not require_secrets:
        problems = [p for p in problems if not MISSING_SECRET.search(p)]
    if problems:
        raise ConfigError(problems)
    return Config(**sections)


def _across(sections: Mapping[str, Any]) -> list[str]:
    """Problems that take two sections to see."""
    out = token_problems(sections)
    batch = sections["batch"]
    if batch.shape == "accepted" and not batch.settle_accepted_unprobed_risking_silent_misses \
            and not sections["partner"].probe_path:
        out.append("batch.shape = 'accepted' confirms each id with a probe: set "
                   "partner.probe_path (or batch.settle_accepted_unprobed_risking_silent_"
                   "misses = true)")
    if sections["infrai"].delivery == "push" and sections["queue"].backend != "infrai":
        out.append("infrai.delivery = 'push' needs queue.backend = 'infrai' (Infrai pushes "
                   "the messages published to its queue)")
    infrai_used = sections["queue"].backend == "infrai" or sections["infrai"].tick_queue
    if infrai_used and sections["infrai"].token is None:
        var = sections["infrai"].token_env
        why = "queue.backend = 'infrai'" if sections["queue"].backend == "infrai" \
            else "infrai.tick_queue"
        out.append(missing_secret("infrai.token_env", var, f"{why} needs the project key"))
    if sections["queue"].backend == "postgres" and sections["ledger"].backend != "postgres":
        out.append("queue.backend = 'postgres' needs ledger.backend = 'postgres' (the queue "
                   "is a table in the ledger's database: outcome and ack commit together)")
    if sections["queue"].backend == "sqlite" and sections["ledger"].backend == "postgres":
        out.append("queue.backend = 'sqlite' cannot serve ledger.backend = 'postgres' "
                   "(replicas share no file): set queue.backend = 'postgres' or 'infrai'")
    infrai, partner = sections["infrai"], sections["partner"]
    if sections["queue"].backend == "infrai" and infrai.nack_path and \
            infrai.max_retries < partner.max_attempts:
        # Each retry is a nack: Infrai would dead-letter a message still being retried.
        out.append(f"infrai.max_retries ({infrai.max_retries}) must be >= "
                   f"partner.max_attempts ({partner.max_attempts}) when infrai.nack_path is set")
    out += _replica_timing(sections["ledger"], partner)
    return out


def _replica_timing(ledger: LedgerConfig, partner: PartnerConfig) -> list[str]:
    """A request must be over (by its own timeouts) before the replica sending it could be
    declared dead, its work released and sent again by a peer: no request leaves unless
    the replica's heartbeat is that fresh, and it is up to one period old at any time."""
    if ledger.backend != "postgres":
        return []
    bound = partner.request_bound_seconds + ledger.heartbeat_seconds
    if ledger.dead_after_seconds > bound:
        return []
    return [f"ledger.dead_after_seconds ({ledger.dead_after_seconds:g}) must exceed "
            "partner.connect_timeout_seconds + partner.request_timeout_seconds + "
            f"ledger.heartbeat_seconds ({bound:g}): a request must be over before its "
            "replica's peers may declare it dead and send the operation again"]


def _apply_env_overrides(raw: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    problems = []
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        parts = var[len(ENV_PREFIX):].lower().split("__")
        if len(parts) != 2 or not all(parts):
            problems.append(f"environment variable {var} must look like {ENV_PREFIX}SECTION__KEY")
            continue
        section, key = parts
        if key in _SECRET_FIELDS:
            problems.append(f"environment variable {var}: secrets are set through *token_env")
            continue
        try:
            value: Any = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text  # a bare string such as 0.0.0.0:8080 or a path
        if not isinstance(value, str) and _textual(section, key):
            value = text  # an env var is text: a schedule named 2024 is not a number
        table = raw.setdefault(section, {})
        if isinstance(table, dict):
            table[key] = value
    return problems


def _textual(section: str, key: str) -> bool:
    """Whether ``section.key`` holds text (a string, a path, or one of several strings)."""
    cls = typing.get_type_hints(Config).get(section)
    hint = typing.get_type_hints(cls).get(key) if cls is not None else None
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        hint = next((a for a in typing.get_args(hint) if a is not type(None)), None)
    if typing.get_origin(hint) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(hint))
    return hint in (str, Path)


def _build(section: str, cls: type[Any], table: dict[str, Any],
           env: Mapping[str, str]) -> tuple[Any, list[str], set[str]]:
    """The section built from its well-typed keys (defaults for the rest), the problems
    found, and the keys that had one."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    problems = []
    bad_keys: set[str] = set()
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in names or key in _SECRET_FIELDS:
            hint = " (secrets come from the environment, see token_env)" if key in _SECRET_FIELDS else ""
            problems.append(f"{section}.{key} is not a known key{hint}")
            continue
        converted, problem = _convert(f"{section}.{key}", hints[key], value)
        if problem:
            problems.append(problem)
            bad_keys.add(key)
        else:
            kwargs[key] = converted
    # Each ``*token_env`` (and ``dsn_env``) key names the variable of the field beside it.
    for f in dataclasses.fields(cls):
        if not f.name.endswith(("token_env", "dsn_env")) or f.name[:-4] not in names:
            continue
        var = kwargs.get(f.name, f.default)
        if var:
            secret, problem = read_secret(f"{section}.{f.name}", str(var), env)
            if problem:
                problems.append(problem)
                bad_keys.add(f.name)
            kwargs[f.name[:-4]] = secret
    return cls(**kwargs), problems, bad_keys


def _convert_tables(key: str, cls: type[Any], value: Any) -> tuple[Any, str]:
    """An array of tables (``[[limits.quota]]``): each entry typed like a section."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        return None, f"{key} must be an array of tables ([[{key}]]), got {value!r}"
    hints = typing.get_type_hints(cls)
    items, problems = [], []
    for i, table in enumerate(value):
        kwargs = {}
        for k, v in table.items():
            if k not in hints or k in _SECRET_FIELDS:
                problems.append(f"{key}[{i}].{k} is not a known key")
                continue
            converted, problem = _convert(f"{key}[{i}].{k}", hints[k], v)
            if problem:
                problems.append(problem)
            else:
                kwargs[k] = converted
        items.append(cls(**kwargs))
    if problems:
        return None, "; ".join(problems)
    return tuple(items), ""


def _convert(key: str, hint: Any, value: Any) -> tuple[Any, str]:
    origin = typing.get_origin(hint)
    if origin is tuple and typing.get_args(hint)[0] is str:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return None, f"{key} must be a list of strings, got {value!r}"
        return tuple(value), ""
    if origin is tuple:
        return _convert_tables(key, typing.get_args(hint)[0], value)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(key, args[0], value)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            return None, f"{key} must be one of {', '.join(map(repr, allowed))}, got {value!r}"
        return value, ""
    if hint is bool:
        if not isinstance(value, bool):
            return None, f"{key} must be true or false, got {value!r}"
        return value, ""
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return None, f"{key} must be an integer, got {value!r}"
        return value, ""
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None, f"{key} must be a number, got {value!r}"
        return float(value), ""
    if hint is str:
        if not isinstance(value, str):
            return None, f"{key} must be a string, got {value!r}"
        return value, ""
    if hint is Path:
        if not isinstance(value, str) or not value:
            return None, f"{key} must be a path string, got {value!r}"
        return Path(value), ""
    raise TypeError(f"unsupported config type {hint!r} for {key}")  # a bug, not bad input
