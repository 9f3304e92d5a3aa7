"""Who may call, and what happens to a caller who guesses.

* **Scopes.** Each token grants scopes (supervisor/authsettings.py says which token is
  which): the operator token every one, the tick token :attr:`Scope.TICK` only, the
  viewer token :attr:`Scope.READ` (and ``/metrics``), the metrics token ``/metrics``
  only. A handler states what it needs, once, at its top::

      role = authorize(request, Scope.OPERATE)      # or: @requires(Scope.OPERATE)

  401 for a missing or wrong token, 403 for a token without the scope, 429 (with
  Retry-After) for a client held by the throttle. A module with its own routes (e.g. the
  budget API) imports these from here (``supervisor.http`` re-exports them), so it needs
  no import of the HTTP app.
* **The failure throttle**, shared by the Bearer API and the status page's login: a token
  bucket per client (an IPv4 address or an IPv6 /64) and one for all clients together.
  A client past its bucket, or any client while the shared one is empty, gets 429 before
  its credentials are looked at, so throttled guesses learn nothing (a request without
  credentials is no guess: it gets its 401). A client that has
  proven a token since start is held by its own bucket only: an attacker spreading
  guesses over many addresses cannot lock out the cron caller or an operator. Failures
  are counted (``cleanup_auth_failures_total{route}``) and logged at most once per
  :data:`LOG_EVERY_S`, with how many went unlogged.
* **The client address** is the socket's peer, unless that peer is one of
  ``service.trusted_proxies``: then the nearest address in ``X-Forwarded-For`` that is not
  a trusted proxy itself.
* **Every answer** gets ``X-Content-Type-Options: nosniff`` and ``Cache-Control:
  no-store`` (unless it set its own), HSTS when configured, and a Host header outside
  ``service.allowed_hosts`` (an IP literal always passes: DNS rebinding needs a name) is
  421 before any handler runs.
"""

from __future__ import annotations

import enum
import functools
import hmac
import ipaddress
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from supervisor import metrics
from supervisor.authsettings import resolve_access
from supervisor.config import Config
from supervisor.configtypes import Secret

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MAX_TOKEN_BYTES = 4096
# Clients whose buckets are remembered at once (a full bucket is forgotten: it is the
# state of a client never seen), and clients remembered as having proven a token.
MAX_CLIENTS = 10_000
MAX_PROVEN = 1000
LOG_EVERY_S = 10.0
IPV6_PREFIX = 64


class Scope(enum.Enum):
    TICK = "tick"          # POST /v1/runs: a run of the configured schedule, no recipient_ids
    READ = "read"          # every GET under /v1
    OPERATE = "operate"    # resolve, retry, lift a budget pause; recipient_ids in a trigger
    METRICS = "metrics"    # GET /metrics, when service.metrics_token_env is set


class Role(enum.StrEnum):
    OPERATOR = "operator"
    TICK = "tick"
    VIEWER = "viewer"
    METRICS = "metrics"


GRANTS: Mapping[Role, frozenset[Scope]] = {
    Role.OPERATOR: frozenset(Scope),
    Role.TICK: frozenset({Scope.TICK}),
    Role.VIEWER: frozenset({Scope.READ, Scope.METRICS}),
    Role.METRICS: frozenset({Scope.METRICS}),
}
_WHAT = {Scope.TICK: "open runs", Scope.READ: "read the API",
         Scope.OPERATE: "resolve, retry or lift a pause", Scope.METRICS: "read /metrics"}


class Refused(Exception):
    """An answer a request gets instead of its handler's (the app's error middleware
    turns it into JSON with these headers)."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None
                 ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


class FailureThrottle:
    """Token buckets of failed authentications: ``per_client`` a minute for each client
    (a burst of as many), ``total`` a minute for all of them. A success refills nothing:
    guessing between two right answers is still guessing."""

    def __init__(self, per_client: int, total: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_client, self.total = float(per_client), float(total)
        self.clock = clock
        self._clients: OrderedDict[str, tuple[float, float]] = OrderedDict()  # level, at
        self._all = (self.total, clock())
        self._proven: OrderedDict[str, None] = OrderedDict()

    def _level(self, state: tuple[float, float], capacity: float, now: float) -> float:
        level, at = state
        return min(capacity, level + (now - at) * capacity / 60.0)

    def retry_after(self, client: str) -> float:
        """Seconds until ``client`` may present credentials again; 0 when it may now."""
        now = self.clock()
        wait = 0.0
        state = self._clients.get(client)
        if state is not None:
            level = self._level(state, self.per_client, now)
            if level >= self.per_client:
                del self._clients[client]
            elif level < 1:
                wait = (1 - level) * 60.0 / self.per_client
        if client not in self._proven:
            level = self._level(self._all, self.total, now)
            if level < 1:
                wait = max(wait, (1 - level) * 60.0 / self.total)
        return wait

    def failed(self, client: str) -> None:
        now = self.clock()
        state = self._clients.pop(client, (self.per_client, now))
        self._clients[client] = (max(0.0, self._level(state, self.per_client, now) - 1), now)
        while len(self._clients) > MAX_CLIENTS:
            self._clients.popitem(last=False)
        self._all = (max(0.0, self._level(self._all, self.total, now) - 1), now)

    def succeeded(self, client: str) -> None:
        self._proven[client] = None
        self._proven.move_to_end(client)
        while len(self._proven) > MAX_PROVEN:
            self._proven.popitem(last=False)


@dataclass
class _Unlogged:
    """Log lines held back so a flood of failures writes at most one line per
    LOG_EVERY_S."""

    clock: Callable[[], float]
    last: float = -math.inf
    held: int = 0

    def warn(self, message: str, *args: object) -> None:
        now = self.clock()
        if now - self.last < LOG_EVERY_S:
            self.held += 1
            return
        held, self.held, self.last = self.held, 0, now
        log.warning(message + " (%d more not logged in the last %g s)", *args, held,
                    LOG_EVERY_S, extra={"action": "auth_failed"})


def _parse_ip(text: str) -> IPAddress | None:
    text = text.strip()
    if text.startswith("["):  # [v6]:port
        text, closed, _ = text[1:].partition("]")
        if not closed:
            return None
    elif text.count(":") == 1:  # v4:port
        text = text.partition(":")[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def client_key(ip: IPAddress | None) -> str:
    """What the throttle counts by: an IPv4 address, or an IPv6 address's /64 (one host
    commonly holds a whole /64, so counting single addresses would count nothing)."""
    if ip is None:
        return "unknown"
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, IPV6_PREFIX), strict=False))
    return str(ip)


@dataclass
class Guard:
    """The app's one view of who is calling (``request.config_dict[GUARD]``)."""

    config: Config
    clock: Callable[[], float] = time.monotonic
    throttle: FailureThrottle = field(init=False)
    proxies: tuple[IPNetwork, ...] = field(init=False)
    allowed_hosts: tuple[str, ...] = field(init=False)
    hsts_seconds: int = field(init=False)
    _tokens: tuple[tuple[Role, Secret | None], ...] = field(init=False)
    _log: _Unlogged = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        self.throttle = FailureThrottle(c.service.auth_failures_per_minute,
                                        c.service.auth_failures_per_minute_total, self.clock)
        self.proxies = tuple(ipaddress.ip_network(p, strict=False)
                             for p in c.service.trusted_proxies)
        # load() decided the unset defaults already; a Config built in code has not.
        service, _ = resolve_access({"service": c.service, "status": c.status,
                                     "infrai": c.infrai})
        self.allowed_hosts, self.hsts_seconds = service.allowed_hosts, service.hsts_seconds or 0
        self._tokens = ((Role.OPERATOR, c.trigger.token), (Role.TICK, c.trigger.tick_token),
                        (Role.VIEWER, c.status.token), (Role.METRICS, c.service.metrics_token))
        self._log = _Unlogged(self.clock)

    def identify(self, supplied: str) -> Role | None:
        """The role ``supplied`` proves, compared in constant time against every token,
        every time (the timing tells neither which token nor how much of one matched)."""
        # surrogateescape: header or form bytes that are not UTF-8 arrive as lone
        # surrogates, and a wrong token must be a refusal, not an encoding error.
        given = supplied.strip().encode("utf-8", "surrogateescape")[:MAX_TOKEN_BYTES]
        found = None
        for role, secret in self._tokens:
            # No token configured: compared against a value no header can carry (a NUL).
            expected = secret.reveal().encode() if secret is not None else b"\x00"
            if hmac.compare_digest(given, expected) and secret is not None and found is None:
                found = role
        return found

    def _trusted(self, ip: IPAddress) -> bool:
        return any(ip in net for net in self.proxies)

    def client_ip(self, request: web.Request) -> IPAddress | None:
        """The client's address: the peer, or behind trusted proxies the nearest
        X-Forwarded-For hop that is not one of them (never what an untrusted peer says)."""
        ip = _parse_ip(request.remote or "")
        if ip is None or not self._trusted(ip):
            return ip
        hops = [h for value in request.headers.getall("X-Forwarded-For", [])
                for h in value.split(",")]
        for hop in reversed(hops):
            parsed = _parse_ip(hop)
            if parsed is None:
                break  # a garbled hop: believe nothing further left of it
            ip = parsed
            if not self._trusted(ip):
                break
        return ip

    def client(self, request: web.Request) -> str:
        return client_key(self.client_ip(request))

    def hold(self, client: str, route: str) -> None:
        """Raise a 429 while ``client`` may not present credentials."""
        wait = self.throttle.retry_after(client)
        if wait > 0:
            metrics.AUTH_THROTTLED.labels(route).inc()
            self._log.warn("authentication throttled on %s from %s", route, client)
            seconds = str(math.ceil(wait))
            raise Refused(429, f"too many failed authentications; try again in {seconds} s",
                          {"Retry-After": seconds})

    def failed(self, client: str, route: str) -> None:
        self.throttle.failed(client)
        metrics.AUTH_FAILURES.labels(route).inc()
        self._log.warn("authentication failed on %s from %s", route, client)

    def succeeded(self, client: str) -> None:
        self.throttle.succeeded(client)

    def host_allowed(self, host: str | None) -> bool:
        allowed = self.allowed_hosts
        if host is None or "*" in allowed:
            return True
        if _parse_ip(host) is not None:
            return True
        name = host.strip().partition(":")[0].lower().rstrip(".")
        return any(name == entry or (entry.startswith(".") and
                                     (name == entry[1:] or name.endswith(entry)))
                   for entry in allowed)


GUARD = web.AppKey("guard", Guard)


def route_of(request: web.Request) -> str:
    """The route template (``/v1/runs/{run_id}``): a label that never holds client text."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def authorize(request: web.Request, scope: Scope) -> Role:
    """The caller's role, once its Bearer token is shown to grant ``scope``; else raise
    :class:`Refused` (401, 403 or 429)."""
    guard = request.config_dict[GUARD]
    route = route_of(request)
    client = guard.client(request)
    header = request.headers.get("Authorization", "")
    scheme, _, supplied = header.partition(" ")
    # No token (no header, or a scheme alone) is no guess: a 401, whatever the throttle
    # says (nothing to hold back), and nothing counted.
    presented = bool(supplied.strip())
    if presented:
        guard.hold(client, route)
    role = guard.identify(supplied)
    if scheme.lower() != "bearer" or role is None:
        if presented:
            guard.failed(client, route)
        raise Refused(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
    guard.succeeded(client)
    if scope not in GRANTS[role]:
        raise Refused(403, f"the {role} token may not {_WHAT[scope]}")
    return role


def requires(scope: Scope) -> Callable[[Handler], Handler]:
    """``authorize`` as a handler decorator."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def guarded(request: web.Request) -> web.StreamResponse:
            authorize(request, scope)
            return await handler(request)

        return guarded

    return wrap


@web.middleware
async def host_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A Host outside service.allowed_hosts is 421 before any handler runs: a page whose
    name was rebound to this address must not read even the open routes."""
    if not request.config_dict[GUARD].host_allowed(request.headers.get("Host")):
        raise Refused(421, "this service does not answer to that Host name "
                           "(service.allowed_hosts)")
    return await handler(request)


async def secure_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every answer is never sniffed, never cached (a response that
    chose its own caching keeps it), and pinned to HTTPS when HSTS is on."""
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Cache-Control", "no-store")
    hsts = request.config_dict[GUARD].hsts_seconds
    if hsts:
        response.headers.setdefault("Strict-Transport-Security", f"max-age={hsts}")


def install(app: web.Application, config: Config) -> None:
    """Give ``app`` its guard, the Host check and the headers (the error middleware,
    which turns :class:`Refused` into an answer, must come before ``host_middleware``)."""
    app[GUARD] = Guard(config)
    app.on_response_prepare.append(secure_headers)
