"""The policy against a token bucket it cannot see: how many 429s it takes to find the limit.

A pure model, no clock and no sockets: one sender paces at the policy's rate, a token
bucket of R per second with a burst answers each request, and every 429 carries the
whole-second ``Retry-After`` such a partner sends (the model is ``bench/policy_grid.py``'s).
Each 429 costs a second of a 30 s run, so the count of them is what a first run against a
hidden limit pays. ``bench/hidden_limit.py`` measures the same against a real partner
over HTTP.
"""

from __future__ import annotations

import math

import pytest

from policy_grid import Jitter, drain


def changing_limit(t: float) -> float:
    """The bench's changing-limit cell: 50/s, 12.5/s from 8 s to 18 s, then 50/s again."""
    return 12.5 if 8.0 <= t < 18.0 else 50.0


@pytest.mark.parametrize("burst", [2.0, 10.0, 25.0])
def test_a_hidden_limit_under_a_ceiling_twice_too_high_is_found_in_five_429s(
        burst: float) -> None:
    run = drain(ceiling=100.0, limit=lambda t: 50.0, burst=burst, n=1500)
    assert run.done == 1500
    # An edge trim, the halving, a failed probe, two steps halfway down to the level that
    # held (3 % steps: seven). A 12 s probe left the second step past the 30 s.
    assert run.refused <= 5
    assert run.state.w_max is not None
    assert 48.0 <= run.state.w_max <= 50.0 * 1.05


@pytest.mark.parametrize("burst", [2.0, 5.0, 10.0])
@pytest.mark.parametrize("limit", [float(x) for x in range(10, 91, 5)])
def test_any_hidden_limit_costs_a_few_429s_and_ends_near_it(limit: float, burst: float) -> None:
    # A grid, not random draws: the bounds are what this model measures at every point
    # of it (429 share at most 2.3 %, at a limit a tenth of the ceiling; the slowest run
    # 1.30 x N/R, a limit at 90 % of it found from underneath after a halving), with a
    # little room, so a change that makes any point worse fails here.
    run = drain(ceiling=100.0, limit=lambda t: limit, burst=burst, n=int(60 * limit))
    assert run.done == int(60 * limit)
    assert run.refused / (run.done + run.refused) <= 0.025
    assert run.ratio(limit) <= 1.35
    # Ends within reach of the limit: a bucket of 10 lets a probe 11 % over 10/s through
    # for 9 s at a time, and a level found from underneath may sit 8 % low.
    assert 0.9 * limit <= run.state.rate <= 1.12 * limit


def test_a_drop_under_a_level_that_held_is_followed_down_and_back_up() -> None:
    # What held before the drop says nothing after it.
    run = drain(ceiling=50.0, limit=changing_limit, burst=10.0, n=1375)
    assert run.done == 1375
    assert run.state.rate >= 0.9 * 50.0


@pytest.mark.parametrize(("burst", "within_s"), [(2.0, 10.0), (5.0, 10.0), (10.0, 10.0),
                                                  (25.0, 15.0)])
def test_a_limit_that_comes_back_is_followed_back_to_ninety_percent(
        burst: float, within_s: float) -> None:
    # The issue asks for 90 % of the limit within 15 s of its return. The model's figures
    # are 7.9 - 9.0 s up to a burst of 10 and 13.9 s at 25 (a 12 s probe: 11.7 - 12.8 and
    # 17.6), and the HTTP bench adds a second or two to them.
    run = drain(ceiling=50.0, limit=changing_limit, burst=burst, n=1375)
    back = next((t for t, rate in run.rates if t >= 18.0 and rate >= 0.9 * 50.0), math.inf)
    assert back - 18.0 <= within_s


@pytest.mark.parametrize("seed", range(8))
def test_a_bucket_of_one_follows_a_limit_that_drops_and_comes_back(seed: int) -> None:
    # Against a bucket of one with this host's jitter. Each 429's
    # whole-second Retry-After let the recovery's curve climb a third of the way back
    # before the next refusal, which was then taken for a limit under the plateau (a cut
    # by 0.8), not one far below (a halving): down to the new limit in 9.4 s, so the climb
    # began after the limit had come back, and 90 % again 15 - 15.6 s after it did.
    # Now 3.1 - 4.1 s down and 8.8 - 9.8 s back.
    run = drain(ceiling=50.0, limit=changing_limit, burst=1.0, n=1375, jitter=Jitter(seed))
    down = next((t for t, rate in run.rates if t >= 8.0 and rate <= 12.5), math.inf)
    back = next((t for t, rate in run.rates if t >= 18.0 and rate >= 0.9 * 50.0), math.inf)
    assert down - 8.0 <= 5.0
    assert back - 18.0 <= 12.0
    # And it stays back. The probe reaches the ceiling, where a bucket of one refuses a
    # close arrival as it did the run's first request: taken for a failed probe, the
    # level went halfway down to the 9.3/s that held while the limit was low (29.8/s,
    # the run 54.5 - 56.1 s); trimmed as an edge, 45/s at the least (47.3 - 50.2 s).
    assert min(rate for t, rate in run.rates if t >= back) >= 0.85 * 50.0
    assert run.seconds <= 52.0


@pytest.mark.parametrize("seed", range(8))
def test_a_bucket_of_one_with_the_hosts_jitter_is_not_halved_to_a_quarter(seed: int) -> None:
    # A bucket of one refuses any arrival early by a millisecond, so with a host's jitter
    # its refusals are random near the limit. Tolerant pacing after the halving (catch-up
    # bursts a quarter interval early) was refused at once at half the ceiling, halved to
    # a quarter and climbed back for 15 s: 1.35 x N/R over these seeds, the worst 1.60.
    # Strict pacing: 1.26, the worst 1.29.
    run = drain(ceiling=100.0, limit=lambda t: 50.0, burst=1.0, n=1500, jitter=Jitter(seed))
    assert run.done == 1500
    assert run.state.strict
    assert min(rate for t, rate in run.rates if t > 2.0) > 0.6 * 50.0
    assert run.ratio(50.0) <= 1.35


@pytest.mark.parametrize("burst", [2.0, 5.0, 10.0])
@pytest.mark.parametrize("limit", [35.0, 50.0, 70.0, 84.0])
def test_a_failed_probe_measures_the_hidden_limit(limit: float, burst: float) -> None:
    # The delivery-rate estimate (policy._measured): the run's first overload gives the
    # bucket's burst, the probe's 429 the rate. The model measures every point of this
    # grid within 1 % (3.1 % under at a limit of 20/s); halving the gap instead settled
    # 3 - 8 % off and took two more 429s to get there.
    run = drain(ceiling=100.0, limit=lambda t: limit, burst=burst, n=int(30 * limit))
    assert run.state.estimate is not None
    assert 0.98 * limit <= run.state.estimate <= 1.02 * limit
    # An edge trim, the halving (twice under 50/s) and the probe the limit was measured by.
    assert run.refused <= (4 if limit >= 50.0 else 5)
    # Settled just under what it measured, strictly paced: no catch-up burst to refuse.
    assert run.state.w_max is not None
    assert 0.95 * limit <= run.state.w_max <= limit
    assert run.state.strict


@pytest.mark.parametrize("burst", [2.0, 10.0, 25.0])
def test_an_edge_measured_twice_in_the_same_place_is_not_probed_again(burst: float) -> None:
    # Point 2 of issue 20: probing back up stops on a partner whose edge has not moved.
    # Probing every 16, 32, 64... s cost 15 - 23 429s in 300 s at a limit of 50/s.
    run = drain(ceiling=100.0, limit=lambda t: 50.0, burst=burst, n=300 * 50)
    assert run.state.probe_s == 600.0  # limits.max_probe_seconds: the longest probe
    assert run.refused <= 6
    # 2 % under what it measured (policy.MEASURED_BACK), for the host's jitter.
    assert run.ratio(50.0) <= 1.04


def test_an_edge_that_moves_is_still_followed() -> None:
    # Measured at 50/s, then the partner's limit rises to 80/s: the probes are not stopped
    # before the edge was measured twice where it was, so the climb finds the new one.
    run = drain(ceiling=100.0, limit=lambda t: 50.0 if t < 20.0 else 80.0, burst=10.0,
                n=120 * 70)
    assert run.state.rate >= 0.9 * 80.0


@pytest.mark.parametrize("lag_s", [0.2, 0.4, 0.6])
@pytest.mark.parametrize("burst", [2.0, 10.0])
@pytest.mark.parametrize("limit", [35.0, 50.0, 70.0])
def test_a_probe_paced_late_is_measured_at_the_pace_it_had(limit: float, burst: float,
                                                           lag_s: float) -> None:
    # Replicas reserve slots of the shared budget ahead (up to 0.5 s with three), so
    # their requests follow the recovery's curve late. A 429 says when the rate its
    # request was spaced at was read (Throttle.paced_at), and the probe is measured at
    # that pace: as close as without the lag (the bench measured three replicas at
    # 51 - 53/s on a bucket of 50/s before).
    run = drain(ceiling=100.0, limit=lambda t: limit, burst=burst, n=int(30 * limit),
                lag_s=lag_s)
    assert run.state.estimate is not None
    assert 0.98 * limit <= run.state.estimate <= 1.02 * limit
    assert run.refused <= (4 if limit >= 50.0 else 5)


@pytest.mark.parametrize("limit", [35.0, 50.0, 70.0])
def test_a_probe_paced_late_and_measured_on_the_curve_overshoots(limit: float) -> None:
    # The same without paced_at: refused later than the curve's own pace would have been,
    # the probe reads a limit above the partner's, and the level settled under it costs
    # more 429s.
    n = int(30 * limit)
    untold = drain(ceiling=100.0, limit=lambda t: limit, burst=10.0, n=n, lag_s=0.4,
                   told=False)
    told = drain(ceiling=100.0, limit=lambda t: limit, burst=10.0, n=n, lag_s=0.4)
    assert untold.state.estimate is not None
    assert untold.state.estimate > 1.03 * limit
    assert untold.refused > told.refused


def test_refusals_that_come_at_any_level_do_not_walk_a_long_run_down() -> None:
    # The article's 18,400 at 20/s under 40/s, a bucket of one, a whole-second
    # Retry-After, and a partner that stalls now and then: one arrival in 900 lands 10 -
    # 30 ms late, so the next is refused at any level the run could hold. Each refusal
    # sooner than jitter_hold allows stepped the level down 3 % for good: 18.3/s on
    # average after 600 s over four seeds (one at 17.8), 1.122 x N/R. Stepped back up once
    # the lower level holds as long, 18.9/s and 1.095.
    runs = [drain(40.0, lambda t: 20.0, 1.0, 18_400,
                  Jitter(seed, wire_spike_every=900, wire_spike_s=(0.010, 0.030)))
            for seed in range(4)]
    levels = [sum(r for t, r in run.rates if t > 600) / sum(1 for t, _ in run.rates if t > 600)
              for run in runs]
    assert sum(levels) / len(levels) >= 18.7, levels
    assert sum(run.ratio(20.0) for run in runs) / len(runs) <= 1.11
