"""The status page's HTTP surface on a real aiohttp server around a real SQLite ledger:
login and roles, the cookie, CSRF and origin checks, escaping, the resolve form's audit,
logout, and the JSON the page polls. (tests/e2e/test_status_page.py drives it in a
real browser.)"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from supervisor import config as config_module
from supervisor.config import Config
from supervisor.model import Settlement
from supervisor.queue.courier import Courier
from supervisor.states import OpState
from supervisor.status import STATUS

from .http_app import AUTH, TOKEN, Api, running_api

VIEWER = "viewer-token-for-tests-0123456789"
HOSTILE = '<img src=x onerror="alert(1)">&amp;'


def load(tmp_path: Path, service: dict[str, str] | None = None, **status: str) -> Config:
    environ = {"CLEANUP_TRIGGER_TOKEN": TOKEN, "CLEANUP_STATUS_TOKEN": VIEWER,
               "CLEANUP__SERVICE__DATA_DIR": str(tmp_path),
               "CLEANUP__SCHEDULE__DIGEST_CUTOFF_SECONDS": "3600"}
    environ.update({f"CLEANUP__STATUS__{k.upper()}": v for k, v in status.items()})
    environ.update({f"CLEANUP__SERVICE__{k.upper()}": v for k, v in (service or {}).items()})
    return config_module.load(None, environ=environ)


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with running_api(load(tmp_path)) as running:
        yield running


def origin(api: Api) -> str:
    return str(api.client.make_url("")).rstrip("/")


async def login(api: Api, token: str, headers: dict[str, str] | None = None,
                ) -> tuple[int, dict[str, str], str]:
    hdrs = {"Origin": origin(api)} if headers is None else headers
    async with api.client.post("/login", data={"token": token}, headers=hdrs,
                               allow_redirects=False) as resp:
        return resp.status, dict(resp.headers), await resp.text()


async def page(api: Api) -> tuple[int, str]:
    async with api.client.get("/", allow_redirects=False) as resp:
        return resp.status, await resp.text()


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match is not None, html[:500]
    return match.group(1)


async def post(api: Api, path: str, form: dict[str, str],
               headers: dict[str, str] | None = None) -> tuple[int, str | None, str]:
    hdrs = {"Origin": origin(api)} if headers is None else headers
    async with api.client.post(path, data=form, headers=hdrs, allow_redirects=False) as resp:
        return resp.status, resp.headers.get("Location"), await resp.text()


async def ambiguous_ops(api: Api, *recipients: str) -> list[str]:
    """Operations of a new run left ambiguous, as a consumer leaves one whose request may
    have acted."""
    opened = await api.ledger.open_run(f"t@{recipients[0]}", "weekly", None,
                                       {"kind": "inline"}, False)
    assert opened.run is not None
    await api.ledger.record_page(opened.run.id, list(recipients), None, 0)
    await Courier(api.ledger, api.queue).publish(await api.ledger.unpublished(100))
    ids = []
    for d in await api.queue.receive(len(recipients), 60):
        attempt = await api.ledger.begin_attempt(d.message.operation_id, "delete")
        await api.ledger.settle([Settlement(d.message.operation_id, OpState.AMBIGUOUS, d,
                                            attempt_id=attempt, outcome="ambiguous",
                                            reason="no answer; not resent")])
        ids.append(d.message.operation_id)
    return ids


async def state_of(api: Api, op_id: str) -> OpState:
    op = await api.ledger.get_operation(op_id)
    assert op is not None
    return op.state


# -- login -------------------------------------------------------------------------------


async def test_without_a_session_every_page_sends_to_the_login(api: Api) -> None:
    status, _ = await page(api)
    assert status == 303
    async with api.client.get("/", allow_redirects=False) as resp:
        assert resp.headers["Location"] == "/login"
    async with api.client.get("/status/data") as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]
    status, _, _ = await post(api, "/status/operations/op_x/resolve", {"csrf": "x"})
    assert status == 401


async def test_a_wrong_token_is_401_with_the_form_and_no_cookie(api: Api) -> None:
    for wrong in ("", "wrong", TOKEN + "x", TOKEN[:-1], f"Bearer {TOKEN}", "\u00ff" + TOKEN):
        status, headers, body = await login(api, wrong)
        assert status == 401, wrong
        assert "Set-Cookie" not in headers
        assert 'id="login"' in body
        assert "Wrong token." in body
    # Bytes that are not UTF-8, escaped and raw: a wrong token, not an error.
    for raw in (b"token=%FF" + TOKEN.encode(), b"token=\xff" + TOKEN.encode()):
        async with api.client.post("/login", data=raw, allow_redirects=False, headers={
                "Origin": origin(api),
                "Content-Type": "application/x-www-form-urlencoded"}) as resp:
            assert resp.status in (400, 401), raw
            assert "Set-Cookie" not in resp.headers
    assert len(api.client.app[STATUS].sessions) == 0


async def test_a_token_in_the_url_logs_nobody_in(api: Api) -> None:
    async with api.client.post(f"/login?token={TOKEN}", headers={"Origin": origin(api)},
                               allow_redirects=False) as resp:
        assert resp.status == 401
        assert "Set-Cookie" not in resp.headers
    async with api.client.get(f"/login?token={TOKEN}", allow_redirects=False) as resp:
        assert resp.status == 200  # the form, nothing else
        assert "Set-Cookie" not in resp.headers


async def test_the_session_cookie_is_httponly_strict_and_random(api: Api) -> None:
    status, headers, _ = await login(api, TOKEN)
    assert (status, headers["Location"]) == (303, "/")
    cookie = headers["Set-Cookie"]
    name, _, rest = cookie.partition("=")
    value = rest.split(";")[0]
    assert name == "cleanup_status"
    assert len(value) >= 40
    assert TOKEN not in cookie
    flags = {f.strip().lower() for f in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/", "max-age=28800"} <= flags
    assert "secure" not in flags
    # A second login makes another session: an ID known before a login is not kept.
    _, again, _ = await login(api, TOKEN)
    assert again["Set-Cookie"].partition("=")[2].split(";")[0] != value


async def test_behind_tls_the_cookie_is_secure_and_host_only(tmp_path: Path) -> None:
    async with running_api(load(tmp_path, secure_cookie="true")) as api:
        _, headers, _ = await login(api, TOKEN)
        cookie = headers["Set-Cookie"]
        assert cookie.startswith("__Host-cleanup_status=")
        flags = {f.strip().lower() for f in cookie.split(";")[1:]}
        assert {"secure", "httponly", "samesite=strict", "path=/"} <= flags
        assert not any(f.startswith("domain") for f in flags)


@pytest.mark.parametrize(("headers", "expected"), [
    ({}, 403),
    ({"Origin": "http://evil.example"}, 403),
    ({"Origin": "null"}, 403),
    ({"Referer": "http://evil.example/x"}, 403),
])
async def test_a_login_from_another_origin_is_refused(api: Api, headers: dict[str, str],
                                                      expected: int) -> None:
    status, got, _ = await login(api, TOKEN, headers)
    assert status == expected
    assert "Set-Cookie" not in got


async def test_a_same_origin_referer_stands_in_for_a_missing_origin(api: Api) -> None:
    status, _, _ = await login(api, TOKEN, {"Referer": origin(api) + "/login"})
    assert status == 303


async def test_a_configured_origin_is_the_one_accepted(tmp_path: Path) -> None:
    async with running_api(load(tmp_path, origin="https://cleanup.example.com")) as api:
        assert (await login(api, TOKEN))[0] == 403  # the Host header no longer counts
        assert (await login(api, TOKEN, {"Origin": "https://cleanup.example.com"}))[0] == 303


async def test_failed_logins_are_throttled_per_address(tmp_path: Path) -> None:
    async with running_api(load(tmp_path, {"auth_failures_per_minute": "3"})) as api:
        for _ in range(3):
            assert (await login(api, "wrong"))[0] == 401
        status, headers, body = await login(api, TOKEN)  # even the right one, for now
        assert status == 429
        assert 1 <= int(headers["Retry-After"]) <= 60
        assert "Set-Cookie" not in headers
        assert "Too many failed logins" in body


async def test_login_and_api_failures_share_one_throttle(tmp_path: Path) -> None:
    async with running_api(load(tmp_path, {"auth_failures_per_minute": "3"})) as api:
        for _ in range(2):
            async with api.client.get("/v1/runs", headers={"Authorization": "Bearer x"}) as r:
                assert r.status == 401
        assert (await login(api, "wrong"))[0] == 401
        assert (await login(api, TOKEN))[0] == 429  # the third failure was the form's


async def test_the_tick_token_logs_nobody_in(tmp_path: Path) -> None:
    tick = "tick-token-for-tests-0123456789abcdef"
    environ = {"CLEANUP_TRIGGER_TOKEN": TOKEN, "CLEANUP_TICK_TOKEN": tick,
               "CLEANUP__SERVICE__DATA_DIR": str(tmp_path)}
    async with running_api(config_module.load(None, environ=environ)) as api:
        status, headers, body = await login(api, tick)
        assert status == 403
        assert "Set-Cookie" not in headers
        assert "tick token logs nobody in" in body


async def test_a_viewers_logins_cannot_log_an_operator_out(api: Api) -> None:
    api.client.app[STATUS].sessions.max_sessions = 5  # the cap per role, made small
    assert (await login(api, TOKEN))[0] == 303
    # A script logging in again and again, with no cookie to give back each time.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as other:
        for _ in range(20):
            async with other.post(api.client.make_url("/login"), data={"token": VIEWER},
                                  headers={"Origin": origin(api)},
                                  allow_redirects=False) as resp:
                assert resp.status == 303
    assert (await page(api))[0] == 200  # the operator is still logged in
    assert len(api.client.app[STATUS].sessions) == 6


@pytest.mark.parametrize("headers", [
    {"Origin": "http://["}, {"Referer": "http://[::1"}, {"Origin": "http://[::1]x:80"},
    {"Origin": "null", "Referer": "https://[/login"},
])
async def test_a_malformed_origin_or_referer_is_refused_not_a_500(api: Api,
                                                                   headers: dict[str, str]
                                                                   ) -> None:
    status, got, body = await login(api, TOKEN, headers)
    assert status == 403, body
    assert "Set-Cookie" not in got


async def test_an_origin_that_is_not_utf8_is_refused_not_a_500(tmp_path: Path) -> None:
    async with running_api(load(tmp_path, origin="https://cleanup.example.com")) as api:
        # Raw bytes on the wire: aiohttp hands a non-UTF-8 header over as lone surrogates.
        reader, writer = await asyncio.open_connection(api.client.host, api.client.port)
        try:
            writer.write(b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Origin: https://cleanup.example.com\xff\r\n"
                         b"Content-Type: application/x-www-form-urlencoded\r\n"
                         b"Content-Length: 7\r\nConnection: close\r\n\r\ntoken=x")
            await writer.drain()
            status_line = await reader.readline()
        finally:
            writer.close()
        assert status_line.split()[1] == b"403", status_line


async def test_a_static_path_with_a_newline_is_404_and_forges_no_log_line(
        api: Api, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with api.client.get("/static/x%0AINFO%20operator%20logged%20in") as resp:
        assert resp.status == 404
        assert resp.reason == "Not Found"
        assert "\n" not in (await resp.text())
    assert not any("\n" in r.getMessage() for r in caplog.records)
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)


async def test_a_refusal_logs_the_path_escaped(api: Api, caplog: pytest.LogCaptureFixture
                                               ) -> None:
    await login(api, VIEWER)
    caplog.set_level(logging.WARNING, logger="supervisor.status.page")
    csrf = csrf_of((await page(api))[1])
    status, _, _ = await post(api, "/status/operations/x%0AFORGED/resolve",
                              {"csrf": csrf, "outcome": "deleted", "by": "V", "reason": "r"})
    assert status == 403
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert "\n" not in line
    assert "x\\nFORGED" in line


async def test_a_session_cookie_grants_nothing_on_the_api(api: Api) -> None:
    await login(api, TOKEN)
    async with api.client.get("/v1/runs") as resp:
        assert resp.status == 401  # the JSON API wants its bearer token, cookie or not


# -- the page ----------------------------------------------------------------------------


async def test_the_page_is_locked_down_by_its_headers(api: Api) -> None:
    await login(api, TOKEN)
    for path in ("/", "/login", "/status/data", "/static/status.js"):
        async with api.client.get(path) as resp:
            assert resp.status == 200, path
            csp = resp.headers["Content-Security-Policy"]
            assert csp.startswith("default-src 'self'"), path
            assert "unsafe-inline" not in csp
            assert "frame-ancestors 'none'" in csp
            assert resp.headers["X-Content-Type-Options"] == "nosniff"
            assert resp.headers["X-Frame-Options"] == "DENY"
    async with api.client.get("/") as resp:
        html = await resp.text()
        assert resp.headers["Cache-Control"] == "no-store"
    # Nothing from elsewhere, nothing inline: every script and stylesheet is /static.
    assert not re.search(r"(src|href)=\"(https?:)?//", html)
    assert "<script>" not in html
    assert "style=" not in html


async def test_static_files_are_served_with_validators(api: Api) -> None:
    for name, ctype in (("status.js", "text/javascript"), ("status.css", "text/css"),
                        ("favicon.svg", "image/svg+xml")):
        async with api.client.get(f"/static/{name}") as resp:
            assert (resp.status, resp.content_type) == (200, ctype)
            etag = resp.headers["ETag"]
        async with api.client.get(f"/static/{name}", headers={"If-None-Match": etag}) as resp:
            assert resp.status == 304
    for name in ("missing.js", "..%2Fpage.py", "%2e%2e%2f__init__.py"):
        async with api.client.get(f"/static/{name}") as resp:
            assert resp.status == 404


async def test_values_from_outside_are_escaped(api: Api) -> None:
    [op_id] = await ambiguous_ops(api, HOSTILE)
    await login(api, TOKEN)
    status, html = await page(api)
    assert status == 200
    assert HOSTILE not in html
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;amp;" in html
    assert f'data-operation="{op_id}"' in html
    async with api.client.get("/status/data") as resp:
        assert resp.content_type == "application/json"


async def test_the_data_counts_the_current_run_against_the_cutoff(api: Api) -> None:
    await ambiguous_ops(api, "r-1", "r-2")
    await login(api, TOKEN)
    async with api.client.get("/status/data") as resp:
        doc = await resp.json()
    current = doc["current"]
    assert doc["role"] == "operator"
    assert doc["ambiguous"] == 2
    assert current["counts"] == {"deleted": 0, "already_absent": 0, "failed": 0, "ambiguous": 2}
    assert (current["discovered"], current["settled"], current["unfinished"]) == (2, 2, 0)
    assert current["cutoff"] == pytest.approx(current["created_at"] + 3600)
    assert current["fields"]["ambiguous"] == "2"
    assert [r["id"] for r in doc["runs"]] == [current["id"]]


# -- the resolve form --------------------------------------------------------------------


async def test_an_operator_resolves_with_who_and_why_recorded(api: Api) -> None:
    [op_id] = await ambiguous_ops(api, "r-1")
    await login(api, TOKEN)
    csrf = csrf_of((await page(api))[1])
    status, location, _ = await post(api, f"/status/operations/{op_id}/resolve", {
        "csrf": csrf, "outcome": "already_absent", "by": "Ada", "reason": "gone at the partner"})
    assert (status, location) == (303, "/#ambiguous")
    op = await api.ledger.get_operation(op_id)
    assert op is not None
    assert (op.state, op.reason) == (OpState.ALREADY_ABSENT,
                                     "resolved by operator Ada: gone at the partner")
    last = (await api.ledger.attempts(op_id))[-1]
    assert (last.kind, last.detail) == ("operator", "operator Ada: gone at the partner")
    # The API reads the same record the CLI's resolution leaves.
    async with api.client.get(f"/v1/operations/{op_id}", headers=AUTH) as resp:
        doc = orjson.loads(await resp.read())
    assert doc["state"] == "already_absent"
    _, html = await page(api)
    assert f"Operation {op_id} resolved as already_absent by Ada" in html
    assert f'data-operation="{op_id}"' not in html
    # The message shows once.
    assert "resolved as already_absent" not in (await page(api))[1]


@pytest.mark.parametrize(("form", "message"), [
    ({"outcome": "deleted", "by": "Ada"}, "Say who decides and why"),
    ({"outcome": "deleted", "by": " ", "reason": "x"}, "Say who decides and why"),
    ({"outcome": "deleted", "by": "Ada", "reason": "x" * 501}, "Say who decides and why"),
    ({"outcome": "deleted", "by": "Ada\x07", "reason": "x"}, "Say who decides and why"),
    ({"outcome": "gone", "by": "Ada", "reason": "x"}, "Choose an outcome"),
    ({"by": "Ada", "reason": "x"}, "Choose an outcome"),
])
async def test_an_incomplete_form_changes_nothing(api: Api, form: dict[str, str],
                                                  message: str) -> None:
    [op_id] = await ambiguous_ops(api, "r-1")
    await login(api, TOKEN)
    csrf = csrf_of((await page(api))[1])
    status, location, _ = await post(api, f"/status/operations/{op_id}/resolve",
                                     {"csrf": csrf, **form})
    assert (status, location) == (303, "/#ambiguous")
    assert await state_of(api, op_id) is OpState.AMBIGUOUS
    assert message in (await page(api))[1]


async def test_a_settled_or_unknown_operation_is_not_resolved_again(api: Api) -> None:
    [op_id] = await ambiguous_ops(api, "r-1")
    await login(api, TOKEN)
    csrf = csrf_of((await page(api))[1])
    form = {"csrf": csrf, "outcome": "deleted", "by": "Ada", "reason": "x"}
    assert (await post(api, f"/status/operations/{op_id}/resolve", form))[0] == 303
    assert (await post(api, f"/status/operations/{op_id}/resolve",
                       {**form, "outcome": "failed"}))[0] == 303
    assert await state_of(api, op_id) is OpState.DELETED
    assert "is deleted, not ambiguous" in (await page(api))[1]
    assert (await post(api, "/status/operations/op_none/resolve", form))[0] == 303
    assert "No operation op_none" in (await page(api))[1]


@pytest.mark.parametrize("forgery", ["no csrf", "wrong csrf", "other origin", "no origin"])
async def test_a_forged_form_is_refused(api: Api, forgery: str) -> None:
    [op_id] = await ambiguous_ops(api, "r-1")
    await login(api, TOKEN)
    csrf = csrf_of((await page(api))[1])
    form: dict[str, Any] = {"outcome": "deleted", "by": "Mallory", "reason": "x", "csrf": csrf}
    headers = {"Origin": origin(api)}
    if forgery == "no csrf":
        del form["csrf"]
    elif forgery == "wrong csrf":
        form["csrf"] = csrf[::-1]
    elif forgery == "other origin":
        headers = {"Origin": "http://evil.example"}
    else:
        headers = {}
    status, _, body = await post(api, f"/status/operations/{op_id}/resolve", form, headers)
    assert status == 403
    assert "Refused" in body
    assert await state_of(api, op_id) is OpState.AMBIGUOUS


async def test_a_viewer_sees_but_cannot_resolve(api: Api) -> None:
    [op_id] = await ambiguous_ops(api, "r-1")
    assert (await login(api, VIEWER))[0] == 303
    _, html = await page(api)
    assert 'id="role">viewer<' in html
    assert f'data-operation="{op_id}"' in html
    assert 'class="resolve"' not in html
    assert "read-only" in html
    status, _, _ = await post(api, f"/status/operations/{op_id}/resolve", {
        "csrf": csrf_of(html), "outcome": "deleted", "by": "V", "reason": "x"})
    assert status == 403
    assert await state_of(api, op_id) is OpState.AMBIGUOUS


async def test_without_a_read_only_token_only_operators_log_in(tmp_path: Path) -> None:
    cfg = config_module.load(None, environ={"CLEANUP_TRIGGER_TOKEN": TOKEN,
                                            "CLEANUP__SERVICE__DATA_DIR": str(tmp_path)})
    assert cfg.status.token is None
    async with running_api(cfg) as api:
        assert (await login(api, VIEWER))[0] == 401
        assert (await login(api, "\x00"))[0] == 401
        assert (await login(api, TOKEN))[0] == 303


# -- logout, and switching the page off ---------------------------------------------------


async def test_logout_needs_the_csrf_token_and_ends_the_session(api: Api) -> None:
    await login(api, TOKEN)
    csrf = csrf_of((await page(api))[1])
    assert (await post(api, "/logout", {"csrf": "wrong"}))[0] == 403
    assert (await page(api))[0] == 200  # still logged in
    status, location, _ = await post(api, "/logout", {"csrf": csrf})
    assert (status, location) == (303, "/login")
    assert len(api.client.app[STATUS].sessions) == 0
    assert (await page(api))[0] == 303


async def test_an_expired_session_is_logged_out(api: Api) -> None:
    await login(api, TOKEN)
    sessions = api.client.app[STATUS].sessions
    now = sessions.clock()
    sessions.clock = lambda: now + sessions.lifetime_s
    assert (await page(api))[0] == 303


async def test_the_page_can_be_switched_off(tmp_path: Path) -> None:
    async with running_api(load(tmp_path, enabled="false")) as api:
        for method, path in (("GET", "/"), ("GET", "/login"), ("POST", "/login"),
                             ("GET", "/status/data"), ("GET", "/static/status.js")):
            async with api.client.request(method, path, allow_redirects=False) as resp:
                assert resp.status in (404, 405), path
        async with api.client.get("/healthz") as resp:
            assert resp.status == 200
