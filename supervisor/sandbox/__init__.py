"""Partner API simulator: a seeded, rate-limited customer-profile API on a local port.

Used by the demo, the end-to-end tests and the benchmarks; see ``create_app`` and
``run_sandbox`` for in-process use and ``python -m supervisor.sandbox`` for a process.
"""

from __future__ import annotations

from supervisor.sandbox.app import CLOSING_KEY, STATE_KEY, create_app
from supervisor.sandbox.config import RateLimitHeaders, RetryAfterFormat, SandboxConfig, Window
from supervisor.sandbox.server import RunningSandbox, run_sandbox
from supervisor.sandbox.state import Execution, SandboxState

__all__ = [
    "CLOSING_KEY",
    "STATE_KEY",
    "Execution",
    "RateLimitHeaders",
    "RetryAfterFormat",
    "RunningSandbox",
    "SandboxConfig",
    "SandboxState",
    "Window",
    "create_app",
    "run_sandbox",
]
