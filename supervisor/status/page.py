"""The status page's handlers: ``/``, ``/login``, ``/logout``, ``/status/data``, the
resolve form's POST, and ``/static/``.

Pages are HTML with a strict Content-Security-Policy (nothing but this origin's own
script and style); ``/status/data`` is the JSON the page's script polls. Every
state-changing POST checks, in this order: a session (401), the page's own origin (403),
the session's CSRF token (403), and for a resolution the operator role (403).
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources

import orjson
from aiohttp import web
from multidict import MultiDictProxy

from supervisor import budget_api
from supervisor.apiauth import GUARD, Refused, Role
from supervisor.apistate import ApiState
from supervisor.authsettings import StatusConfig
from supervisor.errors import IllegalTransition, StorageError
from supervisor.openapi import PRINTABLE
from supervisor.reconcile import RESOLUTIONS
from supervisor.states import OpState
from supervisor.status import render
from supervisor.status.auth import (
    OPERATOR,
    VIEWER,
    Session,
    Sessions,
    clear_session_cookie,
    cookie_name,
    csrf_ok,
    same_origin,
    set_session_cookie,
)
from supervisor.status.history import History
from supervisor.status.views import StatusData

log = logging.getLogger(__name__)

# The ambiguous operations listed with a form; the CLI lists every one.
MAX_AMBIGUOUS = 50
MAX_FIELD = 500
MAX_FLASH = 5
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'; "
       "object-src 'none'")
STATIC_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


@dataclass(frozen=True, slots=True)
class StaticFile:
    body: bytes
    content_type: str
    etag: str


@dataclass
class StatusContext:
    api: ApiState
    config: StatusConfig
    sessions: Sessions
    data: StatusData
    history: History
    static: dict[str, StaticFile]


STATUS = web.AppKey("status", StatusContext)


def load_static() -> dict[str, StaticFile]:
    """The package's static files, read once: a fixed set of names, no path to traverse."""
    out = {}
    for entry in resources.files("supervisor.status").joinpath("static").iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in STATIC_TYPES:
            body = entry.read_bytes()
            out[entry.name] = StaticFile(body, STATIC_TYPES[suffix],
                                         '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    return out


def _protect(response: web.StreamResponse) -> web.StreamResponse:
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["X-Frame-Options"] = "DENY"
    # same-origin: the page's own POSTs keep their Origin (no-referrer would send "null").
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers.setdefault("Cache-Control", "no-store")
    return response


def _html(body: str, status: int = 200) -> web.Response:
    response = web.Response(text=body, status=status, content_type="text/html",
                            charset="utf-8")
    _protect(response)
    return response


def _redirect(location: str) -> web.Response:
    response = web.Response(status=303, headers={"Location": location})
    _protect(response)
    return response


def _ctx(request: web.Request) -> StatusContext:
    return request.app[STATUS]


def _session(request: web.Request) -> Session | None:
    ctx = _ctx(request)
    return ctx.sessions.get(request.cookies.get(cookie_name(ctx.config)))


def _refused(request: web.Request, why: str, session: Session | None) -> web.Response:
    # %r: a decoded %0A in the path must not start a forged log line.
    log.warning("status page: refused %s %r from %s: %s", request.method, request.path,
                _address(request), why, extra={"action": "status_refused"})
    return _html(render.message_page("Refused", why, session), 403)


def _address(request: web.Request) -> str:
    """The client as the failure throttle counts it (behind service.trusted_proxies,
    the address a proxy forwarded for)."""
    return request.config_dict[GUARD].client(request)


Form = MultiDictProxy[str | bytes | bytearray | web.FileField]


async def _form(request: web.Request) -> Form | None:
    """The posted form; None when it cannot be read (bytes that are not UTF-8, a broken
    multipart body). Past service.max_body_bytes the middleware answers 413."""
    try:
        return await request.post()
    except (UnicodeDecodeError, ValueError):
        return None


async def _session_form(request: web.Request, session: Session) -> Form | web.Response:
    """A logged-in session's state-changing form, once it is shown to come from this
    page's own origin, to be readable and to carry the session's CSRF token; else the
    refusal to answer with."""
    if not same_origin(request, _ctx(request).config):
        return _refused(request, "The form must be sent from this page's own origin.", session)
    form = await _form(request)
    if form is None:
        return _unreadable(session)
    if not csrf_ok(form, session):
        return _refused(request, "The form's CSRF token is missing or wrong; reload the page "
                        "and try again.", session)
    return form


def _unreadable(session: Session | None) -> web.Response:
    return _html(render.message_page("Bad request", "The form could not be read.", session),
                 400)


async def index(request: web.Request) -> web.Response:
    session = _session(request)
    if session is None:
        return _redirect("/login")
    ctx = _ctx(request)
    data = await ctx.data.get()
    ops = await ctx.api.ledger.operations_in_state(OpState.AMBIGUOUS, None, MAX_AMBIGUOUS + 1)
    budget = await budget_api.show(ctx.api) if ctx.api.budget is not None else None
    page = render.status_page(data, ops[:MAX_AMBIGUOUS], len(ops) > MAX_AMBIGUOUS, session,
                              session.name, render.budget_card(budget, session, session.name))
    session.flash.clear()
    return _html(page)


async def login_form(request: web.Request) -> web.Response:
    if _session(request) is not None:
        return _redirect("/")
    return _html(render.login_page())


async def login(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    guard = request.config_dict[GUARD]
    address = _address(request)
    try:  # the API's throttle: failures here and on the Bearer API count together
        guard.hold(address, "/login")
    except Refused as exc:
        response = _html(render.login_page(
            f"Too many failed logins; try again in {exc.headers['Retry-After']} s."), 429)
        response.headers.update(exc.headers)
        return response
    if not same_origin(request, ctx.config):
        return _refused(request, "The login form must be sent from this page's own origin.",
                        None)
    form = await _form(request)
    if form is None:
        return _unreadable(None)
    token = form.get("token")
    supplied = token if isinstance(token, str) else ""
    found = guard.identify(supplied)
    if found is None:
        if supplied.strip():  # an empty field is no guess
            guard.failed(address, "/login")
        return _html(render.login_page("Wrong token."), 401)
    guard.succeeded(address)
    if found not in (Role.OPERATOR, Role.VIEWER):
        return _html(render.login_page(f"The {found} token logs nobody in; use the operator "
                                       "or the read-only token."), 403)
    role = OPERATOR if found is Role.OPERATOR else VIEWER
    # A new ID at every login: a session ID planted before it is worth nothing after.
    old = request.cookies.get(cookie_name(ctx.config))
    if old:
        ctx.sessions.drop(old)
    session = ctx.sessions.create(role)
    log.info("status page: %s logged in from %s", role, address,
             extra={"action": "status_login"})
    response = _redirect("/")
    set_session_cookie(response, ctx.config, session)
    return response


async def logout(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    session = _session(request)
    if session is not None:
        form = await _session_form(request, session)
        if isinstance(form, web.Response):
            return form
        ctx.sessions.drop(session.id)
    response = _redirect("/login")
    clear_session_cookie(response, ctx.config)
    return response


def _text_field(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not 0 < len(value) <= MAX_FIELD or not re.fullmatch(PRINTABLE, value):
        return None
    return value


async def resolve(request: web.Request) -> web.Response:
    """The resolve form: the same decision, recorded the same way, as the API and CLI."""
    ctx = _ctx(request)
    session = _session(request)
    if session is None:
        return _html(render.message_page(
            "Not logged in", "Log in to resolve an operation.", None), 401)
    form = await _session_form(request, session)
    if isinstance(form, web.Response):
        return form
    if not session.can_resolve:
        return _refused(request, "You are logged in read-only: an operator resolves.", session)
    op_id = request.match_info["operation_id"]
    outcome = form.get("outcome")
    by, why = _text_field(form.get("by")), _text_field(form.get("reason"))
    if not isinstance(outcome, str) or outcome not in RESOLUTIONS:
        return _back(session, "error", f"Choose an outcome for {op_id}: "
                     f"{', '.join(RESOLUTIONS)}.")
    if by is None or why is None:
        return _back(session, "error", f"Say who decides and why (1 to {MAX_FIELD} printable "
                     f"characters each); {op_id} is unchanged.")
    session.name = by
    op = await ctx.api.ledger.get_operation(op_id)
    if op is None:
        return _back(session, "error", f"No operation {op_id}.")
    if op.state is not OpState.AMBIGUOUS:
        return _back(session, "error", f"Operation {op_id} is {op.state.value}, not ambiguous; "
                     "nothing changed.")
    try:
        target = await ctx.api.reconciler.resolve(op, outcome, by, why)
    except IllegalTransition:
        return _back(session, "error", f"Operation {op_id} changed meanwhile; nothing was "
                     "recorded. Look again.")
    except StorageError:
        return _back(session, "error", "The ledger cannot commit now; nothing was recorded. "
                     "Try again shortly.")
    ctx.data.invalidate(op.run_id)
    log.info("status page: operation %s resolved as %s by %s from %s", op_id, outcome, by,
             _address(request), extra={"operation_id": op_id, "run_id": op.run_id,
                                       "action": "status_resolve"})
    return _back(session, "ok", f"Operation {op_id} resolved as {outcome} by {by} "
                 f"(now {target.value}).")


def _back(session: Session, kind: str, message: str) -> web.Response:
    """POST-redirect-GET: the message shows once on the page the redirect leads to."""
    session.flash.append((kind, message))
    del session.flash[:-MAX_FLASH]  # forms posted without a page seen in between
    return _redirect("/#ambiguous")


async def data(request: web.Request) -> web.Response:
    session = _session(request)
    if session is None:
        response = web.Response(body=orjson.dumps({"error": "log in at /login"}), status=401,
                                content_type="application/json")
    else:
        snapshot = await _ctx(request).data.get()
        response = web.Response(body=orjson.dumps({**snapshot, "role": session.role}),
                                content_type="application/json")
    _protect(response)
    return response


async def static(request: web.Request) -> web.Response:
    item = _ctx(request).static.get(request.match_info["name"])
    if item is None:
        # No client text in the reason: a decoded %0A there is a 500 (and a forged log line).
        raise web.HTTPNotFound(reason="no such static file")
    headers = {"ETag": item.etag, "Cache-Control": "no-cache"}
    if request.headers.get("If-None-Match") == item.etag:
        response = web.Response(status=304, headers=headers)
    else:
        response = web.Response(body=item.body, content_type=item.content_type,
                                headers=headers)
    _protect(response)
    return response
