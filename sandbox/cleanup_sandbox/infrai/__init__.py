"""A local emulator of the Infrai managed queue REST API (shared/reference/infrai-api.md).

For the queue adapter's tests and benchmarks: ``start_emulator`` serves one in-process on a
real loopback socket; ``python -m cleanup_sandbox.infrai`` runs one as a process.
"""

from __future__ import annotations

from cleanup_sandbox.infrai.app import RUNTIME_KEY, Runtime, create_app
from cleanup_sandbox.infrai.config import FAULT_FIELDS, EmulatorConfig
from cleanup_sandbox.infrai.server import CONTROL_HEADER, Emulator, start_emulator
from cleanup_sandbox.infrai.state import ApiError, QueueState

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
