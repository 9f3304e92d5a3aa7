"""cleanup-supervisor: a paced, idempotent, auditable stream of rate-limited deletions."""

from __future__ import annotations

__version__ = "0.1.0"
