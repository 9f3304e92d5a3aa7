"""What the simulators' command lines share: announce the URL, run on uvloop if present."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import orjson


def announce(url: str) -> None:
    """One JSON line ``{"url", "pid"}`` on stdout, flushed: whoever spawned us blocks on
    it to learn the port."""
    sys.stdout.write(orjson.dumps({"url": url, "pid": os.getpid()}).decode() + "\n")
    sys.stdout.flush()


async def serve_until_signal(url: str) -> None:
    """Announce ``url``, then serve until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    announce(url)
    await stop.wait()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        # Optional speed-up; the stdlib loop is fine where uvloop does not build.
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, None]) -> int:
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(main)
    return 0
