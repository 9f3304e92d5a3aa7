"""The bench's gateway cells (issue 20, point 6): a real nginx ``limit_req`` in front of
the partner simulator, as ``bench/gateway.py`` starts it for the long hidden-limit runs.

What the bench's figures rest on: requests pass through to the partner with their
``Idempotency-Key``; nginx refuses a second request within 1/R of the last one it let
through with a 429 (not nginx's default 503), bare or with ``Retry-After: 1`` as the cell
says; and the partner's stats, which every ratio and 429 share is read from, count the
refusals the simulator never saw. Needs Debian's nginx-light (CI installs it; without it
the case skips, or fails under ``CLEANUP_REQUIRE_NGINX=1``)."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
import pytest

import gateway
from matrix import KNOWN_CELLS
from processes import sandbox
from scenario import Scenario
from tests.helpers import eventually

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _nginx() -> None:
    why = gateway.available()
    if why:
        if os.environ.get("CLEANUP_REQUIRE_NGINX") == "1":
            pytest.fail(why)
        pytest.skip(why)


@pytest.mark.parametrize("cell", ["nginx", "nginx-retry-after"])
async def test_nginx_limits_in_front_of_the_partner(cell: str) -> None:
    # 1/s: the second of two back-to-back requests is within 1/R of the first, however
    # slow the host (a refusal needs no timing from the test).
    sc = Scenario("gateway-test", "gateway", n=20, partner_rate=1, ceiling=1,
                  cell=KNOWN_CELLS[cell])
    async with aiohttp.ClientSession() as http, sandbox(sc, http, "test") as partner:
        assert partner.api_url != partner.url
        auth = {"Authorization": f"Bearer {partner.token}"}
        async with http.get(f"{partner.url}/stale-recipients", headers=auth) as resp:
            ids = [item["id"] for item in (await resp.json())["items"]][:2]
        answers = []
        for n, rid in enumerate(ids):
            async with http.delete(f"{partner.api_url}/recipients/{rid}",
                                   headers={**auth, "Idempotency-Key": f"op-{n}"}) as resp:
                await resp.read()
                answers.append((resp.status, resp.headers.get("Retry-After")))

        async def logged() -> dict[str, int] | None:
            # nginx logs a request after it has answered it: a refusal counts once logged.
            stats = await partner.stats()
            return stats if stats["gateway_refused"] else None

        stats = await eventually(logged, 10.0, "nginx's log line of its refusal")
        async with http.get(f"{partner.url}/_sandbox/requests", headers=auth) as resp:
            arrived = await resp.json()

    assert answers[0] == (204, None), answers
    want = "1" if cell == "nginx-retry-after" else None
    assert answers[1] == (429, want), answers
    # The simulator saw the first only, with its key; the stats count both, one refused.
    assert [(r["recipient_id"], r["idempotency_key"]) for r in arrived] == [(ids[0], "op-0")]
    assert (stats["requests"], stats["rate_limited"], stats["gateway_refused"]) == (2, 1, 1)


def test_nginx_takes_whole_requests_per_second() -> None:
    with pytest.raises(ValueError, match="whole requests per second"):
        gateway.config("nginx", 20.5, 1, 2, Path("/tmp"))
    with pytest.raises(ValueError, match="unknown gateway 'envoy'"):
        gateway.config("envoy", 20, 1, 2, Path("/tmp"))
