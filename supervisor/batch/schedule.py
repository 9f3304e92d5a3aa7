"""When a submitted job is read next (docs/batch.md, shape ``job``), as pure arithmetic on
what the ledger and the partner's answers say, so the poller's rule can be tested alone.

Every read costs one request of the budget, so a job is read less often as it ages; but a
finished job's results are kept only so long (Zendesk: an hour, and only the last 100
jobs), and results that expire unread leave every item of the job to be probed: one
request each instead of one for the job. The interval therefore never outgrows what the
results' lifetime allows."""

from __future__ import annotations


def next_poll(submitted: float, polled: float | None, *, initial: float, maximum: float,
              lifetime: float | None = None, expires_at: float | None = None,
              margin: float | None = None) -> float:
    """When a job submitted at ``submitted`` and last read at ``polled`` (None: never) is
    read next, in the same clock (Unix seconds).

    The interval is the job's age at its last read (so it doubles: a 2-second job is
    read within a second or two, a 6-hour one every ``maximum``), within [``initial``,
    ``maximum``]. A ``lifetime`` learnt for the partner's results caps it at half that
    lifetime: a job that finishes right after a read is read again with half its
    results' life left for the read's own pacing and latency. An ``expires_at`` the job
    announced brings the read forward to ``margin`` (default ``initial``) before it.
    No read is ever sooner than ``initial`` after the last: each costs budget, and an
    expiry that close cannot be met anyway."""
    if polled is None:
        return submitted + initial
    interval = min(maximum, max(initial, polled - submitted))
    if lifetime is not None:
        interval = min(interval, max(initial, lifetime / 2))
    due = polled + interval
    if expires_at is not None:
        before = expires_at - (initial if margin is None else margin)
        due = min(due, max(polled + initial, before))
    return due


def seen_lifetime(expires_at: float, seen_finished: float) -> float:
    """How long a finished job's results live, at the shortest, from a read at
    ``seen_finished`` that found the job finished with results kept until ``expires_at``.

    The job finished at or before that read, so its results live at least this long: an
    underestimate only makes reads more frequent. One already past its stated expiry (a
    partner rounding its expiry down, or clocks apart) counts as no lifetime at all,
    which the schedule's floor turns into reads every ``initial``."""
    return max(0.0, expires_at - seen_finished)
