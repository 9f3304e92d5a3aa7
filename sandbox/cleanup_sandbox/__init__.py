"""Partner API simulator: a seeded, rate-limited customer-profile API on a local port.

Used by the demo, the end-to-end tests and the benchmarks; see ``create_app`` and
``run_sandbox`` for in-process use and ``python -m cleanup_sandbox`` for a process.
"""

from __future__ import annotations

from cleanup_sandbox.app import CLOSING_KEY, STATE_KEY, create_app
from cleanup_sandbox.config import RateLimitHeaders, RetryAfterFormat, SandboxConfig, Window
from cleanup_sandbox.server import RunningSandbox, run_sandbox
from cleanup_sandbox.state import Execution, SandboxState

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
