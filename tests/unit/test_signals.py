"""The service's signal handlers: a real signal begins the drain, and leaving puts back
whatever handlers were there before (a test runner's, an embedding program's, Python's)."""

from __future__ import annotations

import asyncio
import os
import signal
from types import FrameType

from supervisor.config import Config
from supervisor.service import Service, install_signal_handlers


async def test_sigterm_requests_a_stop_and_undo_restores_the_previous_handlers() -> None:
    seen: list[int] = []

    def earlier(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    before_int = signal.getsignal(signal.SIGINT)
    before_term = signal.signal(signal.SIGTERM, earlier)
    try:
        service = Service(Config())
        undo = install_signal_handlers(service)
        os.kill(os.getpid(), signal.SIGTERM)
        async with asyncio.timeout(5):
            await service.stop_requested.wait()
        assert seen == []  # ours took it while installed
        undo()
        assert signal.getsignal(signal.SIGTERM) is earlier
        assert signal.getsignal(signal.SIGINT) is before_int
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the earlier handler again
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before_term)
