"""The status page's browser login: tokens to roles, sessions, CSRF and the origin check.

A person logs in by POSTing a token (never in a URL). The operator token
(``trigger.token_env``) makes an *operator*, who may resolve ambiguous operations; the
optional read-only token (``status.token_env``) makes a *viewer*; the tick and metrics
tokens log nobody in. Failed logins share the API's failure throttle
(supervisor/apiauth.py). The session is a random ID in an HttpOnly,
SameSite=Strict cookie; the server keeps the role, a CSRF token and the expiry in this
process's memory, so a restart logs everyone out (and with replicas a session is known
only to the replica that made it). Every state-changing POST must come from the page's
own origin (Origin, else Referer) and, once logged in, carry the session's CSRF token.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from aiohttp import web

from supervisor.authsettings import StatusConfig

Role = Literal["operator", "viewer"]
OPERATOR: Role = "operator"
VIEWER: Role = "viewer"

COOKIE = "cleanup_status"
# The __Host- prefix makes the browser refuse the cookie unless it is Secure, host-only
# and Path=/: a sibling subdomain cannot plant or shadow it.
SECURE_COOKIE = "__Host-cleanup_status"
# More sessions of each role than a team needs; the oldest of the role goes first, so a
# login loop cannot grow the process without bound, and a viewer's loop cannot log an
# operator out.
MAX_SESSIONS = 1000


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
    """Sessions in memory with an absolute lifetime, at most ``max_sessions`` per role."""

    def __init__(self, lifetime_s: float, clock: Callable[[], float] = time.monotonic,
                 max_sessions: int = MAX_SESSIONS) -> None:
        self.lifetime_s = lifetime_s
        self.clock = clock
        self.max_sessions = max_sessions
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._count: dict[Role, int] = {OPERATOR: 0, VIEWER: 0}

    def __len__(self) -> int:
        return len(self._by_id)

    def create(self, role: Role) -> Session:
        self._prune()
        if self._count[role] >= self.max_sessions:
            oldest = next(sid for sid, s in self._by_id.items() if s.role == role)
            self.drop(oldest)
        session = Session(id=secrets.token_urlsafe(32), role=role,
                          csrf=secrets.token_urlsafe(32),
                          expires_at=self.clock() + self.lifetime_s)
        self._by_id[session.id] = session
        self._count[role] += 1
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        session = self._by_id.get(session_id)
        if session is None:
            return None
        if self.clock() >= session.expires_at:
            self.drop(session_id)
            return None
        return session

    def drop(self, session_id: str) -> None:
        session = self._by_id.pop(session_id, None)
        if session is not None:
            self._count[session.role] -= 1

    def _prune(self) -> None:
        now = self.clock()
        for sid in [sid for sid, s in self._by_id.items() if now >= s.expires_at]:
            self.drop(sid)


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
    try:
        if source is None or source == "null":
            referer = request.headers.get("Referer")
            if not referer:
                return False
            parts = urlsplit(referer)
            source = f"{parts.scheme}://{parts.netloc}"
        if config.origin:
            # surrogateescape: header bytes that are not UTF-8 arrive as lone surrogates.
            given = source.rstrip("/").lower().encode("utf-8", "surrogateescape")
            return hmac.compare_digest(given, config.origin.rstrip("/").lower().encode())
        # Behind a TLS proxy the request's own scheme is http while the browser's is
        # https: the host and port are what must match.
        parts = urlsplit(source)
    except ValueError:  # "http://[": not a URL, so not this page's origin
        return False
    return parts.scheme in ("http", "https") and bool(parts.netloc) and \
        parts.netloc.lower() == request.host.lower()


def csrf_ok(form: Mapping[str, object], session: Session) -> bool:
    supplied = form.get("csrf")
    if not isinstance(supplied, str):
        return False
    return hmac.compare_digest(supplied.encode("utf-8", "surrogateescape"), session.csrf.encode())
