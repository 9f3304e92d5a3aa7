"""The status page's resume form: ``POST /status/budget/resume``, the same decision,
recorded the same way, as ``POST /v1/budget/resume`` and ``cleanup-supervisor budget
resume`` (supervisor/budget_api.py). Checked as the resolve form is: a session (401), the
page's own origin and the session's CSRF token (403), the operator role (403)."""

from __future__ import annotations

import logging

from aiohttp import web

from supervisor import budget_api
from supervisor.errors import StorageError
from supervisor.status.auth import Session
from supervisor.status.page import (
    MAX_FIELD,
    MAX_FLASH,
    _address,
    _ctx,
    _html,
    _redirect,
    _refused,
    _session,
    _session_form,
    _text_field,
)
from supervisor.status.render import BUDGET_FLASH, message_page

log = logging.getLogger(__name__)


async def resume(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    session = _session(request)
    if session is None:
        return _html(message_page("Not logged in", "Log in to lift a pause.", None), 401)
    form = await _session_form(request, session)
    if isinstance(form, web.Response):
        return form
    if not session.can_resolve:
        return _refused(request, "You are logged in read-only: an operator lifts a pause.",
                        session)
    if ctx.api.budget is None:
        return _back(session, "error", "There is no rate budget here.")
    by, why = _text_field(form.get("by")), _text_field(form.get("reason"))
    if by is None or why is None:
        return _back(session, "error", f"Say who decides and why (1 to {MAX_FIELD} printable "
                     "characters each); the budget is unchanged.")
    session.name = by
    forget = form.get("forget_limit") is not None
    try:
        done = await budget_api.resume(ctx.api, by, why, forget)
    except StorageError:
        return _back(session, "error", "The ledger cannot record it now; nothing was "
                     "changed. Try again shortly.")
    log.info("status page: budget resumed by %s from %s", by, _address(request),
             extra={"action": "status_budget_resume"})
    lifted = done["action"]["detail"].get("paused_until")
    return _back(session, "ok", "Resumed by " + by + (
        " (the pause was lifted" if lifted else " (nothing was paused") + (
        "; the learnt limit is forgotten)." if forget else ")."))


def _back(session: Session, kind: str, message: str) -> web.Response:
    session.flash.append((f"{kind} {BUDGET_FLASH}", message))
    del session.flash[:-MAX_FLASH]
    return _redirect("/#budget")
