"""The TickSource protocol's contract (supervisor/ticks.py): what the tick puller relies on.

Implementations: Infrai's tick queue (supervisor/infrai/tick_source.py, over a channel the
composition root builds) against the emulator on loopback, in the answer shapes the
reference leaves open (the documented object, a bare-list consume answer, a strict server
that refuses late and unknown acks). The emulator's clock is advanced, so a lease costs no
real waiting.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from supervisor import composition
from supervisor.ticks import TickSource
from tests.helpers import infrai_config, running_emulator

LEASE_S = 30.0

MIXES: dict[str, dict[str, object]] = {
    "infrai": {},
    "infrai-bare-list": {"consume_shape": "bare"},
    "infrai-strict": {"ack_expired": "reject", "ack_unknown": "not_found",
                      "create_existing": "conflict", "key_reuse": "conflict",
                      "require_create_keys": True, "message_extras": True},
}


@dataclass
class Ticks:
    source: TickSource
    # Let ``seconds`` pass on the source's clock.
    advance: Callable[[float], None]


@pytest.fixture(params=list(MIXES))
async def ticks(request: pytest.FixtureRequest) -> AsyncIterator[Ticks]:
    mix = MIXES[str(request.param)]
    async with running_emulator(**mix) as emulator:
        config = infrai_config(emulator, queue="work", tick_queue="ticks")
        async with composition.infrai_session(config, config.tick_queue) as channel:
            yield Ticks(composition.tick_source(channel), emulator.advance)


def tick(i: int) -> dict[str, Any]:
    return {"schedule": "weekly", "scheduled_for": f"2026-11-{i + 1:02d}T02:00:00+00:00"}


class TestTickSourceContract:
    async def test_nothing_waiting_takes_nothing(self, ticks: Ticks) -> None:
        assert await ticks.source.take(10, LEASE_S) == []

    async def test_a_tick_put_is_taken_with_its_id_and_payload_as_sent(
            self, ticks: Ticks) -> None:
        payload = {"schedule": "wöchentlich", "scheduled_for": "2026-11-30T02:00:00+00:00",
                   "key": "k-1"}
        tick_id = await ticks.source.put(payload)
        assert isinstance(tick_id, str)
        assert tick_id
        assert await ticks.source.take(10, LEASE_S) == [(tick_id, payload)]

    async def test_take_hands_out_at_most_max_ticks_and_the_rest_next(
            self, ticks: Ticks) -> None:
        ids = [await ticks.source.put(tick(i)) for i in range(3)]
        first = await ticks.source.take(2, LEASE_S)
        second = await ticks.source.take(2, LEASE_S)
        assert len(first) == 2
        assert sorted(i for i, _ in first + second) == sorted(ids)
        assert await ticks.source.take(2, LEASE_S) == []

    async def test_a_taken_tick_is_hidden_for_its_lease_and_comes_back_unacked(
            self, ticks: Ticks) -> None:
        tick_id = await ticks.source.put(tick(0))
        assert [i for i, _ in await ticks.source.take(10, LEASE_S)] == [tick_id]
        ticks.advance(LEASE_S / 2)
        assert await ticks.source.take(10, LEASE_S) == []  # still leased
        ticks.advance(LEASE_S)
        assert await ticks.source.take(10, LEASE_S) == [(tick_id, tick(0))]

    async def test_an_acked_tick_never_comes_back(self, ticks: Ticks) -> None:
        kept = await ticks.source.put(tick(0))
        acked = await ticks.source.put(tick(1))
        taken = dict(await ticks.source.take(10, LEASE_S))
        assert set(taken) == {kept, acked}
        await ticks.source.ack(acked)
        ticks.advance(LEASE_S * 4)  # past every lease: only the unacked one returns
        assert await ticks.source.take(10, LEASE_S) == [(kept, tick(0))]

    async def test_acking_a_tick_already_gone_is_no_error(self, ticks: Ticks) -> None:
        tick_id = await ticks.source.put(tick(0))
        [(taken, _)] = await ticks.source.take(10, LEASE_S)
        await ticks.source.ack(taken)
        await ticks.source.ack(taken)  # acked twice: the puller's ack after a lost answer
        ticks.advance(LEASE_S * 4)
        assert await ticks.source.take(10, LEASE_S) == []
        assert taken == tick_id

    async def test_an_ack_after_its_lease_expired_is_no_error(
            self, ticks: Ticks) -> None:
        """The puller acks only once the run is recorded; if that took past the lease, the
        ack may be refused (the tick comes back, and its slot dedupes it): never an error."""
        tick_id = await ticks.source.put(tick(0))
        await ticks.source.take(10, LEASE_S)
        ticks.advance(LEASE_S * 2)
        [(again, _)] = await ticks.source.take(10, LEASE_S)  # a new lease
        ticks.advance(LEASE_S * 2)
        await ticks.source.ack(again)  # the second lease is over too
        assert again == tick_id
