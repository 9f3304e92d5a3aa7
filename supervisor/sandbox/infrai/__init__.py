"""A local emulator of the Infrai managed queue REST API (shared/reference/infrai-api.md).

For the queue adapter's tests and benchmarks: ``start_emulator`` serves one in-process on a
real loopback socket; ``python -m supervisor.sandbox.infrai`` runs one as a process.
"""

from __future__ import annotations

from supervisor.sandbox.infrai.app import RUNTIME_KEY, Runtime, create_app
from supervisor.sandbox.infrai.config import FAULT_FIELDS, EmulatorConfig
from supervisor.sandbox.infrai.server import CONTROL_HEADER, Emulator, start_emulator
from supervisor.sandbox.infrai.state import ApiError, QueueState

__all__ = [
    "CONTROL_HEADER",
    "FAULT_FIELDS",
    "RUNTIME_KEY",
    "ApiError",
    "Emulator",
    "EmulatorConfig",
    "QueueState",
    "Runtime",
    "create_app",
    "start_emulator",
]
