"""The Sink protocol's contract: every events sink passes this one class.

Backends: ``InfraiSink`` publishing to the Infrai emulator on loopback (its receiver reads
the queue, on which the emulator keeps one message per idempotency key), and
``WebhookSink`` posting to a real loopback receiver that checks every signature
(tests/receivers.py; a receiver deduplicates by the Idempotency-Key).

Each delivery is seen as the receiver sees it: a key (the webhook's Idempotency-Key, the
Infrai message's id) and the event IDs it carried, oldest first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import orjson
import pytest

from supervisor import composition
from supervisor.configtypes import Secret
from supervisor.events.settings import SinkConfig
from supervisor.events.sinks import MAX_BODY_BYTES, InfraiSink, Sink, SinkError, WebhookSink
from supervisor.model import Event
from tests.helpers import infrai_config, running_emulator
from tests.receivers import HOOK_SECRET, Hook

QUEUE = "contract-events"


@dataclass(frozen=True)
class Seen:
    """One delivery as its receiver took it."""

    key: str
    ids: list[str]
    size: int  # its body, in bytes


@dataclass
class Rig:
    sink: Sink
    # Every delivery the receiver took so far, in arrival order.
    seen: Callable[[], Awaitable[list[Seen]]]
    # The receiver answers every delivery with ``status`` (and Retry-After if given) from
    # now on; ``refuse(200)`` takes deliveries again.
    refuse: Callable[[int, str | None], None]
    # The receiver's own wait reaches the caller (SinkError.retry_after_s); a transport
    # whose client waits it out itself (Infrai's) raises with None after its own retries.
    names_retry_after: bool


def events(n: int, first: int = 1, pad: int = 0) -> list[Event]:
    """``n`` operation events, ``pad`` extra bytes each (a finished run's counts)."""
    counts = {f"state_{i:05d}": i for i in range(pad // 20)} if pad else None
    return [Event(seq=i, id=f"ev_{i:06d}", kind="operation.settled", at=1_700_000_000.0 + i,
                  run_id="run_1", operation_id=f"op_{i}", recipient_id=f"r-{i}",
                  outcome="deleted", counts=counts)
            for i in range(first, first + n)]


def ids(batch: list[Event]) -> list[str]:
    return [e.id for e in batch]


@asynccontextmanager
async def infrai_rig() -> AsyncIterator[Rig]:
    async with running_emulator() as emulator:
        # Few, short retries: a refusal comes out as SinkError within a test's patience.
        config = infrai_config(emulator, max_attempts=2, max_retry_after_seconds=0.05)
        sink = InfraiSink(SinkConfig(name="contract-infrai", kind="infrai", queue=QUEUE),
                          composition.infrai_channel(config, QUEUE))
        reader = composition.infrai_channel(infrai_config(emulator), QUEUE)
        taken: list[Seen] = []

        async def seen() -> list[Seen]:
            while items := await reader.consume(10, 30):
                for item in items:
                    payload = item.get("payload", item.get("body"))
                    if isinstance(payload, str | bytes):
                        payload = orjson.loads(payload)
                    taken.append(Seen(item["message_id"], [e["id"] for e in payload["events"]],
                                      len(orjson.dumps(payload))))
                    await reader.ack_id(item["message_id"])
            return list(taken)

        def refuse(status: int, retry_after: str | None) -> None:
            refusing = {"rate_limit_share": 0.0, "error_share": 0.0}
            if status == 429:
                refusing.update(rate_limit_share=1.0, retry_after=float(retry_after or 0))
            elif status != 200:
                refusing.update(error_share=1.0, error_status=status)
            emulator.set_faults(**refusing)

        await sink.start()
        await reader.start()
        await reader.ensure_queues()  # there to read before the sink's first delivery
        try:
            yield Rig(sink, seen, refuse, names_retry_after=False)
        finally:
            await reader.close()
            await sink.close()


@asynccontextmanager
async def webhook_rig() -> AsyncIterator[Rig]:
    hook = Hook()
    await hook.start()
    sink = WebhookSink(SinkConfig(name="contract-webhook", kind="webhook", url=hook.url,
                                  secret_env="HOOK_SECRET", secret=Secret(HOOK_SECRET),
                                  timeout_seconds=5.0))

    async def seen() -> list[Seen]:
        return [Seen(key, ids, size) for (key, ids), size in zip(hook.requests, hook.sizes,
                                                                 strict=True)]

    def refuse(status: int, retry_after: str | None) -> None:
        hook.status, hook.retry_after = status, retry_after

    await sink.start()
    try:
        yield Rig(sink, seen, refuse, names_retry_after=True)
    finally:
        await sink.close()
        await hook.stop()


RIGS = {"infrai": infrai_rig, "webhook": webhook_rig}


@pytest.fixture(params=sorted(RIGS))
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    async with RIGS[request.param]() as r:
        yield r


class TestSinkContract:
    async def test_one_delivery_arrives_once_with_every_event_in_order(self, rig: Rig) -> None:
        batch = events(3)
        assert await rig.sink.deliver(batch) == 3
        [seen] = await rig.seen()
        assert seen.ids == ids(batch)

    async def test_a_batch_over_the_size_limit_sends_the_oldest_that_fit(self, rig: Rig) -> None:
        batch = events(40, pad=10_000)  # about 400 KB: over one delivery's limit
        n = await rig.sink.deliver(batch)
        assert 1 <= n < len(batch)
        m = await rig.sink.deliver(batch[n:])  # the relay goes on from the first not taken
        first, second = await rig.seen()
        assert first.ids == ids(batch[:n])
        assert second.ids == ids(batch[n:n + m])
        assert first.size <= MAX_BODY_BYTES
        assert second.size <= MAX_BODY_BYTES

    async def test_a_batch_sent_again_carries_the_same_key(self, rig: Rig) -> None:
        """A retry after a lost answer: the receiver can tell it is the same delivery; a
        different batch is another one."""
        batch = events(4)
        assert await rig.sink.deliver(batch) == 4
        assert await rig.sink.deliver(batch) == 4
        tries = await rig.seen()
        assert 1 <= len(tries) <= 2  # Infrai keeps one message per key, a webhook sees both
        assert {t.key for t in tries} == {tries[0].key}
        assert all(t.ids == ids(batch) for t in tries)
        other = events(4, first=5)
        await rig.sink.deliver(other)
        last = (await rig.seen())[-1]
        assert last.ids == ids(other)
        assert last.key != tries[0].key

    async def test_a_rate_limited_delivery_raises_sink_error_with_the_receivers_wait(
            self, rig: Rig) -> None:
        rig.refuse(429, "7")
        with pytest.raises(SinkError) as caught:
            await rig.sink.deliver(events(2))
        if rig.names_retry_after:
            assert caught.value.retry_after_s == pytest.approx(7.0)
        else:  # waited out by the transport's own retries
            assert caught.value.retry_after_s is None
        rig.refuse(200, None)
        assert await rig.seen() == []

    async def test_a_server_error_raises_sink_error_and_nothing_is_taken(self, rig: Rig) -> None:
        rig.refuse(503, None)
        with pytest.raises(SinkError) as caught:
            await rig.sink.deliver(events(2))
        assert caught.value.retry_after_s is None  # none named
        rig.refuse(200, None)  # back: nothing was taken, the same batch goes through once
        assert await rig.seen() == []
        batch = events(2)
        assert await rig.sink.deliver(batch) == 2
        [seen] = await rig.seen()
        assert seen.ids == ids(batch)

    async def test_a_server_error_naming_a_wait_passes_it_on(self, rig: Rig) -> None:
        if not rig.names_retry_after:
            pytest.skip("this sink's transport waits out a Retry-After itself")
        rig.refuse(503, "2")
        with pytest.raises(SinkError) as caught:
            await rig.sink.deliver(events(1))
        assert caught.value.retry_after_s == pytest.approx(2.0)
