"""Who may call this service: the ``[trigger]`` and ``[status]`` sections, and the checks
and defaults that take the tokens of several sections (and ``service.listen``) to decide.

Three tokens, three scopes (supervisor/apiauth.py enforces them):

* ``trigger.token_env``: the *operator* token. It opens runs (``recipient_ids`` too, with
  ``source.kind = "inline"``), resolves and retries ambiguous operations, lifts a budget
  pause, reads everything, and is the status page's operator login. The key keeps its old
  name, so an existing deployment keeps working: its trigger token simply became the
  operator token.
* ``trigger.tick_token_env``: the optional *tick* token, for cron callers (Infrai's cron
  job carries this one, never the operator token). It opens runs of the configured
  schedule, without ``recipient_ids``, and nothing else: not even a read.
* ``status.token_env``: the optional *viewer* token: reads the API and logs in to the
  status page read-only.

``service.metrics_token_env`` optionally guards ``/metrics``. Every token must be at least
:data:`MIN_TOKEN_BYTES` long and differ from the others.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from supervisor.configtypes import Secret, _positive, missing_secret

MIN_TOKEN_BYTES = 32
HSTS_SECONDS = 365 * 86400
# A Host entry of service.allowed_hosts: a name, ".name" for it and its subdomains, or "*".
HOST_ENTRY = re.compile(r"\*|\.?[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")
LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True, slots=True)
class TriggerConfig:
    # The operator token (see the module docstring); required.
    token_env: str = "CLEANUP_TRIGGER_TOKEN"
    token: Secret | None = None  # resolved from token_env, never read from the file
    # The tick-only token a cron caller sends; optional.
    tick_token_env: str = "CLEANUP_TICK_TOKEN"
    tick_token: Secret | None = None

    def problems(self) -> list[str]:
        if self.token is None:
            return [missing_secret("trigger.token_env", self.token_env,
                                   "the trigger endpoint never runs without a token")]
        return []


@dataclass(frozen=True, slots=True)
class StatusConfig:
    """The status page at ``/`` for a person (supervisor/status): a browser login with
    the operator token (may resolve) or the read-only token (a viewer)."""

    enabled: bool = True
    # Optional: unset, only operators can log in; never an error.
    token_env: str = "CLEANUP_STATUS_TOKEN"
    token: Secret | None = None  # resolved from token_env, never read from the file
    # Sessions live in this process's memory: a restart logs everyone out.
    session_seconds: float = 8 * 3600.0
    # True: the cookie is only sent over HTTPS (and named __Host-...). Unset: true unless
    # service.listen is a loopback address (where the demo runs over plain http).
    secure_cookie: bool | None = None
    # scheme://host[:port] the browser sees, when a proxy rewrites the Host header; a
    # form's Origin must match it. Empty: the Host header of the request is the origin.
    origin: str = ""
    # Replaced by service.auth_failures_per_minute (failed Bearer tokens count too); kept
    # only to name its successor when an old file still sets it.
    login_failures_per_minute: int | None = None

    def problems(self) -> list[str]:
        out = _positive("status", self, "session_seconds")
        if self.login_failures_per_minute is not None:
            out.append("status.login_failures_per_minute is now "
                       "service.auth_failures_per_minute (failed Bearer tokens on the API "
                       "count too); rename the key")
        if self.origin:
            parts = urlsplit(self.origin)
            if parts.scheme not in ("http", "https") or not parts.netloc or \
                    parts.path not in ("", "/") or parts.query or parts.fragment:
                out.append("status.origin must be scheme://host[:port] (no path), "
                           f"got {self.origin!r}")
        return out


def is_loopback(host: str) -> bool:
    """Whether ``host`` (service.listen's host) reaches only this machine."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def service_problems(service: Any) -> list[str]:
    """The access keys of ``[service]``: proxies, hosts, the throttle, HSTS."""
    out = _positive("service", service, "auth_failures_per_minute",
                    "auth_failures_per_minute_total")
    for i, cidr in enumerate(service.trusted_proxies):
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            out.append(f"service.trusted_proxies[{i}] must be an IP address or CIDR, "
                       f"got {cidr!r}")
    for i, host in enumerate(service.allowed_hosts):
        if not HOST_ENTRY.fullmatch(host.lower()):
            out.append(f"service.allowed_hosts[{i}] must be a host name (no port), "
                       f"'.name' for it and its subdomains, or '*'; got {host!r}")
    if service.hsts_seconds is not None and service.hsts_seconds < 0:
        out.append(f"service.hsts_seconds must be >= 0, got {service.hsts_seconds}")
    return out


def _tokens(sections: Mapping[str, Any]) -> list[tuple[str, str, str, Secret | None]]:
    """(key, variable, name, secret) of every token a caller presents to this service."""
    trigger, status, service = sections["trigger"], sections["status"], sections["service"]
    return [("trigger.token_env", trigger.token_env, "trigger token", trigger.token),
            ("trigger.tick_token_env", trigger.tick_token_env, "tick token", trigger.tick_token),
            ("status.token_env", status.token_env, "read-only token", status.token),
            ("service.metrics_token_env", service.metrics_token_env, "metrics token",
             service.metrics_token)]


def token_problems(sections: Mapping[str, Any]) -> list[str]:
    """Every token long enough to resist guessing, and no two alike (a shared value would
    grant one token's scopes to the holder of the other)."""
    out = []
    seen: list[tuple[str, Secret]] = []
    for key, var, name, secret in _tokens(sections):
        if secret is None:
            continue
        size = len(secret.reveal().encode("utf-8", "surrogateescape"))
        if size < MIN_TOKEN_BYTES:
            out.append(f"{key}: ${var} holds {size} bytes; a token must be at least "
                       f"{MIN_TOKEN_BYTES} bytes (e.g. openssl rand -hex 32)")
        for other_name, other in seen:
            if other == secret:
                out.append(f"{key}: ${var} holds the {other_name}; the {name} must differ "
                           "from it")
                break
        seen.append((name, secret))
    return out


def _host_of(url: str) -> str | None:
    try:
        return urlsplit(url).hostname or None
    except ValueError:
        return None


def resolve_access(sections: Mapping[str, Any]) -> tuple[Any, Any]:
    """``service`` and ``status`` with their unset safe defaults decided by where the
    service listens: off loopback, secure cookies and HSTS; on loopback, a Host allow-list
    (loopback names and the hosts this service is configured to be reached as)."""
    service, status, infrai = sections["service"], sections["status"], sections["infrai"]
    loopback = is_loopback(service.host)
    if status.secure_cookie is None:
        status = dataclasses.replace(status, secure_cookie=not loopback)
    changes: dict[str, Any] = {}
    if service.hsts_seconds is None:
        changes["hsts_seconds"] = 0 if loopback else HSTS_SECONDS
    if not service.allowed_hosts:
        if loopback:
            hosts = [*LOOPBACK_NAMES, *(h for url in (status.origin, infrai.trigger_url,
                                                      infrai.push_url)
                                        if url and (h := _host_of(url)) is not None)]
            changes["allowed_hosts"] = tuple(dict.fromkeys(h.lower() for h in hosts))
        else:
            # Reached by names this process cannot know (a proxy's, a compose service's):
            # no check unless configured. IP literals are always accepted anyway.
            changes["allowed_hosts"] = ("*",)
    return dataclasses.replace(service, **changes), status
