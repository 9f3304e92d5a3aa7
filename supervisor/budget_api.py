"""The rate budget for operators: what holds the workers now, and lifting it.

* ``GET /v1/budget`` (the operator or the viewer token): the rate, the learnt and the
  announced limits, a pause in force and why, the quotas, and the latest resumes.
* ``POST /v1/budget/resume`` (the operator token, which resolves operations too) with
  ``{"by", "reason", "forget_limit"}``: lifts the pause (and the partner's spent quotas;
  with ``forget_limit`` also the limit learnt from 429s and headers) for every worker, of
  every replica on PostgreSQL (the shared row and its NOTIFY). Recorded first, in the
  ledger's ``operator_actions``, with who, why, when and what was lifted: a resume the
  ledger cannot record is not made.

The status page's form and ``cleanup-supervisor budget show|resume`` go through
:func:`show` and :func:`resume`, so all three record the same thing.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from aiohttp import web

from supervisor.apiauth import Scope, authorize
from supervisor.apistate import API, ApiError, ApiState, json_body, json_response
from supervisor.budget.base import Snapshot
from supervisor.errors import StorageError
from supervisor.model import OperatorAction
from supervisor.openapi import PRINTABLE

log = logging.getLogger(__name__)

ACTION = "budget.resume"
# The resumes shown with the budget; the table keeps every one.
RECENT_ACTIONS = 20
MAX_FIELD = 500


class Refused(ValueError):
    """A field of a resume that is not acceptable; the message names it."""


def check_field(name: str, value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value.strip()) <= MAX_FIELD or \
            not re.fullmatch(PRINTABLE, value):
        raise Refused(f"{name} must be a non-empty printable string of at most "
                      f"{MAX_FIELD} characters")
    return value.strip()


def budget_view(snapshot: Snapshot, api: ApiState, now: float) -> dict[str, Any]:
    state = snapshot.state
    return {
        "partner": api.config.partner.base_url,
        "rate_per_second": state.rate,
        "ceiling_per_second": snapshot.ceiling,
        "learnt_limit_per_second": state.w_max,
        "announced_limit_per_second": state.announced,
        "strict_pacing": state.strict,
        "paused": state.paused_until > now,
        "paused_until": state.paused_until or None,
        "pause_reason": state.pause_reason or None,
        "held_for_seconds": snapshot.held_for(now),
        "max_pause_seconds": api.config.partner.max_retry_after_seconds,
        "resumed_at": state.resumed_at or None,
        "quotas": [{"name": q.name, "limit": q.limit, "window_seconds": q.window_s,
                    "remaining": q.remaining, "resets_at": q.resets_at or None}
                   for q in snapshot.quotas],
    }


def action_view(action: OperatorAction) -> dict[str, Any]:
    return {"id": action.id, "at": action.at, "action": action.action, "by": action.by,
            "reason": action.reason, "detail": dict(action.detail)}


async def show(api: ApiState) -> dict[str, Any]:
    """The budget as it stands, with the latest resumes (newest first)."""
    assert api.budget is not None
    view = budget_view(api.budget.snapshot(), api, time.time())
    actions = await api.ledger.operator_actions(ACTION, RECENT_ACTIONS)
    view["operator_actions"] = [action_view(a) for a in actions]
    return view


async def resume(api: ApiState, by: str, reason: str, forget_limit: bool) -> dict[str, Any]:
    """Record the resume, then lift the pause (and the learnt limit) and save it. Raises
    StorageError, having changed nothing, when the ledger cannot record it."""
    budget = api.budget
    assert budget is not None
    now = time.time()
    before = budget.snapshot()
    state = before.state
    detail = {"forget_limit": forget_limit, "paused_until": state.paused_until or None,
              "pause_reason": state.pause_reason or None,
              "held_for_seconds": before.held_for(now),
              "learnt_limit_per_second": state.w_max,
              "announced_limit_per_second": state.announced}
    action = await api.ledger.record_operator_action(ACTION, by, reason, detail)
    budget.resume(forget_limit)
    await budget.save()  # on PostgreSQL: the row written, every replica told
    log.info("budget for %s resumed by %s (%s): the pause until %s lifted%s", api.config
             .partner.base_url, by, reason, state.paused_until or "none",
             ", the learnt limit forgotten" if forget_limit else "",
             extra={"action": "budget_resumed"})
    return {"action": action_view(action),
            "budget": budget_view(budget.snapshot(), api, time.time())}


async def get_budget(request: web.Request) -> web.Response:
    authorize(request, Scope.READ)
    api = request.app[API]
    if api.budget is None:
        raise ApiError(404, "no rate budget here")
    return json_response(await show(api))


async def post_resume(request: web.Request) -> web.Response:
    authorize(request, Scope.OPERATE)  # as resolve: an operator's decision
    api = request.app[API]
    if api.budget is None:
        raise ApiError(404, "no rate budget here")
    doc = await json_body(request)
    unknown = set(doc) - {"by", "reason", "forget_limit"}
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(sorted(unknown))}")
    forget = doc.get("forget_limit", False)
    if not isinstance(forget, bool):
        raise ApiError(400, "forget_limit must be true or false")
    try:
        by, why = check_field("by", doc.get("by")), check_field("reason", doc.get("reason"))
    except Refused as exc:
        raise ApiError(400, str(exc)) from None
    try:
        return json_response(await resume(api, by, why, forget))
    except StorageError:
        raise ApiError(503, "the ledger cannot record the resume now; nothing was "
                                 "changed") from None


def add_budget_routes(app: web.Application) -> None:
    app.router.add_get("/v1/budget", get_budget)
    app.router.add_post("/v1/budget/resume", post_resume)
