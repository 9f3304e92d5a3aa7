"""The recipe: a workflow whose one step is a cleanup run (issue 21, point 5).

Copy it, or run it as it is: a worker registers ``CleanupWorkflow`` and
``CleanupActivity(url).run`` (:mod:`supervisor.callers.temporal`) on one task queue, and a
Temporal Schedule (or any client) starts ``CleanupWorkflow`` with a
:class:`CleanupWorkflowInput`.

The slot is what makes retries safe: every attempt of the activity ticks the same
``scheduled_for``, and the service opens one run per slot. Left out of the input, it is
the Schedule's own ``TemporalScheduledStartTime`` (the time the action was due, the same
for a workflow retried by its schedule), so a Schedule needs no argument of its own.

The retry policy retries what may pass (the service unreachable, restarting or
shutting down) with backoff and leaves the rest to the workflow: a 409 (another run
unfinished) and a refusal (token, schedule, slot) fail the step at once.

Cancelling the workflow cancels the activity and *waits* for it to acknowledge
(``WAIT_CANCELLATION_COMPLETED``), so the history records that the wait ended; the run
itself goes on in the service to its end (there is no stop, see the activity module).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from supervisor.callers.temporal import (
        REFUSED,
        RUN_UNFINISHED,
        CleanupActivity,
        CleanupRequest,
        CleanupResult,
    )

# Set by the server on every workflow a Temporal Schedule starts.
SCHEDULED_START = SearchAttributeKey.for_datetime("TemporalScheduledStartTime")


@dataclass(frozen=True)
class CleanupWorkflowInput:
    """``scheduled_for``: the slot (ISO 8601 with offset); the Schedule's start time when
    omitted. The durations shape the activity: a heartbeat timeout of a minute lets a
    lost worker be noticed within a minute, and the start-to-close timeout bounds one
    attempt (a weekly run of 18,400 recipients at 20/s drains in about 16 minutes)."""

    scheduled_for: str | None = None
    schedule: str | None = None
    heartbeat_timeout_s: float = 60.0
    start_to_close_s: float = 6 * 3600.0
    retry_initial_s: float = 5.0
    retry_max_s: float = 300.0
    max_attempts: int = 0  # 0: until start-to-close runs out for good


@workflow.defn(name="CleanupWorkflow")
class CleanupWorkflow:
    @workflow.run
    async def run(self, params: CleanupWorkflowInput) -> CleanupResult:
        """Run one cleanup step; returns the run's final counts."""
        slot = params.scheduled_for or _scheduled_start()
        return await workflow.execute_activity_method(
            CleanupActivity.run,
            CleanupRequest(scheduled_for=slot, schedule=params.schedule),
            start_to_close_timeout=timedelta(seconds=params.start_to_close_s),
            heartbeat_timeout=timedelta(seconds=params.heartbeat_timeout_s),
            retry_policy=RetryPolicy(
                initial_interval=timedelta(seconds=params.retry_initial_s),
                maximum_interval=timedelta(seconds=params.retry_max_s),
                maximum_attempts=params.max_attempts,
                # Raised non-retryable already; named too, for a reader of the policy.
                non_retryable_error_types=[RUN_UNFINISHED, REFUSED]),
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )


def _scheduled_start() -> str:
    when = workflow.info().typed_search_attributes.get(SCHEDULED_START)
    if when is None:
        raise ApplicationError("scheduled_for is required when the workflow is not started "
                               "by a Temporal Schedule", type=REFUSED, non_retryable=True)
    return when.astimezone(UTC).isoformat()
