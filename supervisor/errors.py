"""Every exception the service raises on purpose, and the CLI exit codes they map to."""

from __future__ import annotations

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_STARTUP = 3


class CleanupError(Exception):
    """Base of every error the service raises on purpose."""

    exit_code = EXIT_RUNTIME


class ConfigError(CleanupError):
    """The configuration has one or more problems; each names the key that holds it."""

    exit_code = EXIT_USAGE

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


class StartupError(CleanupError):
    """A component could not start (port taken, data dir unwritable, ...)."""

    exit_code = EXIT_STARTUP


class IllegalTransition(CleanupError):
    """An operation was asked to move between two states the state machine forbids: a bug."""

    def __init__(self, operation_id: str, current: str, target: str) -> None:
        self.operation_id = operation_id
        self.current = current
        self.target = target
        super().__init__(f"operation {operation_id}: illegal transition {current} -> {target}")


class StorageError(CleanupError):
    """The ledger could not commit (disk full, locked, read-only, corrupt)."""


class SourceError(CleanupError):
    """A candidate source answered something unusable (unreachable, malformed page)."""


class TooManyCrashes(CleanupError):
    """A component crashed more often than the restart policy allows."""


class OperationBusy(CleanupError):
    """Another worker holds this operation's attempt in flight; try after ``until``."""

    def __init__(self, operation_id: str, until: float) -> None:
        self.operation_id = operation_id
        self.until = until
        super().__init__(f"operation {operation_id} is in flight elsewhere until {until:.0f}")


class AttemptOpen(CleanupError):
    """The operation has an attempt with no outcome that this caller did not supersede:
    it may have acted, and without idempotency keys nothing is sent after it."""

    def __init__(self, operation_id: str) -> None:
        self.operation_id = operation_id
        super().__init__(f"operation {operation_id} has an attempt with no recorded outcome")


class QueueError(CleanupError):
    """The queue transport failed a call after its own retries (unreachable, 5xx, an
    answer that is not the documented contract). Nothing is lost: the ledger is truth."""


class QueueRefused(QueueError):
    """The transport refused a call for a reason retrying will not cure (a 4xx); ``code``
    names it."""

    code = ""


class QueueBlocked(QueueError):
    """The transport refuses us until an operator acts (a wrong key, no credit).
    Consumption stops, /readyz is 503, and every call resumes once it clears."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


class MessageTooLarge(QueueError):
    """A message over the transport's size limit, refused before it was sent."""


class PartialPublish(QueueError):
    """Some messages of a publish were stored, some not: ``ids`` holds a message ID for
    each one stored (None for the others), so what was published can be recorded."""

    def __init__(self, ids: list[str | None], cause: BaseException) -> None:
        self.ids = ids
        self.cause = cause
        super().__init__(f"{sum(i is not None for i in ids)} of {len(ids)} published: {cause}")


class ScanConflict(CleanupError):
    """A page was recorded from a cursor the run no longer holds: another scanner (a
    replica that took the scan over) has moved it on. This scanner must stop."""

    def __init__(self, run_id: str, resumed_from: str | None, current: str | None) -> None:
        self.run_id = run_id
        super().__init__(f"run {run_id}: scan resumed from cursor {resumed_from!r} but the run "
                         f"is at {current!r} (another replica scans it)")


class ReplicaFenced(StorageError):
    """This replica's heartbeat lapsed: the others may have released what it held, so it
    starts no attempt until its registration is fresh again."""
