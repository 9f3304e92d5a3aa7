"""PartnerClient against the real sandbox over loopback: every verdict, and the one-execution
guarantee when a connection drops after the partner acted."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from cleanup_sandbox import RunningSandbox, SandboxConfig, run_sandbox
from supervisor.config import PartnerConfig
from supervisor.configtypes import Secret
from supervisor.partner import PartnerClient, Presence, Verdict


@asynccontextmanager
async def partner(sandbox: dict[str, Any] | None = None,
                  **config: Any) -> AsyncIterator[tuple[RunningSandbox, PartnerClient]]:
    async with run_sandbox(SandboxConfig(**(sandbox or {}))) as sb:
        client = PartnerClient(PartnerConfig(base_url=sb.url, **config), pool_size=4)
        await client.start()
        try:
            yield sb, client
        finally:
            await client.close()


def present(sb: RunningSandbox) -> list[str]:
    return [r for r in sb.state.population if sb.state.is_present(r)]


def absent(sb: RunningSandbox) -> list[str]:
    return [r for r in sb.state.population if not sb.state.is_present(r)]


async def test_204_is_deleted_and_the_idempotency_key_is_sent() -> None:
    async with partner() as (sb, client):
        rid = present(sb)[0]
        answer = await client.delete(rid, "op_key_1")
        assert answer.verdict is Verdict.DELETED
        assert answer.status == 204
        assert answer.detail == "HTTP 204"
        assert answer.elapsed_s >= 0
        assert [(e.recipient_id, e.idempotency_key) for e in sb.state.log] == [(rid, "op_key_1")]


async def test_replay_with_the_same_key_is_deleted_replayed_without_a_second_execution() -> None:
    async with partner() as (sb, client):
        rid = present(sb)[0]
        assert (await client.delete(rid, "op_key_1")).verdict is Verdict.DELETED
        again = await client.delete(rid, "op_key_1")
        assert again.verdict is Verdict.DELETED
        assert again.detail == "HTTP 204 (replayed)"
        assert sb.state.stats()["executions"] == 1
        assert sb.state.stats()["replays"] == 1


async def test_no_key_when_the_partner_does_not_honour_keys() -> None:
    async with partner(idempotency_keys=False) as (sb, client):
        await client.delete(present(sb)[0], "op_key_1")
        assert sb.state.log[0].idempotency_key is None


async def test_404_is_absent() -> None:
    async with partner() as (sb, client):
        answer = await client.delete(absent(sb)[0], "k")
        assert (answer.verdict, answer.status) == (Verdict.ABSENT, 404)
        unknown = await client.delete("never-existed", "k2")
        assert unknown.verdict is Verdict.ABSENT


async def test_429_is_throttled_with_retry_after_seconds() -> None:
    async with partner({"rate_per_second": 0.5, "burst": 1}) as (sb, client):
        ids = present(sb)
        assert (await client.delete(ids[0], "k1")).verdict is Verdict.DELETED
        answer = await client.delete(ids[1], "k2")
        assert (answer.verdict, answer.status) == (Verdict.THROTTLED, 429)
        assert answer.retry_after_s is not None
        assert 1.0 <= answer.retry_after_s <= 2.0
        assert sb.state.stats()["executions"] == 1


async def test_429_with_an_http_date_retry_after() -> None:
    async with partner({"rate_per_second": 0.5, "burst": 1,
                        "retry_after_format": "http-date"}) as (sb, client):
        ids = present(sb)
        await client.delete(ids[0], "k1")
        answer = await client.delete(ids[1], "k2")
        assert answer.verdict is Verdict.THROTTLED
        assert answer.retry_after_s is not None
        assert 0.0 <= answer.retry_after_s <= 4.0


async def test_retry_after_is_clamped_to_the_configured_maximum() -> None:
    async with partner(max_retry_after_seconds=5.0) as (sb, client):
        sb.state.apply_control({"pause_seconds": 3600})
        answer = await client.delete(present(sb)[0], "k")
        assert answer.verdict is Verdict.THROTTLED
        assert answer.retry_after_s == 5.0


async def test_503_is_transient_and_did_not_act() -> None:
    async with partner({"fault_5xx": 1.0}) as (sb, client):
        rid = present(sb)[0]
        answer = await client.delete(rid, "k")
        assert (answer.verdict, answer.status) == (Verdict.TRANSIENT, 503)
        assert sb.state.stats()["executions"] == 0
        assert sb.state.is_present(rid)


async def test_wrong_token_is_terminal_and_right_token_works() -> None:
    async with partner({"token": "p-secret"}, token=Secret("wrong")) as (sb, client):
        answer = await client.delete(present(sb)[0], "k")
        assert (answer.verdict, answer.status) == (Verdict.TERMINAL, 401)
    async with partner({"token": "p-secret"}, token=Secret("p-secret")) as (sb, client):
        assert (await client.delete(present(sb)[0], "k")).verdict is Verdict.DELETED


@contextmanager
def refusing_port() -> Iterator[int]:
    """A port bound but not listening: every connect is refused, deterministically."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


async def test_connection_refused_is_transient() -> None:
    with refusing_port() as port:
        client = PartnerClient(PartnerConfig(base_url=f"http://127.0.0.1:{port}"), pool_size=1)
        await client.start()
        try:
            answer = await client.delete("r-000001", "k")
            assert answer.verdict is Verdict.TRANSIENT
            assert answer.status is None
            assert answer.detail.startswith("connect failed")
            presence, detail = await client.probe("r-000001")
            assert presence is Presence.UNKNOWN
            assert detail.startswith("probe failed")
        finally:
            await client.close()


async def test_timeout_after_the_partner_acted_is_ambiguous() -> None:
    async with partner({"fault_timeout_after_act": 1.0, "hang_seconds": 30},
                       request_timeout_seconds=0.3) as (sb, client):
        rid = present(sb)[0]
        answer = await client.delete(rid, "k")
        assert answer.verdict is Verdict.AMBIGUOUS
        assert answer.status is None
        assert answer.detail.startswith("no answer")
        assert sb.state.executions_of(rid) == 1
        assert not sb.state.is_present(rid)  # it did act: exactly why this is ambiguous


async def test_reset_after_act_is_ambiguous_and_never_resent_by_aiohttp() -> None:
    """aiohttp resends an idempotent method once when a connection drops mid-request;
    PartnerClient.start() switches that off. Against a partner that ignores keys, a resend
    would be a second execution of the same deletion behind the ledger's back."""
    async with partner({"honour_idempotency_keys": False}) as (sb, client):
        ids = present(sb)
        # Warm the pool so the next request goes out on a reused keep-alive connection.
        assert (await client.delete(ids[0], "k0")).verdict is Verdict.DELETED
        sb.state.apply_control({"fault_reset_after_act": 1.0})
        answer = await client.delete(ids[1], "k1")
        assert answer.verdict is Verdict.AMBIGUOUS
        assert answer.detail.startswith("no answer")
        assert sb.state.executions_of(ids[1]) == 1
        assert sb.state.stats()["requests"] == 2


async def test_after_a_reset_the_same_key_replays_the_first_answer() -> None:
    async with partner() as (sb, client):
        rid = present(sb)[0]
        sb.state.apply_control({"fault_reset_after_act": 1.0})
        assert (await client.delete(rid, "k1")).verdict is Verdict.AMBIGUOUS
        assert sb.state.stats()["requests"] == 1  # not resent
        sb.state.apply_control({"fault_reset_after_act": 0.0})
        again = await client.delete(rid, "k1")
        assert (again.verdict, again.detail) == (Verdict.DELETED, "HTTP 204 (replayed)")
        assert sb.state.executions_of(rid) == 1


async def test_recipient_ids_reach_the_partner_intact() -> None:
    async with partner() as (sb, client):
        for rid in ["a/b", "..", ".", "../../admin", "ünïcødé", "a b?c#d"]:
            answer = await client.delete(rid, f"key-{len(sb.state.log)}")
            assert answer.verdict is Verdict.ABSENT, (rid, answer)
        assert [e.recipient_id for e in sb.state.log] == [
            "a/b", "..", ".", "../../admin", "ünïcødé", "a b?c#d"]


async def test_probe() -> None:
    async with partner() as (sb, client):
        assert (await client.probe(present(sb)[0]))[0] is Presence.PRESENT
        presence, detail = await client.probe(absent(sb)[0])
        assert (presence, detail) == (Presence.ABSENT, "probe HTTP 404")
    async with partner(probe_path="") as (sb, client):
        assert await client.probe(present(sb)[0]) == (Presence.UNKNOWN, "no probe configured")
    async with partner({"token": "t"}) as (sb, client):
        assert await client.probe(present(sb)[0]) == (Presence.UNKNOWN, "probe HTTP 401")


async def test_the_budget_is_told_when_a_request_leaves_and_only_then() -> None:
    # Strict pacing counts from departures: each request whose headers were written is
    # one, a connection never made is none.
    left: list[int] = []
    async with run_sandbox(SandboxConfig()) as sb:
        client = PartnerClient(PartnerConfig(base_url=sb.url), pool_size=2,
                               departed=lambda: left.append(1))
        await client.start()
        try:
            for rid in present(sb)[:3]:
                assert (await client.delete(rid, f"key-{rid}")).verdict is Verdict.DELETED
            await client.probe(present(sb)[0])
        finally:
            await client.close()
    assert len(left) == 4
    with refusing_port() as port:
        client = PartnerClient(PartnerConfig(base_url=f"http://127.0.0.1:{port}"), pool_size=1,
                               departed=lambda: left.append(1))
        await client.start()
        try:
            assert (await client.delete("r-000001", "k")).verdict is Verdict.TRANSIENT
        finally:
            await client.close()
    assert len(left) == 4
