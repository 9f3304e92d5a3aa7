"""Who may call the HTTP API, on a real aiohttp server around a real SQLite ledger: the
scopes of the operator, tick, viewer and metrics tokens; recipient_ids only with the
inline source; the failure throttle per client and overall, behind trusted proxies only;
the failure metric and its log line; the headers on every answer; the Host check."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from supervisor import config as config_module
from supervisor.apiauth import Scope, authorize, requires
from supervisor.config import Config
from supervisor.model import Settlement
from supervisor.queue.courier import Courier
from supervisor.states import OpState

from .http_app import TOKEN, Api, running_api

TICK = "tick-token-for-tests-0123456789abcdef"
VIEWER = "viewer-token-for-tests-0123456789abc"
METRICS = "metrics-token-for-tests-0123456789ab"
SLOT = "2024-01-01T02:00:00+00:00"


def load(tmp_path: Path, **keys: str) -> Config:
    """The config with every token set; ``keys``: section__key overrides."""
    environ = {"CLEANUP_TRIGGER_TOKEN": TOKEN, "CLEANUP_TICK_TOKEN": TICK,
               "CLEANUP_STATUS_TOKEN": VIEWER, "CLEANUP__SERVICE__DATA_DIR": str(tmp_path),
               **{f"CLEANUP__{k.upper()}": v for k, v in keys.items()}}
    return config_module.load(None, environ=environ)


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async with running_api(load(tmp_path)) as running:
        yield running


@pytest.fixture
async def http_api(tmp_path: Path) -> AsyncIterator[Api]:
    """Candidates from an http source (nothing there: runs open, their scans fail)."""
    data_dir = tmp_path / "http"
    async with running_api(load(tmp_path, source__kind="http", service__data_dir=str(data_dir),
                                source__url="http://127.0.0.1:9/stale")) as running:
        yield running


def bearer(token: str, **more: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/json", **more}


async def call(api: Api, method: str, path: str, token: str | None, doc: Any = None,
               **headers: str) -> tuple[int, Any, dict[str, str]]:
    hdrs = bearer(token, **headers) if token is not None else headers
    body = orjson.dumps(doc) if doc is not None else None
    async with api.client.request(method, path, data=body, headers=hdrs) as resp:
        raw = await resp.read()
        assert resp.content_type == "application/json", (resp.status, raw[:200])
        return resp.status, orjson.loads(raw), dict(resp.headers)


async def ambiguous_op(api: Api) -> str:
    opened = await api.ledger.open_run("t@1", "weekly", None, {"kind": "inline"}, False)
    assert opened.run is not None
    await api.ledger.record_page(opened.run.id, ["r-1"], None, 0)
    await Courier(api.ledger, api.queue).publish(await api.ledger.unpublished(10))
    [d] = await api.queue.receive(1, 60)
    attempt = await api.ledger.begin_attempt(d.message.operation_id, "delete")
    await api.ledger.settle([Settlement(d.message.operation_id, OpState.AMBIGUOUS, d,
                                        attempt_id=attempt, outcome="ambiguous",
                                        reason="no answer")])
    return d.message.operation_id


RESOLUTION = {"outcome": "deleted", "by": "Ana", "reason": "checked at the partner"}


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# -- scopes -------------------------------------------------------------------------------


async def test_the_tick_token_opens_a_run_of_the_configured_schedule(http_api: Api) -> None:
    status, doc, _ = await call(http_api, "POST", "/v1/runs", TICK, {"scheduled_for": SLOT})
    assert status == 201
    assert doc["run"]["tick_key"] == f"weekly@{SLOT}"


async def test_the_tick_token_does_nothing_else(http_api: Api, api: Api) -> None:
    op_id = await ambiguous_op(api)
    status, doc, _ = await call(http_api, "POST", "/v1/runs", TICK,
                                {"scheduled_for": SLOT, "schedule": "adhoc"})
    assert (status, doc["error"]) == (403, "schedule: the tick token opens runs of schedule "
                                           "'weekly' only")
    # With the inline source the IDs are the run: the tick token may not send them.
    status, doc, _ = await call(api, "POST", "/v1/runs", TICK, {"recipient_ids": ["victim-1"]})
    assert status == 403
    assert doc["error"].startswith("recipient_ids: the tick token may not name recipients")
    for method, path, body in (("GET", "/v1/runs", None),
                               ("GET", f"/v1/operations/{op_id}", None),
                               ("POST", f"/v1/operations/{op_id}/resolve", RESOLUTION)):
        status, doc, _ = await call(api, method, path, TICK, body)
        assert status == 403, path
        assert doc["error"].startswith("the tick token may not"), doc
    assert (await http_api.counts())[0] == 0
    assert (await api.counts())[0] == 1  # only the ambiguous_op's run
    op = await api.ledger.get_operation(op_id)
    assert op is not None
    assert op.state is OpState.AMBIGUOUS


async def test_recipient_ids_are_refused_unless_the_source_is_inline(http_api: Api) -> None:
    for token in (TOKEN, TICK):
        status, doc, _ = await call(http_api, "POST", "/v1/runs", token,
                                    {"recipient_ids": ["victim-1"], "scheduled_for": SLOT})
        assert status == 400
        assert doc["error"] == ("recipient_ids is refused: source.kind is 'http', so the run "
                                "reads its candidates there")
    assert await http_api.counts() == (0, 0, 0)


async def test_the_operator_resolves_and_the_viewer_reads_only(api: Api) -> None:
    op_id = await ambiguous_op(api)
    status, doc, _ = await call(api, "GET", f"/v1/operations/{op_id}", VIEWER)
    assert (status, doc["state"]) == (200, "ambiguous")
    for method, path, body in (("POST", f"/v1/operations/{op_id}/resolve", RESOLUTION),
                               ("POST", "/v1/runs", {"recipient_ids": ["r-9"]})):
        status, doc, _ = await call(api, method, path, VIEWER, body)
        assert status == 403, path
        assert doc["error"].startswith("the viewer token may not"), doc
    status, doc, _ = await call(api, "POST", f"/v1/operations/{op_id}/resolve", TOKEN,
                                RESOLUTION)
    assert (status, doc["state"]) == (200, "deleted")


async def test_a_route_module_beside_the_api_uses_the_same_scope_check(tmp_path: Path) -> None:
    """What the budget API (or any other module's route) calls: one function, or the
    decorator, and the same answers."""
    async def resume(request: web.Request) -> web.Response:
        role = authorize(request, Scope.OPERATE)
        return web.json_response({"by": str(role)})

    @requires(Scope.READ)
    async def show(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    def routes(app: web.Application) -> None:
        app.router.add_post("/v1/test/resume", resume)
        app.router.add_get("/v1/test/show", show)

    async with running_api(load(tmp_path), routes) as api:
        assert (await call(api, "POST", "/v1/test/resume", TOKEN))[:2] == (200, {"by": "operator"})
        assert (await call(api, "POST", "/v1/test/resume", VIEWER))[0] == 403
        assert (await call(api, "POST", "/v1/test/resume", TICK))[0] == 403
        assert (await call(api, "POST", "/v1/test/resume", None))[0] == 401
        assert (await call(api, "GET", "/v1/test/show", VIEWER))[0] == 200
        assert (await call(api, "GET", "/v1/test/show", TICK))[0] == 403


# -- failed authentication: counted, logged, throttled -------------------------------------


async def test_failures_are_counted_by_route_template_and_then_throttled(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="supervisor.apiauth")
    route = "/v1/runs/{run_id}"
    before = sample("cleanup_auth_failures_total", route=route)
    held_before = sample("cleanup_auth_throttled_total", route="/v1/runs")
    async with running_api(load(tmp_path, service__auth_failures_per_minute="3")) as api:
        for i in range(3):
            status, _, headers = await call(api, "GET", f"/v1/runs/x%0AFORGED{i}", f"guess-{i}")
            assert status == 401
            assert headers["WWW-Authenticate"] == "Bearer"
        # The right token too, now: a throttled client's guesses are not even looked at.
        status, doc, headers = await call(api, "GET", "/v1/runs", TOKEN)
        assert status == 429
        assert 1 <= int(headers["Retry-After"]) <= 20
        assert "too many failed authentications" in doc["error"]
        # No credentials at all is no guess: its 401, even now, and it costs nothing.
        assert (await call(api, "GET", "/v1/runs", None))[0] == 401
        assert (await call(api, "GET", "/v1/runs", TOKEN))[0] == 429
    assert sample("cleanup_auth_failures_total", route=route) - before == 3
    assert sample("cleanup_auth_throttled_total", route="/v1/runs") - held_before == 2
    lines = [r.getMessage() for r in caplog.records if r.name == "supervisor.apiauth"]
    assert lines
    assert all("\n" not in line for line in lines)
    assert lines[0].startswith("authentication failed on /v1/runs/{run_id} from 127.0.0.1")
    assert not any("FORGED" in line or "guess" in line for line in lines)


async def test_the_overall_limit_holds_new_clients_not_proven_ones(tmp_path: Path) -> None:
    cfg = load(tmp_path, service__trusted_proxies='["127.0.0.1/32"]',
               service__auth_failures_per_minute="100",
               service__auth_failures_per_minute_total="3")
    async with running_api(cfg) as api:
        assert (await call(api, "GET", "/v1/runs", TOKEN,
                           **{"X-Forwarded-For": "198.51.100.1"}))[0] == 200
        for i in range(3):  # three addresses, one guess each
            status, _, _ = await call(api, "GET", "/v1/runs", "guess",
                                      **{"X-Forwarded-For": f"203.0.113.{i}"})
            assert status == 401
        status, _, headers = await call(api, "GET", "/v1/runs", TOKEN,
                                        **{"X-Forwarded-For": "203.0.113.99"})
        assert status == 429
        assert int(headers["Retry-After"]) >= 1
        # The client that proved a token before is held by its own limit only.
        assert (await call(api, "GET", "/v1/runs", TOKEN,
                           **{"X-Forwarded-For": "198.51.100.1"}))[0] == 200


async def test_x_forwarded_for_counts_only_from_a_trusted_proxy(tmp_path: Path) -> None:
    limits = {"service__auth_failures_per_minute": "2"}
    async with running_api(load(tmp_path, **limits)) as api:  # no trusted proxy
        for _ in range(2):
            await call(api, "GET", "/v1/runs", "guess", **{"X-Forwarded-For": "203.0.113.1"})
        # A header anyone can send does not make another client of the same peer.
        assert (await call(api, "GET", "/v1/runs", TOKEN,
                           **{"X-Forwarded-For": "203.0.113.2"}))[0] == 429
    cfg = load(tmp_path, service__trusted_proxies='["127.0.0.0/8", "10.0.0.0/8"]', **limits)
    async with running_api(cfg) as api:
        for _ in range(2):  # through two proxies: the client is the first untrusted hop
            await call(api, "GET", "/v1/runs", "guess",
                       **{"X-Forwarded-For": "198.51.100.7, 203.0.113.1, 10.1.2.3"})
        assert (await call(api, "GET", "/v1/runs", TOKEN,
                           **{"X-Forwarded-For": "203.0.113.1"}))[0] == 429
        assert (await call(api, "GET", "/v1/runs", TOKEN,
                           **{"X-Forwarded-For": "203.0.113.2"}))[0] == 200


async def test_an_ipv6_client_is_counted_by_its_64(tmp_path: Path) -> None:
    cfg = load(tmp_path, service__trusted_proxies='["127.0.0.1/32"]',
               service__auth_failures_per_minute="2")
    async with running_api(cfg) as api:
        for host in ("2001:db8:1:2::1", "2001:db8:1:2::ffff"):
            await call(api, "GET", "/v1/runs", "guess", **{"X-Forwarded-For": host})
        assert (await call(api, "GET", "/v1/runs", TOKEN,
                           **{"X-Forwarded-For": "2001:db8:1:2:abcd::9"}))[0] == 429
        assert (await call(api, "GET", "/v1/runs", TOKEN,
                           **{"X-Forwarded-For": "2001:db8:1:3::1"}))[0] == 200


# -- safe defaults: headers, the Host check, /metrics ----------------------------------------


async def test_every_api_answer_is_nosniff_and_no_store(api: Api) -> None:
    for method, path, token in (("GET", "/v1/runs", VIEWER), ("GET", "/v1/runs", None),
                                ("GET", "/v1/runs/nope", VIEWER), ("GET", "/healthz", None),
                                ("GET", "/openapi.json", None), ("GET", "/nowhere", None)):
        _, _, headers = await call(api, method, path, token)
        assert headers["X-Content-Type-Options"] == "nosniff", path
        assert headers["Cache-Control"] == "no-store", path
        assert "Strict-Transport-Security" not in headers  # on loopback: plain http works
    async with api.client.get("/static/status.js") as resp:
        assert resp.headers["Cache-Control"] == "no-cache"  # its own, with its ETag


async def test_hsts_when_configured(tmp_path: Path) -> None:
    async with running_api(load(tmp_path, service__hsts_seconds="600")) as api:
        _, _, headers = await call(api, "GET", "/healthz", None)
        assert headers["Strict-Transport-Security"] == "max-age=600"


@pytest.mark.parametrize("path", ["/healthz", "/metrics", "/openapi.json", "/v1/runs",
                                  "/login"])
async def test_a_rebound_host_name_is_421_on_loopback(api: Api, path: str) -> None:
    async with api.client.get(path, headers={"Host": "evil.example"}) as resp:
        assert resp.status == 421
        assert (await resp.json())["error"].startswith("this service does not answer")


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8080", "127.0.0.1:1", "[::1]:8080",
                                  "10.0.0.5"])
async def test_loopback_names_and_ip_literals_pass(api: Api, host: str) -> None:
    async with api.client.get("/healthz", headers={"Host": host}) as resp:
        assert resp.status == 200


async def test_configured_hosts_and_their_subdomains_pass(tmp_path: Path) -> None:
    async with running_api(load(tmp_path, service__allowed_hosts='[".example.com"]')) as api:
        for host, status in (("example.com", 200), ("a.b.example.com:443", 200),
                             ("example.com.evil.example", 421), ("localhost", 421)):
            async with api.client.get("/healthz", headers={"Host": host}) as resp:
                assert resp.status == status, host


async def test_metrics_are_open_unless_a_metrics_token_is_set(tmp_path: Path, api: Api) -> None:
    async with api.client.get("/metrics") as resp:
        assert resp.status == 200
    environ = {"CLEANUP_TRIGGER_TOKEN": TOKEN, "CLEANUP_TICK_TOKEN": TICK,
               "CLEANUP_STATUS_TOKEN": VIEWER, "CLEANUP_METRICS_TOKEN": METRICS,
               "CLEANUP__SERVICE__DATA_DIR": str(tmp_path / "m")}
    async with running_api(config_module.load(None, environ=environ)) as guarded:
        for token, status in ((None, 401), ("wrong", 401), (TICK, 403), (METRICS, 200),
                              (VIEWER, 200), (TOKEN, 200)):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with guarded.client.get("/metrics", headers=headers) as resp:
                assert resp.status == status, token
                if status == 200:
                    assert "cleanup_auth_failures_total" in await resp.text()
