"""What both rate budgets do with an answer, an operator's pause or resume and the
policies a partner announces: the policy's events, written once. A budget says only how an
event takes effect: in one process, a step of the policy; shared by replicas, a step here
and a write to the row that every replica is told of (so a resume lifts every replica's
pause, and a cut reaches them all)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from supervisor.budget.announced import Announced
from supervisor.budget.base import Feedback, Grant, Outcome, QuotaView, Snapshot
from supervisor.budget.policy_state import Announce, BudgetState, Pause, PolicyConfig, Resume, Throttle
from supervisor.budget.slots import Slots

# What a budget applies besides a success (which the shared budget writes only when it
# changes more than the rate).
PolicyChange = Throttle | Announce | Pause | Resume


class PolicyFeedback(ABC):
    cfg: PolicyConfig
    _slots: Slots
    _announced: Announced
    _clock: Callable[[], float]

    def release(self, grant: Grant, feedback: Feedback) -> None:
        self._slots.free()
        now = self._clock()
        if feedback.policies:
            announce, pauses = self._announced.learn(feedback.policies, now)
            self._apply(announce, now)
            for pause in pauses:
                self._apply(pause, now)
        if feedback.outcome is Outcome.OK:
            self._slots.sample(feedback.latency_s, self._rate())
            self._succeeded(now, grant.at)
        elif feedback.outcome is Outcome.THROTTLED:
            # A budget that paces by cuts says which one the request was paced under: a
            # 429 for a request granted before the last cut does not cut again.
            self._apply(Throttle(grant.at, feedback.retry_after_s, grant.paced_at or 0.0),
                        now, grant.cut)

    def pause(self, until: float, reason: str) -> None:
        self._apply(Pause(until, reason), self._clock())

    def resume(self, forget_limit: bool = False) -> None:
        self._apply(Resume(forget_limit), self._clock())

    def _snapshot(self, state: BudgetState, quotas: Sequence[QuotaView]) -> Snapshot:
        return Snapshot(state=state, ceiling=self.cfg.ceiling,
                        concurrency_limit=self._slots.limit.value,
                        concurrency_max=self._slots.limit.maximum, in_flight=self._slots.in_flight,
                        concurrency_bound=self._slots.limit.bounds(state.rate),
                        quotas=tuple(quotas))

    @abstractmethod
    def _apply(self, event: PolicyChange, now: float, cut: float | None = None) -> None:
        """Take ``event`` into the policy's state (``cut``: the one a throttled request
        was paced under, where the budget knows it)."""

    @abstractmethod
    def _succeeded(self, now: float, sent_at: float) -> None: ...

    @abstractmethod
    def _rate(self) -> float:
        """The rate requests are paced at now."""


def shown(value: float | None) -> str:
    """A remembered value in a log line."""
    return "nothing" if value is None else f"{value:.1f}"
