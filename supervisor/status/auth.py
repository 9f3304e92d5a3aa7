"""The status page's browser login: tokens to roles, sessions, CSRF and the origin check.

A person logs in by POSTing a token (never in a URL). The trigger token makes an
*operator*, who may resolve ambiguous operations; the optional read-only token
(``status.token_env``) makes a *viewer*. The session is a random ID in an HttpOnly,
SameSite=Strict cookie; the server keeps the role, a CSRF token and the expiry in this
process's memory, so a restart logs everyone out (and with replicas a session is known
only to the replica that made it). Every state-changing POST must come from the page's
own origin (Origin, else Referer) and, once logged in, carry the session's CSRF token.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from aiohttp import web

from supervisor.config import StatusConfig
from supervisor.configtypes import Secret

Role = Literal["operator", "viewer"]
OPERATOR: Role = "operator"
VIEWER: Role = "viewer"

COOKIE = "cleanup_status"
# The __Host- prefix makes the browser refuse the cookie unless it is Secure, host-only
# and Path=/: a sibling subdomain cannot plant or shadow it.
SECURE_COOKIE = "__Host-cleanup_status"
# More sessions than a team needs; the oldest goes first, so a login loop cannot grow
# the process without bound.
MAX_SESSIONS = 1000
MAX_TOKEN_BYTES = 4096
# Addresses whose failures are remembered at once (the oldest forgotten first).
MAX_TRACKED_ADDRESSES = 10_000
THROTTLE_WINDOW_S = 60.0


@dataclass
class Session:
    id: str
    role: Role
    csrf: str
    expires_at: float  # monotonic
    # Messages for the next page shown (after a POST-redirect-GET), then dropped.
    flash: list[tuple[str, str]] = field(default_factory=list)
    # The name last typed into a resolve form, offered again in the next one.
    name: str = ""

    @property
    def can_resolve(self) -> bool:
        return self.role == OPERATOR


class Sessions:
    """Sessions in memory with an absolute lifetime."""

    def __init__(self, lifetime_s: float, clock: Callable[[], float] = time.monotonic,
                 max_sessions: int = MAX_SESSIONS) -> None:
        self.lifetime_s = lifetime_s
        self.clock = clock
        self.max_sessions = max_sessions
        self._by_id: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def create(self, role: Role) -> Session:
        self._prune()
        while len(self._by_id) >= self.max_sessions:
            self._by_id.popitem(last=False)
        session = Session(id=secrets.token_urlsafe(32), role=role,
                          csrf=secrets.token_urlsafe(32),
                          expires_at=self.clock() + self.lifetime_s)
        self._by_id[session.id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        session = self._by_id.get(session_id)
        if session is None:
            return None
        if self.clock() >= session.expires_at:
            del self._by_id[session_id]
            return None
        return session

    def drop(self, session_id: str) -> None:
        self._by_id.pop(session_id, None)

    def _prune(self) -> None:
        now = self.clock()
        for sid in [sid for sid, s in self._by_id.items() if now >= s.expires_at]:
            del self._by_id[sid]


class LoginThrottle:
    """At most ``limit`` failed logins per address in any minute; then 429 until the
    oldest failure leaves the window. A success does not clear the count: guessing
    between two right answers is still guessing."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic,
                 window_s: float = THROTTLE_WINDOW_S) -> None:
        self.limit = limit
        self.clock = clock
        self.window_s = window_s
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, address: str) -> float:
        """Seconds until ``address`` may try again; 0 when it may now."""
        times = self._failures.get(address)
        if times is None:
            return 0.0
        now = self.clock()
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[address]
            return 0.0
        if len(times) < self.limit:
            return 0.0
        return times[0] + self.window_s - now

    def failed(self, address: str) -> None:
        times = self._failures.setdefault(address, deque())
        self._failures.move_to_end(address)
        times.append(self.clock())
        while len(times) > self.limit:
            times.popleft()
        while len(self._failures) > MAX_TRACKED_ADDRESSES:
            self._failures.popitem(last=False)


def role_for(supplied: str, operator: Secret | None, viewer: Secret | None) -> Role | None:
    """The role a token grants, compared in constant time against both tokens (every
    time, so the timing tells neither which token nor how much of one matched)."""
    # surrogateescape: form bytes that are not UTF-8 must be a wrong token, not an error.
    given = supplied.strip().encode("utf-8", "surrogateescape")[:MAX_TOKEN_BYTES]
    is_operator = hmac.compare_digest(given, _expected(operator))
    is_viewer = hmac.compare_digest(given, _expected(viewer))
    if operator is not None and is_operator:
        return OPERATOR
    if viewer is not None and is_viewer:
        return VIEWER
    return None


def _expected(secret: Secret | None) -> bytes:
    # No token configured: compare against a value no form field can carry (a NUL).
    return secret.reveal().encode() if secret is not None else b"\x00"


def cookie_name(config: StatusConfig) -> str:
    return SECURE_COOKIE if config.secure_cookie else COOKIE


def set_session_cookie(response: web.StreamResponse, config: StatusConfig,
                       session: Session) -> None:
    response.set_cookie(cookie_name(config), session.id, max_age=int(config.session_seconds),
                        path="/", httponly=True, samesite="Strict",
                        secure=True if config.secure_cookie else None)


def clear_session_cookie(response: web.StreamResponse, config: StatusConfig) -> None:
    response.set_cookie(cookie_name(config), "", max_age=0, path="/", httponly=True,
                        samesite="Strict", secure=True if config.secure_cookie else None)


def same_origin(request: web.Request, config: StatusConfig) -> bool:
    """Whether a POST comes from the page's own origin: its Origin header (a browser
    sends one with every POST), else its Referer; neither is a refusal."""
    source = request.headers.get("Origin")
    if source is None or source == "null":
        referer = request.headers.get("Referer")
        if not referer:
            return False
        parts = urlsplit(referer)
        source = f"{parts.scheme}://{parts.netloc}"
    if config.origin:
        return hmac.compare_digest(source.rstrip("/").lower().encode(),
                                   config.origin.rstrip("/").lower().encode())
    # Behind a TLS proxy the request's own scheme is http while the browser's is https:
    # the host and port are what must match.
    parts = urlsplit(source)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and \
        parts.netloc.lower() == request.host.lower()


def csrf_ok(form: Mapping[str, object], session: Session) -> bool:
    supplied = form.get("csrf")
    if not isinstance(supplied, str):
        return False
    return hmac.compare_digest(supplied.encode("utf-8", "surrogateescape"), session.csrf.encode())
