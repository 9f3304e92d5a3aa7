"""An operator sees and lifts the rate budget's pause: ``GET /v1/budget``, ``POST
/v1/budget/resume``, the status page's form and ``cleanup-supervisor budget``, on a real
aiohttp server around a real SQLite ledger and a real LocalBudget (its memory in that
ledger). Each resume leaves one audit row; a refused one leaves none."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from supervisor import cli
from supervisor.budget.base import Feedback, Outcome, Policy

from .http_app import AUTH, TOKEN, Api, running_api
from .test_status_http import VIEWER, csrf_of, load, login, origin, page, post

LONG = 1.8e12  # a reset in epoch milliseconds once read as seconds


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with running_api(load(tmp_path)) as running:
        yield running


async def audit_rows(api: Api) -> int:
    row = await api.db.read_one("SELECT COUNT(*) FROM operator_actions")
    assert row is not None
    return int(row[0])


def paused(api: Api) -> None:
    """A pause and a learnt limit, as a partner's 429 and a spent quota leave them."""
    api.budget.pause(time.time() + LONG, "quota x-ratelimit exhausted")


async def call(api: Api, method: str, path: str, body: Any = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    kwargs: dict[str, Any] = {"headers": AUTH if headers is None else headers}
    if body is not None:
        kwargs["data"] = orjson.dumps(body)
        kwargs["headers"] = {**kwargs["headers"], "Content-Type": "application/json"}
    async with api.client.request(method, path, **kwargs) as resp:
        return resp.status, orjson.loads(await resp.read() or b"null")


async def test_the_budget_shows_the_pause_bounded_and_why(api: Api) -> None:
    paused(api)
    status, doc = await call(api, "GET", "/v1/budget",
                             headers={"Authorization": f"Bearer {VIEWER}"})
    assert status == 200, doc
    assert doc["paused"] is True
    assert doc["pause_reason"] == "quota x-ratelimit exhausted"
    # Clamped: never longer than partner.max_retry_after_seconds.
    assert doc["paused_until"] <= time.time() + doc["max_pause_seconds"]
    assert 0 < doc["held_for_seconds"] <= 900
    assert doc["operator_actions"] == []


@pytest.mark.parametrize(("headers", "refusal"), [
    ({}, 401), ({"Authorization": "Bearer wrong"}, 401),
    ({"Authorization": f"Bearer {VIEWER}"}, 403)])  # known, but not allowed to
async def test_a_resume_without_the_operator_token_is_refused_and_changes_nothing(
        api: Api, headers: dict[str, str], refusal: int) -> None:
    paused(api)
    status, doc = await call(api, "POST", "/v1/budget/resume",
                             {"by": "mallory", "reason": "go"}, headers=headers)
    assert status == refusal, doc
    assert api.budget.snapshot().paused_until > time.time()
    assert await audit_rows(api) == 0


async def test_the_budget_needs_a_token_to_be_read(api: Api) -> None:
    status, _ = await call(api, "GET", "/v1/budget", headers={})
    assert status == 401


@pytest.mark.parametrize(("body", "field"), [
    ({"reason": "why"}, "by"),
    ({"by": "ana"}, "reason"),
    ({"by": "", "reason": "why"}, "by"),
    ({"by": "ana", "reason": "a\nforged line"}, "reason"),
    ({"by": "ana", "reason": "x" * 501}, "reason"),
    ({"by": "ana", "reason": "why", "forget_limit": "yes"}, "forget_limit"),
    ({"by": "ana", "reason": "why", "until": 0}, "until"),
])
async def test_a_bad_resume_names_its_field_and_changes_nothing(
        api: Api, body: dict[str, Any], field: str) -> None:
    paused(api)
    status, doc = await call(api, "POST", "/v1/budget/resume", body)
    assert status == 400, doc
    assert field in doc["error"]
    assert api.budget.snapshot().paused_until > time.time()
    assert await audit_rows(api) == 0


async def test_a_resume_lifts_the_pause_records_who_and_why_and_workers_go_on(
        api: Api) -> None:
    api.budget.release(await api.budget.acquire(),
                       Feedback(Outcome.THROTTLED, 0.001, retry_after_s=1.0))
    learnt = api.budget.snapshot().state.w_max
    assert learnt is not None
    paused(api)
    worker = asyncio.ensure_future(api.budget.acquire())  # a worker waiting on the pause
    done, _ = await asyncio.wait([worker], timeout=0.1)
    assert not done
    status, doc = await call(api, "POST", "/v1/budget/resume",
                             {"by": "ana", "reason": "the partner confirmed the reset",
                              "forget_limit": True})
    assert status == 200, doc
    api.budget.release(await asyncio.wait_for(worker, 3.0), Feedback(Outcome.OK, 0.001))
    assert doc["budget"]["paused"] is False
    assert doc["budget"]["learnt_limit_per_second"] is None
    action = doc["action"]
    assert (action["action"], action["by"], action["reason"]) == (
        "budget.resume", "ana", "the partner confirmed the reset")
    assert action["detail"]["forget_limit"] is True
    assert action["detail"]["learnt_limit_per_second"] == pytest.approx(learnt)
    assert action["detail"]["pause_reason"] == "quota x-ratelimit exhausted"
    assert await audit_rows(api) == 1
    # Saved: the next life starts unpaused.
    memory = await api.ledger.load_budget("test")
    assert memory is not None
    assert memory["state"]["paused_until"] == 0.0
    status, shown = await call(api, "GET", "/v1/budget")
    assert status == 200
    assert [a["id"] for a in shown["operator_actions"]] == [action["id"]]


async def test_a_resume_lifts_a_spent_announced_quota_too(api: Api) -> None:
    spent = Policy("day", 5000, 86400.0, remaining=0, reset_s=600.0)
    api.budget.release(await api.budget.acquire(),
                       Feedback(Outcome.OK, 0.001, policies=(spent,)))
    assert api.budget.snapshot().held_for(time.time()) > 500
    status, doc = await call(api, "POST", "/v1/budget/resume", {"by": "ana", "reason": "x"})
    assert status == 200, doc
    assert doc["budget"]["held_for_seconds"] == 0.0


# -- the status page's form ---------------------------------------------------------------


async def test_an_operator_lifts_the_pause_from_the_status_page(api: Api) -> None:
    paused(api)
    assert (await login(api, TOKEN))[0] == 303
    status, html = await page(api)
    assert status == 200
    assert 'id="budget"' in html
    assert "quota x-ratelimit exhausted" in html
    form = {"csrf": csrf_of(html), "by": "ana", "reason": "checked with the partner",
            "forget_limit": "1"}
    status, location, _ = await post(api, "/status/budget/resume", form)
    assert (status, location) == (303, "/#budget")
    assert api.budget.snapshot().paused_until == 0.0
    assert await audit_rows(api) == 1
    _, html = await page(api)
    assert re.search(r'class="flash ok budget"[^>]*>Resumed by ana', html)
    assert "checked with the partner" in html  # the resume, listed


@pytest.mark.parametrize("forgery", ["no csrf", "wrong csrf", "other origin"])
async def test_a_forged_resume_form_is_refused(api: Api, forgery: str) -> None:
    paused(api)
    await login(api, TOKEN)
    _, html = await page(api)
    form = {"csrf": csrf_of(html), "by": "ana", "reason": "x"}
    headers = {"Origin": origin(api)}
    if forgery == "no csrf":
        del form["csrf"]
    elif forgery == "wrong csrf":
        form["csrf"] = "0" * 43
    else:
        headers = {"Origin": "https://evil.example"}
    status, _, _ = await post(api, "/status/budget/resume", form, headers)
    assert status == 403
    assert api.budget.snapshot().paused_until > time.time()
    assert await audit_rows(api) == 0


async def test_a_viewer_sees_the_budget_but_cannot_lift_it(api: Api) -> None:
    paused(api)
    await login(api, VIEWER)
    _, html = await page(api)
    assert 'id="budget"' in html
    assert 'action="/status/budget/resume"' not in html
    status, _, _ = await post(api, "/status/budget/resume",
                              {"csrf": csrf_of(html), "by": "v", "reason": "x"})
    assert status == 403
    assert await audit_rows(api) == 0


async def test_without_a_session_the_form_is_401(api: Api) -> None:
    status, _, _ = await post(api, "/status/budget/resume", {"by": "a", "reason": "b"})
    assert status == 401


# -- the command line ---------------------------------------------------------------------


async def test_budget_show_and_resume_from_the_command_line(
        api: Api, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    paused(api)
    url = origin(api)
    monkeypatch.setenv("CLEANUP_TRIGGER_TOKEN", TOKEN)

    def run(*argv: str) -> tuple[int, Any]:
        code = cli.main(list(argv))
        return code, orjson.loads(capsys.readouterr().out)

    # The command runs its own event loop: off this test's loop, in a thread.
    code, shown = await asyncio.to_thread(run, "budget", "show", "--url", url)
    assert code == 0
    assert shown["paused"] is True
    code, done = await asyncio.to_thread(run, "budget", "resume", "--url", url, "--by", "ana",
                                         "--reason", "from the shell", "--forget-limit")
    assert code == 0
    assert (done["action"]["by"], done["action"]["detail"]["forget_limit"]) == ("ana", True)
    assert api.budget.snapshot().paused_until == 0.0
    assert await audit_rows(api) == 1
    assert await asyncio.to_thread(cli.main, ["budget", "resume", "--url", url]) == 2
    monkeypatch.setenv("CLEANUP_TRIGGER_TOKEN", "wrong")
    code, refused = await asyncio.to_thread(run, "budget", "resume", "--url", url,
                                            "--by", "m", "--reason", "x")
    assert code != 0
    assert "token" in refused["error"]
