"""The adaptive policy as a pure state machine: (config, state, event, now) -> state.

No sleeps and no clock: every test passes the time it means.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.budget import policy, waits
from supervisor.budget.policy import curve, initial, remembered, step
from supervisor.budget.policy_state import (
    Announce,
    BudgetState,
    Pause,
    PolicyConfig,
    Resume,
    Success,
    Throttle,
)
from supervisor.budget.settings import LimitsConfig

T0 = 1_800_000_000.0


def cfg(**overrides: float) -> PolicyConfig:
    values: dict[str, float] = {"rate_per_second": 100.0, "floor_per_second": 0.5}
    values.update(overrides)
    return PolicyConfig.from_limits(LimitsConfig(**values))  # type: ignore[arg-type]


def test_starts_at_the_ceiling_less_the_headroom() -> None:
    c = cfg(headroom=0.01)
    s = initial(c)
    assert s.rate == pytest.approx(99.0)
    assert s.w_max is None
    assert s.paused_until == 0.0
    assert not s.strict


def test_a_429_at_the_top_is_an_edge_trim_and_strict_pacing_not_a_deep_cut() -> None:
    c = cfg(edge_trim=0.03)
    s = step(c, initial(c), Throttle(T0 - 0.01, 1.0), T0)
    assert s.strict
    assert s.rate == pytest.approx(99.0 * 0.97)
    assert s.paused_until == T0 + 1.0
    # Strict spacing is margin enough: no re-probe for a long time.
    assert s.probe_s == c.max_probe_s
    later = step(c, s, Success(), T0 + 30.0)
    assert later.rate < 97.0


def test_a_429_below_the_top_cuts_by_the_decrease_factor() -> None:
    c = cfg(decrease_factor=0.8)
    s = replace_rate(initial(c), 60.0)
    s = step(c, s, Throttle(T0 - 0.01, None), T0)
    assert s.rate == pytest.approx(48.0)
    assert s.w_max == pytest.approx(60.0 * policy.PLATEAU)
    # No Retry-After: our own backoff, doubling while the 429s keep coming.
    assert s.paused_until == pytest.approx(T0 + waits.BLIND_BASE_S)
    s = step(c, s, Throttle(T0 - 0.01, None), T0 + 0.2)
    assert s.paused_until == pytest.approx(T0 + 0.2 + 2 * waits.BLIND_BASE_S)
    assert step(c, s, Success(), T0 + 1).blind == 0


def test_a_second_429_at_the_rate_just_cut_to_halves_it() -> None:
    c = cfg(decrease_factor=0.8)
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, 0.2), T0)
    s = step(c, s, Throttle(T0 + 0.5, 0.2), T0 + 0.6)  # 0.4 s after resuming
    assert s.rate == pytest.approx(48.0 * policy.HALVE)


def test_a_second_429_soon_after_a_whole_second_pause_halves_the_curve_it_climbed_to() -> None:
    # The recovery's curve climbs fastest right after the cut, so a one-second Retry-After
    # resumes it a third of the way back to the plateau: refused at once there, the limit
    # is as far below as at the rate cut to. Cut by 0.8 a second instead, a bucket of one
    # took ten seconds to follow a limit dropped to a quarter.
    c = cfg(decrease_factor=0.8)
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, 1.0), T0)
    s = step(c, s, Success(), T0 + 1.0)
    assert s.rate > s.cut_to * policy.NEAR
    climbed = s.rate
    s = step(c, s, Throttle(T0 + 1.05, 1.0), T0 + 1.06)
    assert s.rate == pytest.approx(climbed * policy.HALVE)


def test_a_429_soon_after_an_edge_trim_was_no_edge_and_halves() -> None:
    c = cfg()
    s = step(c, initial(c), Throttle(T0 - 0.01, 1.0), T0)
    assert s.last_cut == "edge"
    s = step(c, s, Throttle(T0 + 1.1, 1.0), T0 + 1.2)
    assert s.rate == pytest.approx(99.0 * 0.97 * policy.HALVE)
    # The edge is refuted, not strictness: tolerant pacing's catch-up bursts would be
    # refused by a bucket of one at any rate over 3/4 of its limit.
    assert s.strict


def test_a_429_for_a_request_granted_before_the_cut_does_not_cut_again() -> None:
    c = cfg()
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, 1.0), T0)
    again = step(c, s, Throttle(T0 - 0.001, 1.0), T0 + 0.01)
    assert again.rate == s.rate
    assert again.w_max == s.w_max


def test_a_long_retry_after_pauses_without_cutting() -> None:
    c = cfg(long_pause_seconds=2.0)
    s = initial(c)
    after = step(c, s, Throttle(T0, 900.0), T0)
    assert after.rate == s.rate
    assert after.paused_until == T0 + 900.0


def test_recovery_is_concave_to_the_plateau_then_probes_to_the_ceiling() -> None:
    c = cfg(recovery_seconds=8.0, probe_seconds=12.0, decrease_factor=0.8)
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, None), T0)
    plateau = 60.0 * policy.PLATEAU
    at = [curve(c, s, T0 + t) for t in (0.0, 2.0, 4.0, 8.0, 14.0, 20.0)]
    assert at[0] == pytest.approx(48.0)
    assert at[1] - at[0] > at[2] - at[1] > 0  # concave: fast first
    assert at[3] == pytest.approx(plateau)
    assert plateau < at[4] < at[5]
    assert at[5] == pytest.approx(99.0)  # the top: ceiling less headroom


def test_a_failed_probe_settles_halfway_to_the_plateau_and_doubles_the_next_probe() -> None:
    c = cfg(probe_seconds=12.0, recovery_seconds=8.0)
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, 0.5), T0)
    plateau = s.w_max
    assert plateau is not None
    s = step(c, s, Success(), T0 + 16.0)  # 8 s into the probe above the plateau
    probed = s.rate
    assert probed > plateau * policy.NEAR
    s = step(c, s, Throttle(T0 + 16.0, 0.5), T0 + 16.0)
    assert s.probe_s == 24.0
    # Between the plateau, which held, and the rate that failed.
    assert s.held == pytest.approx(plateau)
    assert s.w_max == pytest.approx((plateau + probed) / 2)
    assert s.rate == s.w_max
    settled = s.rate
    # Refused on that level after it held a while: strictly, halfway down to what held...
    assert not s.strict
    s = step(c, s, Throttle(T0 + 17.0, 0.5), T0 + 18.0)
    assert s.strict
    assert s.rate == pytest.approx((plateau + settled) / 2)
    # ...and again; never a deep cut, never under what held.
    s = step(c, s, Throttle(T0 + 19.0, 0.5), T0 + 20.0)
    assert s.rate == pytest.approx((plateau + (plateau + settled) / 2) / 2)
    assert s.rate > plateau
    assert s.last_cut == "probe"


def test_a_probe_failing_just_over_the_plateau_settles_a_step_under_it() -> None:
    # Halfway would be above a step under the failed rate, which was already too high.
    c = cfg(probe_seconds=12.0, recovery_seconds=8.0)
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, 0.5), T0)
    plateau = s.w_max
    assert plateau is not None
    probed = plateau * 1.05
    s = step(c, replace_rate(s, probed), Throttle(T0 + 9.0, 0.5), T0 + 9.0)
    assert s.rate == pytest.approx(probed * policy.PROBE_BACK)


def test_on_the_level_that_held_the_steps_are_small_again_and_a_drop_forgets_it() -> None:
    c = cfg(probe_seconds=12.0, recovery_seconds=8.0)
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, 0.5), T0)
    plateau = s.w_max
    assert plateau is not None
    s = step(c, s, Success(), T0 + 16.0)
    s = step(c, s, Throttle(T0 + 16.0, 0.5), T0 + 16.0)
    t = T0 + 16.0
    for _ in range(10):  # refused on every level down: halfway each time, to what held
        if s.rate <= plateau * policy.NEAR:
            break
        was = s.rate
        t += 5.0
        s = step(c, s, Throttle(t, 0.5), t)
        assert s.rate == pytest.approx((plateau + was) / 2)
    assert plateau < s.rate <= plateau * policy.NEAR
    # Refused on the level that held itself: 3 % steps, strictly, as with no level held.
    level = s.rate
    t += 5.0
    s = step(c, s, Throttle(t, 0.5), t)
    assert s.rate == pytest.approx(level * policy.PROBE_BACK)
    # A cut (refused twice as soon as it resumed) says the limit moved: what held is void.
    s = step(c, s, Throttle(t + 0.6, 0.5), t + 0.6)
    s = step(c, s, Throttle(t + 1.2, 0.5), t + 1.2)
    assert s.last_cut == "lower"
    assert s.held is None


def test_reaching_the_top_without_a_429_forgets_the_learnt_limit() -> None:
    c = cfg(recovery_seconds=1.0, probe_seconds=1.0)
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, None), T0)
    s = step(c, s, Success(), T0 + 5.0)
    assert s.w_max is None
    assert s.rate == pytest.approx(99.0)


def test_never_below_the_floor() -> None:
    c = cfg(floor_per_second=5.0)
    s = replace_rate(initial(c), 6.0)
    for i in range(10):
        s = step(c, s, Throttle(T0 + i, None), T0 + i + 0.001)
        s = step(c, s, Success(), T0 + i + 0.5)  # a limit, not a storm: each cut holds
    assert s.rate == 5.0


def test_an_announced_limit_paces_at_once_and_counts_as_a_cut() -> None:
    c = cfg(rate_per_second=200.0)
    s = step(c, initial(c), Announce(50.0), T0)
    assert s.rate == pytest.approx(49.5)
    # A 429 in the same answer, for a request granted before, does not cut again.
    s2 = step(c, s, Throttle(T0 - 0.001, None), T0)
    assert s2.rate == s.rate


def test_an_announcement_above_the_ceiling_changes_nothing() -> None:
    c = cfg(rate_per_second=20.0)
    s = step(c, initial(c), Announce(500.0), T0)
    assert s.rate == pytest.approx(19.8)


def test_a_pause_extends_and_a_shorter_one_does_not_shorten() -> None:
    c = cfg()
    s = step(c, initial(c), Pause(T0 + 10, "quota day"), T0)
    s = step(c, s, Pause(T0 + 5, "retry-after"), T0)
    assert (s.paused_until, s.pause_reason) == (T0 + 10, "quota day")


def test_memory_starts_at_the_learnt_limit_and_drifts_back_with_the_half_life() -> None:
    c = cfg(rate_per_second=100.0, memory_half_life_seconds=3600.0)
    learnt = step(c, replace_rate(initial(c), 60.0), Throttle(T0, None), T0)
    assert learnt.w_max is not None
    # Never held for long: memory starts a step under it.
    start = learnt.w_max * policy.PROBE_BACK
    fresh = remembered(c, learnt, T0 + 1.0)
    assert fresh.rate == pytest.approx(start, rel=0.01)
    hour = remembered(c, learnt, T0 + 3600.0)
    assert hour.rate == pytest.approx(100.0 - (100.0 - start) / 2, rel=0.01)
    held = step(c, learnt, Success(), T0 + c.recovery_s * policy.VERIFIED_AFTER)
    assert held.verified == learnt.w_max
    assert remembered(c, held, T0 + 20).rate == pytest.approx(learnt.w_max, rel=0.01)
    # It holds the plateau first: no probe for recovery_seconds.
    assert curve(c, fresh, T0 + 1.0 + c.recovery_s * 0.5) == pytest.approx(fresh.rate)


def test_memory_starts_from_a_plateau_raised_since_it_was_verified() -> None:
    # Verified low early in a run (after a halving), then raised by failed probes above
    # it: the next run starts a step under the raised one, not at the old one.
    c = cfg(rate_per_second=100.0)
    low = replace(initial(c), w_max=24.0, verified=24.0, cut_at=T0, learnt_at=T0, rate=24.0)
    raised = replace(low, w_max=43.8, rate=43.8, cut_at=T0 + 20, learnt_at=T0 + 20)
    assert remembered(c, raised, T0 + 30).rate == pytest.approx(43.8 * policy.PROBE_BACK,
                                                                rel=0.01)
    # A verified plateau above the last one (a drop late in the run) starts at the last.
    dropped = replace(raised, verified=60.0)
    assert remembered(c, dropped, T0 + 30).rate == pytest.approx(43.8, rel=0.01)


def test_memory_starts_at_a_level_found_between_one_that_held_and_ones_refused() -> None:
    # Not a step under it: that would cost 3 % until the next probe, minutes away.
    c = cfg(probe_seconds=12.0, recovery_seconds=8.0)
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, 0.5), T0)
    s = step(c, s, Success(), T0 + 16.0)
    s = step(c, s, Throttle(T0 + 16.0, 0.5), T0 + 16.0)  # a failed probe: halfway
    s = step(c, s, Throttle(T0 + 21.0, 0.5), T0 + 21.0)  # refused: halfway again
    assert s.held is not None
    assert s.w_max is not None
    assert remembered(c, s, T0 + 30).rate == pytest.approx(s.w_max, rel=0.001)
    # Without a level that held, a step under it, as before.
    assert remembered(c, replace(s, held=None), T0 + 30).rate == pytest.approx(
        s.w_max * policy.PROBE_BACK, rel=0.001)


def test_memory_keeps_a_pause_in_force_and_drops_one_that_ended() -> None:
    c = cfg()
    s = step(c, initial(c), Throttle(T0, 900.0), T0)
    assert remembered(c, s, T0 + 10).paused_until == T0 + 900.0
    assert remembered(c, s, T0 + 901).paused_until == 0.0


def test_memory_is_capped_by_the_ceiling() -> None:
    c = cfg(rate_per_second=30.0)
    old = BudgetState(rate=80.0, w_max=80.0, learnt_at=T0)
    assert remembered(c, old, T0).rate <= 30.0


def test_the_state_round_trips_through_json() -> None:
    c = cfg()
    s = step(c, initial(c), Throttle(T0, 2.0), T0)
    assert BudgetState.from_dict(json.loads(json.dumps(s.to_dict()))) == s


@given(st.lists(st.tuples(st.sampled_from(["ok", "429", "ra", "announce"]),
                          st.floats(0.0, 5.0)), max_size=60))
def test_the_rate_stays_between_the_floor_and_the_ceiling(events: list[tuple[str, float]]) -> None:
    c = cfg(rate_per_second=50.0, floor_per_second=1.0)
    s, now = initial(c), T0
    for kind, dt in events:
        now += dt
        if kind == "ok":
            s = step(c, s, Success(), now)
        elif kind == "429":
            s = step(c, s, Throttle(now - 0.01, None), now)
        elif kind == "ra":
            s = step(c, s, Throttle(now - 0.01, dt), now)
        else:
            s = step(c, s, Announce(dt * 20 or None), now)
        assert 1.0 <= s.rate <= 50.0


def replace_rate(s: BudgetState, rate: float) -> BudgetState:
    import dataclasses

    return dataclasses.replace(s, rate=rate)


def test_a_429_at_the_settled_rate_after_it_held_a_while_steps_down_instead_of_halving() -> None:
    # A jitter 429 on a strict partner, long after the edge trim: not "far above".
    c = cfg()
    s = step(c, initial(c), Throttle(T0 - 0.01, 1.0), T0)
    held = s.rate
    s = step(c, s, Success(), T0 + 3.0)  # resumed at T0 + 1, held two seconds
    assert s.rate == pytest.approx(held)
    s = step(c, s, Throttle(T0 + 3.0, 1.0), T0 + 3.0)
    assert s.rate == pytest.approx(held * policy.PROBE_BACK)
    assert s.last_cut == "probe"


def test_429s_without_retry_after_and_nothing_accepted_back_off_without_cutting_again() -> None:
    # A storm the partner does not announce: one cut, undone once the storm shows itself,
    # then only a longer backoff.
    c = cfg()
    s = replace_rate(initial(c), 60.0)
    s = step(c, s, Throttle(T0 - 0.01, None), T0)
    assert s.rate < 60.0
    pauses = []
    for _ in range(5):
        now = s.paused_until
        s = step(c, s, Throttle(now, None), now + 0.001)
        assert s.rate == 60.0
        pauses.append(s.paused_until - (now + 0.001))
    # Growing, then one probe every BLIND_MAX_S: never far past the end of the storm.
    assert pauses[0] == pytest.approx(waits.BLIND_BASE_S * 2)
    assert pauses[1] > pauses[0]
    assert pauses[-1] == pytest.approx(waits.BLIND_MAX_S)


def test_a_long_closure_without_retry_after_is_probed_ever_more_rarely_and_never_fails() -> None:
    # An hour closed without a word: each probe waits at most a tenth of the time closed
    # so far (or BLIND_MAX_S), so the run resumes within a tenth of the closure after it
    # reopens, and the probes thin out. 2.0 ** 1024 overflowed 8.5 minutes into one.
    c = PolicyConfig.from_limits(LimitsConfig(), max_pause_s=900.0)
    s = step(c, initial(c), Throttle(T0 - 0.01, None), T0)
    start, rate = T0, initial(c).rate
    probes = 0
    while s.paused_until < T0 + 3600.0:
        now = s.paused_until
        s = step(c, s, Throttle(now, None), now)
        probes += 1
        closed_s = now - start
        assert s.paused_until - now <= max(waits.BLIND_MAX_S, waits.BLIND_SHARE * closed_s) + 1e-6
        assert s.rate == rate  # a closure, not a lower limit: the first cut is undone
    assert s.paused_until - T0 >= 3600.0
    assert s.paused_until - s.blind_since > 1000.0
    assert probes < 150  # a fixed 0.5 s: 7,200
    # Accepted: the next closure's backoff starts again from its base.
    again = s.paused_until + 1.0
    s = step(c, step(c, s, Success(), s.paused_until), Throttle(again, None), again)
    assert s.paused_until - again == pytest.approx(waits.BLIND_BASE_S)


def test_no_pause_ends_later_than_the_longest_pause_after_it_began() -> None:
    c = PolicyConfig.from_limits(LimitsConfig(), max_pause_s=120.0)
    s = step(c, initial(c), Pause(T0 + 1.8e12, "quota x-ratelimit exhausted"), T0)
    assert s.paused_until == T0 + 120.0
    s = step(c, initial(c), Throttle(T0, 1e9), T0)
    assert s.paused_until == T0 + 120.0
    assert step(c, initial(c), Pause(float("inf"), "x"), T0).paused_until == 0.0


def test_memory_drops_a_pause_longer_than_the_longest_pause() -> None:
    c = PolicyConfig.from_limits(LimitsConfig(), max_pause_s=900.0)
    saved = BudgetState(rate=10.0, paused_until=T0 + 1.8e12, pause_reason="quota x")
    assert policy.overlong(c, saved, T0)
    fresh = remembered(c, saved, T0)
    assert (fresh.paused_until, fresh.pause_reason) == (0.0, "")
    kept = BudgetState(rate=10.0, paused_until=T0 + 600.0, pause_reason="retry-after")
    assert not policy.overlong(c, kept, T0)
    assert remembered(c, kept, T0).paused_until == T0 + 600.0


def test_resume_lifts_the_pause_and_forgets_only_when_asked() -> None:
    c = cfg()
    s = step(c, initial(c), Throttle(T0, 1.0), T0)
    s = step(c, s, Pause(T0 + 600, "maintenance"), T0)
    lifted = step(c, s, Resume(), T0 + 1)
    assert (lifted.paused_until, lifted.pause_reason, lifted.resumed_at) == (0.0, "", T0 + 1)
    assert (lifted.w_max, lifted.rate) == (s.w_max, s.rate)  # the limit is still learnt
    forgot = step(c, s, Resume(forget_limit=True), T0 + 1)
    assert forgot == replace(initial(c), resumed_at=T0 + 1)
    assert remembered(c, forgot, T0 + 2).paused_until == 0.0


def test_refused_on_the_settled_level_as_soon_as_it_resumed_is_a_drop_not_a_close_arrival(
) -> None:
    # The limit moved down under a plateau that held: a cut (and halving after it), not
    # a 3 % step per 429 and a Retry-After pause each.
    c = cfg(probe_seconds=12.0, recovery_seconds=8.0)
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, 0.5), T0)
    s = step(c, s, Success(), T0 + 16.0)
    s = step(c, s, Throttle(T0 + 16.0, 1.0), T0 + 16.0)  # a failed probe: settled
    settled = s.rate
    assert s.held is not None
    # 0.1 s after the pause ended: once proves nothing (a close arrival, or a level a
    # little high: strictly, halfway down to the level that held)...
    s = step(c, s, Throttle(T0 + 17.1, 1.0), T0 + 17.1)
    assert s.strict
    stepped = (s.held + settled) / 2
    assert s.rate == pytest.approx(stepped)
    # ...twice in a row, the limit moved down: a cut...
    s = step(c, s, Throttle(T0 + 18.2, 1.0), T0 + 18.2)
    assert s.last_cut == "lower"
    assert s.rate == pytest.approx(stepped * c.decrease_factor)
    s = step(c, s, Throttle(T0 + 19.3, 1.0), T0 + 19.3)  # and again at once: far below
    assert s.rate == pytest.approx(stepped * c.decrease_factor * policy.HALVE)


def test_a_close_arrival_long_after_the_pause_breaks_the_run_of_quick_refusals() -> None:
    c = cfg(probe_seconds=12.0, recovery_seconds=8.0)
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, 0.5), T0)
    s = step(c, s, Success(), T0 + 16.0)
    s = step(c, s, Throttle(T0 + 16.0, 1.0), T0 + 16.0)
    s = step(c, s, Throttle(T0 + 17.1, 1.0), T0 + 17.1)  # quick
    s = step(c, s, Throttle(T0 + 25.0, 1.0), T0 + 25.0)  # long after: a close arrival
    assert s.quick == 0
    stepped = s.rate
    s = step(c, s, Throttle(T0 + 26.1, 1.0), T0 + 26.1)  # quick, but the first in a row
    assert s.rate == pytest.approx(stepped * policy.PROBE_BACK)


def test_a_close_arrival_on_the_settled_level_does_not_put_the_next_probe_off() -> None:
    c = cfg(probe_seconds=12.0, recovery_seconds=8.0)
    s = step(c, replace_rate(initial(c), 60.0), Throttle(T0, 0.5), T0)
    s = step(c, s, Success(), T0 + 16.0)
    s = step(c, s, Throttle(T0 + 16.0, 0.5), T0 + 16.0)
    probe_s = s.probe_s
    s = step(c, s, Throttle(T0 + 30.0, 0.5), T0 + 30.0)  # held 14 s, then refused
    assert s.strict
    s = step(c, s, Throttle(T0 + 40.0, 0.5), T0 + 40.0)
    assert s.probe_s == probe_s


def test_a_storm_without_retry_after_undoes_the_cut_its_first_429_made() -> None:
    c = cfg()
    s = replace_rate(initial(c), 60.0)
    s = step(c, s, Success(), T0 - 1.0)
    before = s
    s = step(c, s, Throttle(T0 - 0.01, None), T0)
    assert s.rate < before.rate  # one 429: a limit, as far as anyone can tell
    now = s.paused_until
    s = step(c, s, Throttle(now, None), now + 0.001)  # refused again, nothing accepted
    assert (s.rate, s.w_max, s.strict) == (before.rate, before.w_max, before.strict)
    assert s.blind == 2


def test_a_429_without_retry_after_then_an_acceptance_keeps_its_cut() -> None:
    c = cfg()
    s = replace_rate(initial(c), 60.0)
    s = step(c, s, Throttle(T0 - 0.01, None), T0)
    cut = s.rate
    s = step(c, s, Success(), s.paused_until + 0.01)  # a limit: the partner took one
    assert s.uncut is None
    now = s.paused_until + 0.5
    s = step(c, s, Throttle(now - 0.01, None), now)
    assert s.rate <= cut


def test_a_429_in_flight_before_the_storms_cut_does_not_undo_it() -> None:
    # Several requests are in flight when the first 429 comes: their 429s were sent at
    # the old rate and say nothing about a storm.
    c = cfg()
    s = replace_rate(initial(c), 60.0)
    s = step(c, s, Throttle(T0 - 0.01, None), T0)
    cut = s.rate
    s = step(c, s, Throttle(T0 - 0.005, None), T0 + 0.002)
    assert s.rate == cut
    assert s.uncut is not None


def test_an_undone_cut_never_restores_a_rate_above_an_announced_limit() -> None:
    c = cfg()
    s = replace_rate(initial(c), 60.0)
    s = step(c, s, Throttle(T0 - 0.01, None), T0)
    s = step(c, s, Announce(30.0), T0 + 0.01)
    assert s.uncut is None  # what it knew before the announcement is not to come back
    s = step(c, s, Throttle(s.paused_until, None), s.paused_until + 0.001)
    assert s.rate <= policy.top(c, s)


def test_a_retry_after_ends_what_a_storm_could_undo() -> None:
    c = cfg()
    s = replace_rate(initial(c), 60.0)
    s = step(c, s, Throttle(T0 - 0.01, None), T0)
    s = step(c, s, Throttle(T0 + 0.5, 1.0), T0 + 0.5)
    assert s.uncut is None


def test_an_unreadable_undo_record_is_dropped_not_applied() -> None:
    state = BudgetState.from_dict({"rate": 10.0, "uncut": ["rate", 99.0]})
    assert state.uncut is None
    c = cfg()
    odd = replace(replace_rate(initial(c), 60.0), uncut={"rate": 70.0, "future_field": 1},
                  blind=1, cut_at=T0 - 1.0)
    s = step(c, odd, Throttle(T0, None), T0 + 0.001)  # undone: unknown keys are ignored
    assert s.rate == pytest.approx(70.0)


def test_a_rare_refusal_on_a_strict_settled_level_keeps_it_and_a_sooner_one_steps_down(
) -> None:
    # A bucket of one at 20/s: the host's jitter makes a close arrival now and then. Each
    # one stepping 3 % down for good left the long run at 83 % of the limit (1.228 x N/R).
    c = cfg(rate_per_second=40.0, probe_seconds=12.0, recovery_seconds=8.0)
    s = step(c, replace_rate(initial(c), 21.0), Throttle(T0, 1.0), T0)
    s = step(c, s, Success(), T0 + 16.0)
    s = step(c, s, Throttle(T0 + 16.0, 1.0), T0 + 16.0)  # a failed probe: settled
    s = step(c, s, Throttle(T0 + 30.0, 1.0), T0 + 30.0)  # held a while: pace strictly
    assert s.strict
    level = s.rate
    # Past what a whole-second Retry-After asks for (T0's float has ~0.2 µs steps).
    hold_s = policy.jitter_hold(level, 1.0) / level + 0.5
    # Refused again after that many requests held: jitter, the level stays.
    s = step(c, s, Throttle(T0 + 30.0 + hold_s, 1.0), T0 + 30.0 + hold_s)
    assert s.rate == pytest.approx(level)
    assert s.strict
    # Refused again sooner than that: the level is a little high after all (halfway down
    # to the failed probe's plateau, which held).
    later = T0 + 30.0 + hold_s * 1.5
    s = step(c, s, Throttle(later, 1.0), later)
    assert s.held is not None
    assert s.held < s.rate < level
    assert s.rate == pytest.approx((s.held + level) / 2)


def settled_strictly(c: PolicyConfig, retry_after: float | None) -> BudgetState:
    """A level settled at T0 + 30 s under a failed probe's plateau, strictly paced: cut at
    21/s, a probe failed at 16 s, the level refused at 30 s after holding."""
    s = step(c, replace_rate(initial(c), 21.0), Throttle(T0, retry_after), T0)
    s = step(c, s, Success(), T0 + 16.0)
    s = step(c, s, Throttle(T0 + 16.0, retry_after), T0 + 16.0)
    s = step(c, s, Success(), T0 + 17.0)
    s = step(c, s, Throttle(T0 + 30.0, retry_after), T0 + 30.0)
    assert s.strict
    return s


def test_how_long_a_level_must_hold_for_a_refusal_to_be_jitter_follows_the_pause() -> None:
    # Behind a gateway that answers 429 without Retry-After, a refusal costs our own 0.1 s
    # backoff: a level that held 150 requests is kept. The same hold refused with a
    # whole-second Retry-After steps down: there, refusals that often cost more than 3 %.
    c = cfg(rate_per_second=40.0, probe_seconds=12.0, recovery_seconds=8.0)
    for retry_after, kept in ((None, True), (1.0, False)):
        s = step(c, settled_strictly(c, retry_after), Success(), T0 + 31.0)
        level = s.rate
        later = T0 + 30.0 + 150.0 / level
        s = step(c, s, Throttle(later, retry_after), later)
        assert (s.rate == pytest.approx(level)) is kept, retry_after
    assert policy.jitter_hold(20.0, 0.1) == policy.JITTER_MIN_HELD
    assert policy.jitter_hold(20.0, 1.0) == pytest.approx(700.0)


def test_refusals_kept_as_jitter_are_counted_on_average_since_the_level_was_set() -> None:
    # Behind a gateway's bare 429 (a 0.1 s pause) a level is kept while its refusals come
    # no more often than one per jitter_hold requests on average since it was set: two in
    # quick succession after a long quiet spell are kept, a third too soon steps down.
    c = cfg(rate_per_second=40.0, probe_seconds=12.0, recovery_seconds=8.0)
    s = settled_strictly(c, None)
    level, since = s.rate, T0 + 30.0
    hold = policy.jitter_hold(level, waits.BLIND_BASE_S)
    for requests, kept in ((1.5, True), (2.1, True), (2.5, False)):  # x hold, since set
        at = since + requests * hold / level
        s = step(c, s, Success(), at - 0.01)
        s = step(c, s, Throttle(at, None), at)
        assert (s.rate == pytest.approx(level)) is kept, requests


def test_an_announcement_raised_again_lifts_the_rate_a_429_just_before_it_held_low() -> None:
    # The partner's limit drops to a quarter: one 429 at the top (an edge, probed every
    # 600 s) comes before the answer announcing it. When the partner announces its limit
    # back, the rate follows within a recovery period, not after a 600 s probe.
    c = cfg(rate_per_second=50.0)
    s = step(c, initial(c), Throttle(T0, 1.0), T0)
    assert s.last_cut == "edge"
    s = step(c, s, Announce(12.5), T0 + 0.1)
    assert s.rate <= 12.5
    s = step(c, s, Announce(50.0), T0 + 10.0)
    s = step(c, s, Success(), T0 + 10.0 + c.recovery_s)
    assert s.rate >= 0.9 * 50.0


def test_an_edge_learnt_at_the_announced_limit_is_dropped_when_it_is_announced_higher() -> None:
    # Announced at a quarter first, then a 429 at that announced top (an edge, probed
    # every 600 s): when the partner announces its full limit again, the rate goes there.
    c = cfg(rate_per_second=50.0)
    s = step(c, initial(c), Announce(12.5), T0)
    s = step(c, s, Throttle(T0 + 1.0, 1.0), T0 + 1.0)
    assert s.rate < 12.5
    s = step(c, s, Announce(50.0), T0 + 10.0)
    s = step(c, s, Success(), T0 + 10.1)
    assert s.rate >= 0.9 * 50.0


def first_overload(c: PolicyConfig) -> BudgetState:
    """A run that began at T0 at the top, refused 0.2 s in (a bucket of 10 at 50/s under a
    ceiling of 100/s), edge-trimmed, then refused again as soon as it resumed: halved."""
    s = step(c, initial(c), Success(sent_at=T0), T0 + 0.001)
    s = step(c, s, Throttle(T0 + 0.2, 1.0), T0 + 0.201)
    return step(c, s, Throttle(T0 + 1.25, 1.0), T0 + 1.251)


def test_the_runs_first_overload_is_kept_when_the_top_is_halved() -> None:
    c = cfg()
    s = first_overload(c)
    assert s.began == T0  # the first request's grant, not its answer
    assert s.first_rate == pytest.approx(99.0)
    assert s.first_s == pytest.approx(0.2)
    assert s.rate == pytest.approx(99.0 * 0.97 * policy.HALVE)
    # Half is a floor, not a level that held: the climb starts at once.
    assert curve(c, s, T0 + 5.0) > s.rate


def test_an_edge_trim_that_holds_measured_nothing() -> None:
    # At a known limit the first 429 is a close arrival, not a burst drained: once the
    # trimmed rate is accepted for a second, the overload is forgotten.
    c = cfg()
    s = step(c, initial(c), Success(sent_at=T0), T0 + 0.001)
    s = step(c, s, Throttle(T0 + 0.2, 1.0), T0 + 0.201)
    assert s.first_s == pytest.approx(0.2)
    s = step(c, s, Success(sent_at=T0 + 2.3), T0 + 2.301)
    assert s.first_s == 0.0
    assert s.first_rate == 0.0


def test_a_probe_refused_just_over_its_plateau_keeps_the_plateau() -> None:
    c = cfg()
    s = replace(first_overload(c), estimate=None)
    plateau = s.w_max
    assert plateau is not None
    # Into the probe, more than a second after the pause, the rate a little over the
    # plateau, refused: the limit is right there. (Sooner, it would be a quick refusal.)
    at = s.paused_until + 1.1
    s = replace(s, rate=curve(c, s, at))
    assert 1.005 < s.rate / plateau < 1.03
    kept = step(c, s, Throttle(at, 1.0), at)
    assert kept.w_max == pytest.approx(plateau)
    assert kept.probe_s == s.probe_s  # the next probe no later: a limit may have come back
    # Refused again just over it, at the same place: the edge has not moved.
    again_at = at + 1.0 + c.recovery_s + kept.probe_s / 2
    again = replace(kept, rate=kept.w_max * 1.008)
    slower = step(c, again, Throttle(again_at, 1.0), again_at)
    assert slower.w_max == pytest.approx(plateau)
    assert slower.probe_s == pytest.approx(min(c.max_probe_s, kept.probe_s * 8))


def test_a_level_stepped_down_for_a_sooner_refusal_steps_back_up_once_it_held() -> None:
    # Refusals that come at any level (the partner's own stalls) walked a long run's level
    # down 3 % at a time, and only a probe minutes later brought it back. A step down for
    # a refusal sooner than jitter_hold allows is undone once the lower level has held
    # that long; the level stepped back to, refused as soon, steps down again.
    c = cfg(rate_per_second=40.0, probe_seconds=12.0, recovery_seconds=8.0)
    # No level that held under it (a bucket of one refusing close arrivals at any rate):
    # a refusal too soon is a step down, not halfway to such a level; and a run that has
    # found its edge probes above it only every 600 s.
    s = replace(settled_strictly(c, 1.0), held=None, probe_s=c.max_probe_s)
    s = step(c, s, Success(), T0 + 31.0)
    level = s.rate
    at = T0 + 30.0 + 100.0 / level  # 100 requests after the level was set
    s = step(c, s, Throttle(at, 1.0), at)
    low = s.rate
    assert low == pytest.approx(level * policy.PROBE_BACK)
    hold_s = policy.jitter_hold(low, 1.0) / low
    s = step(c, s, Success(), at + 0.5 * hold_s)
    assert s.rate < level
    up_at = at + hold_s + 0.5
    s = step(c, s, Success(), up_at)
    assert s.rate == pytest.approx(level)
    s = step(c, s, Success(), up_at + 1.0)  # one step back, not a climb
    assert s.rate == pytest.approx(level)
    again = up_at + 100.0 / level
    s = step(c, s, Throttle(again, 1.0), again)
    assert s.rate == pytest.approx(low)
