"""The adaptive rate policy: a pure state machine, ``step(config, state, event, now) -> state``.

No clock, no I/O, no asyncio: time is an argument (wall-clock seconds, so a state written
by one process or before a restart means the same thing when read back), and the state is
a small frozen record that serialises to JSON. The in-process budget holds one; a budget
shared by several replicas can hold the same record in a database row.

The policy, and why:

* **Never above the ceiling** (the documented limit) nor above what the partner announces
  in ``RateLimit-Policy`` / ``X-RateLimit-*``. Below a limit it *knows*, it paces
  ``headroom`` under it, so a partner bucket that is exactly as large as our average never
  empties on jitter.
* **A 429 at the top is an edge, not a lower limit.** When we were pacing at the known
  ceiling and have not been throttled recently, the partner's limit is right here and our
  requests arrived too close together for it (a token bucket of 1, a strict GCRA): the
  rate is trimmed by ``edge_trim``, and pacing turns *strict* for good (no catch-up
  bursts after a late wake-up). A deep cut here would cost a third of the run for nothing.
* **Elsewhere a 429 cuts multiplicatively** to ``decrease_factor`` of the throttled rate,
  with ``W_max`` (the plateau of the recovery) at 0.95 of it. Refused again within a
  second of resuming, on the way back from the rate just cut to (or just after an edge
  trim), the partner's burst drained at once and the limit is far below: **halve**, and
  climb back from underneath, because every step down from above costs a Retry-After pause
  of every worker while a climb costs none. Halved from the top, the climb starts at once
  (half is a floor, not a level that held), so that its probe measures the limit.
* **The limit is measured, not guessed** (:mod:`supervisor.budget.estimate`). What
  succeeded before a 429 is just our own pace, since every worker pauses on Retry-After,
  so the partner's rate is read from two overloads instead: the run's first (the top,
  from the first request to the first 429) and a failed probe's. The plateau goes 2 %
  under it and the next probe is eight times slower. A partner of another shape (a
  sliding log) yields no estimate, and halving the gap (below) is the fallback; or it
  yields one far under the rate that failed (a window, a log of 70/s read as a bucket of
  50/s): measured that far under it, the level halfway between is tried first, held as
  long as the bucket measured would let it through, and if it holds the estimate is
  dropped.
* **Recovery is CUBIC-shaped**: concave back to ``W_max`` within ``recovery_s``, flat
  there, then a convex probe that reaches the ceiling after ``probe_s``. A failed probe
  says the limit lies between the plateau, which held (``held``), and the rate that
  failed: the new plateau is halfway between them (0.97 of the failed rate if that is
  lower), and the next probe takes twice as long (up to ``max_probe_s``), or longer where
  the two are close: it reaches the rate that failed no sooner than what it can gain
  below there repays the pause a 429 costs. So a stable limit is probed ever more rarely
  while a moved one is still found. A probe refused at the top itself, unmeasured, found
  the ceiling again (a limit that came back): it is trimmed there as the run's first
  edge. Throttled on that plateau after it held, it goes halfway down to ``held`` again,
  strictly paced (with no level known to hold, or under a measured limit: strict pacing
  first, then 3 % steps), not by a deep cut, and the next probe is not put off (a close
  arrival is not a failed probe); refused more rarely since it was set than a step down
  would cost (:func:`jitter_hold`), that is jitter, and the level is kept; a step down for
  a sooner refusal is stepped back up once the lower level has held as long.
  Halving the gap finds a bucket's limit in four 429s where 3 % steps took seven, each a
  whole-second ``Retry-After``; a probe refused just over its plateau keeps the plateau,
  and refused where the edge was last found (measured or refused), the edge has not
  moved: probing slows eightfold each time, to ``max_probe_s``. Throttled on it as soon
  as it resumed, twice in a row, the limit moved down: a cut, then halving, and what held
  is forgotten.
  A cut resets the probe's length, so a limit that drops and comes back is found again
  within ``recovery_s + probe_s``.
* **One cut per episode**: a 429 for a request granted before the last cut was sent at
  the old rate and is already accounted for.
* **Retry-After pauses everyone** until then (the caller applies it to every worker); a
  429 without one pauses everyone for our own backoff (:mod:`supervisor.budget.waits`),
  0.1 s doubling per 429 in a row up to 0.25 s, or a tenth of the time the partner has
  been closed; the first request after it leaves alone (the pacer is emptied: the next one
  waits an interval, by when the first one's 429 is usually back); refused again
  with nothing accepted between, the partner is closed (a storm), not slower, and the cut
  the first 429 made is undone. A pause of ``long_pause_s`` or more (0 = never) is the
  partner's own pause (maintenance, a window), not a rate signal: the rate is kept.
* **Every pause is bounded**: none ends later than ``max_pause_s``
  (``partner.max_retry_after_seconds``) from when it began, whatever a header said.
* **An operator can lift a pause** (:class:`Resume`), and with it forget what was learnt:
  the state starts afresh at the ceiling.
* **Memory**: :func:`remembered` starts a new run from what an earlier one learnt, capped
  by the ceiling and drifting back towards it with ``half_life_s``. It trusts a plateau
  that held (``VERIFIED_AFTER`` recovery periods without a 429) and a level found by
  halving the gap to one that held, and starts a step under any other (a level on trial
  is neither: the level its measurement gave is remembered). A pause in force
  is kept, so a restart during a 900 s pause sends nothing before it ends; one ending
  later than ``max_pause_s`` from the restart (saved by a release that did not bound
  pauses, or by a clock that jumped) is dropped.
"""

from __future__ import annotations

import math
from dataclasses import replace

from supervisor.budget import estimate, waits
from supervisor.budget.policy_state import (
    Announce,
    BudgetState,
    Event,
    PolicyConfig,
    Resume,
    Success,
    Throttle,
)

# W_max sits this far under the rate that was throttled: the partner let that rate through
# for a while (its bucket), so it overstates the limit a little.
PLATEAU = 0.95
# Within this factor of a rate counts as "at" it.
NEAR = 1.03
# A probe this far over its plateau is above it, not at it (a strict pace is exact).
JUST_OVER = 1.005
# The cut when throttled again at once: the limit is far below.
HALVE = 0.5
# A 429 this soon after resuming, at the rate just cut to, means the limit is far below.
# (Not QUICK_WITHIN_S: halving on a 429 up to 1.25 - 2 s after a pause sent a hidden fixed
# window to a probe that measures it low, 1.22 - 1.27 x N/R in the model against 1.19.)
FAR_WITHIN_S = 1.0
# A 429 this soon after resuming is a quick one; two in a row on the level settled on say
# the limit moved down. A fixed window of a second spends its quota within its second, so
# at a level above it the 429 comes a second or a little more after a whole-second pause:
# counted only under a second, a first run against a hidden 1 s window stepped down 3 %
# per 429 and took 1.34 x N/R (20 429s) in the model, 1.37 over HTTP.
QUICK_WITHIN_S = 1.5
# A limit measured this far under the rate its probe failed at is put on trial: a level
# halfway between them is held TRIAL_HOLD times as long as the bucket measured could
# let it through. A window or a log (no burst to drain) fits the bucket model as well
# as a bucket does until a pace between the two is held that long: measured as a bucket,
# a sliding log of 70/s under 100/s settled at 49.6/s (1.42 - 1.49 x N/R in the model).
TRIAL_OVER = 1.4
TRIAL_HOLD = 1.5
# After a failed probe, the plateau sits this far under the rate that failed.
PROBE_BACK = 0.97
# ...or this far under the limit that probe measured (_measured).
MEASURED_BACK = 0.98
# ...and the next probe is this many times slower (a limit that rose is found within a
# minute or two, not ten seconds).
MEASURED_PROBE = 8.0
# The run's first 429 this soon after its first request measures the partner's burst.
FIRST_WITHIN_S = 5.0
# A plateau that held this many recovery periods without a 429 is trusted by memory.
VERIFIED_AFTER = 2.0
# A strictly paced level refused at most once per jitter_hold requests is kept: at least
# this many (refusals stay under 1 % of them).
JITTER_MIN_HELD = 100.0
# "At the top": pacing within this fraction of the highest rate allowed.
AT_TOP = 0.98


def top(cfg: PolicyConfig, s: BudgetState) -> float:
    """The highest rate allowed: the ceiling, lowered to the partner's announcement."""
    limit = cfg.ceiling if s.announced is None else min(cfg.ceiling, s.announced)
    return max(cfg.floor, _paced(cfg, limit, s.strict))


def _paced(cfg: PolicyConfig, limit: float, strict: bool) -> float:
    # Strict spacing never lets two requests closer than 1/rate, which is margin enough;
    # tolerant pacing catches up after late wake-ups, so it keeps a little headroom.
    return limit if strict else limit * (1.0 - cfg.headroom)


def initial(cfg: PolicyConfig) -> BudgetState:
    return BudgetState(rate=max(cfg.floor, _paced(cfg, cfg.ceiling, False)), probe_s=cfg.probe_s)


def remembered(cfg: PolicyConfig, memory: BudgetState, now: float) -> BudgetState:
    """A new life that starts from what an earlier one learnt.

    The learnt limit drifts back to the ceiling with the half-life, so a partner that has
    since raised its limit is not held low for ever; a pause in force is kept.
    """
    fresh = initial(cfg)
    kept = now < memory.paused_until and not overlong(cfg, memory, now)
    paused_until = memory.paused_until if kept else 0.0
    pause_reason = memory.pause_reason if paused_until else ""
    if memory.w_max is None:
        return replace(fresh, paused_until=paused_until, pause_reason=pause_reason,
                       strict=memory.strict, announced=memory.announced,
                       resumed_at=memory.resumed_at)
    # A plateau that never held long enough may still be a little high: start a step under
    # it, or at the last one that held if that is higher. A plateau verified early and
    # raised since by failed probes above it (each settles no lower than the one before)
    # is out of date: starting a second run there held it at half the limit (2.09).
    # Saved during a trial, the trial level is not known to hold: the level the
    # measurement gave (trial_back) is what it would have settled on.
    plateau = memory.trial_back if memory.trial_until else memory.w_max
    learnt = plateau * PROBE_BACK
    if memory.verified is not None:
        learnt = max(learnt, min(memory.verified, plateau))
    if memory.held is not None and memory.held <= plateau:
        # Found by halving the gap between a level that held and ones refused: this level
        # is the last one not refused, and a step under it would cost 3 % until the
        # next probe, minutes away for a remembered plateau.
        learnt = plateau
    age = max(0.0, now - memory.learnt_at)
    drift = 0.5 ** (age / cfg.half_life_s) if cfg.half_life_s > 0 else 0.0
    w_max = cfg.ceiling - (cfg.ceiling - min(learnt, cfg.ceiling)) * drift
    s = replace(fresh, strict=memory.strict, announced=memory.announced,
                paused_until=paused_until, pause_reason=pause_reason,
                learnt_at=memory.learnt_at, probe_s=cfg.max_probe_s,
                resumed_at=memory.resumed_at)
    w_max = max(cfg.floor, min(w_max, top(cfg, s)))
    # Hold the remembered plateau, then probe as slowly as a confirmed limit: the drift
    # across runs, not a probe within one, is what brings the rate back to the ceiling.
    # The partner's burst, as the first run measured it, is the partner's still.
    return replace(s, w_max=w_max, cut_to=w_max, cut_at=now, rate=w_max, verified=w_max,
                   last_cut="probe", first_rate=memory.first_rate, first_s=memory.first_s)


def overlong(cfg: PolicyConfig, s: BudgetState, now: float) -> bool:
    """Whether the pause in ``s`` ends later than any pause begun at ``now`` could."""
    return s.paused_until > now + cfg.max_pause_s


def step(cfg: PolicyConfig, s: BudgetState, event: Event, now: float) -> BudgetState:
    if isinstance(event, Success):
        if not s.began and s.w_max is None and not s.last_cut:
            s = replace(s, began=event.sent_at or now)  # a fresh state's first request
        return _recover(cfg, s, now)
    if isinstance(event, Throttle):
        return _throttle(cfg, s, event, now)
    if isinstance(event, Announce):
        return _announce(cfg, s, event, now)
    if isinstance(event, Resume):
        return _resume(cfg, s, event, now)
    return _pause(cfg, s, event.until, event.reason, now)


def _resume(cfg: PolicyConfig, s: BudgetState, ev: Resume, now: float) -> BudgetState:
    if ev.forget_limit:
        return replace(initial(cfg), resumed_at=now)
    return replace(s, paused_until=0.0, pause_reason="", blind=0, resumed_at=now, uncut=None)


def curve(cfg: PolicyConfig, s: BudgetState, now: float) -> float:
    """The rate the recovery allows at ``now``."""
    high = top(cfg, s)
    if s.w_max is None:
        return high
    plateau = min(s.w_max, high)
    t = now - s.cut_at
    k = _recovery_s(cfg, s)
    if t < k:
        rate = plateau - (plateau - s.cut_to) * ((k - t) / k) ** 3
    else:
        probe = min(1.0, (t - k) / max(s.probe_s, 1e-9))
        rate = plateau + (high - plateau) * probe ** 3
    return max(cfg.floor, min(high, rate))


def _recover(cfg: PolicyConfig, s: BudgetState, now: float) -> BudgetState:
    if s.blind or s.uncut is not None:
        s = replace(s, blind=0, uncut=None)  # accepted after the backoff: the cut holds
    if s.quick and _resumed_s(s, now) >= QUICK_WITHIN_S:
        # Accepted past the quick window: the run of quick refusals ends (within it, the
        # requests a fixed window takes before its 429 would end every run).
        s = replace(s, quick=0)
    if (s.first_s and s.last_cut == "edge"
            and _resumed_s(s, now) >= FAR_WITHIN_S):
        # The edge trim held: the first 429 was a close arrival at the partner's limit,
        # not the top draining its burst, so it measured nothing.
        s = replace(s, first_rate=0.0, first_s=0.0)
    s = _trial_held(s, now)
    if (s.w_max is not None and s.verified != s.w_max
            and now - s.cut_at >= VERIFIED_AFTER * cfg.recovery_s):
        s = replace(s, verified=s.w_max)
    if (s.steps and s.w_max is not None and s.rate <= s.w_max * JUST_OVER
            and now - s.cut_at >= s.step_back_s):
        # Held for the step's break-even: the refusal was as likely a partner's stall.
        up = min(top(cfg, s), s.w_max / PROBE_BACK)
        s = replace(s, rate=up, w_max=up, cut_to=up, cut_at=now, learnt_at=now,
                    steps=s.steps - 1)
    rate = curve(cfg, s, now)
    if (s.w_max is not None and rate >= top(cfg, s)
            and now - s.cut_at >= 2 * cfg.recovery_s + s.probe_s):
        # The probe reached the top and held it a recovery period without a 429: whatever
        # was learnt no longer holds. Forgotten as soon as it got there, a limit at 85 %
        # of the ceiling behind a bucket of 10 (which let the probe's last steps through)
        # was found again from the ceiling by an edge trim and a halving every 20 s (1.64).
        return replace(s, rate=rate, w_max=None, verified=None, held=None,
                       probe_s=cfg.probe_s)
    return s if rate == s.rate else replace(s, rate=rate)


def _throttle(cfg: PolicyConfig, s: BudgetState, ev: Throttle, now: float) -> BudgetState:
    imposed = (cfg.long_pause_s > 0 and ev.retry_after_s is not None
               and ev.retry_after_s >= cfg.long_pause_s)
    # Refused again with no time given and nothing accepted since our own backoff: the
    # partner is closed (a storm), not slower. Back off longer; cutting again would
    # take the rate to the floor for a pause it never announced.
    closed = ev.retry_after_s is None and s.blind > 0
    if closed and s.uncut is not None and ev.sent_at >= s.cut_at:
        # Closed, not slower: the cut the storm's first 429 made is undone, or the run
        # would climb back from it for recovery_s after every storm. (A 429 for a request
        # sent before that cut says nothing: it was in flight.)
        s = _undo(cfg, s)
    # No Retry-After: everyone backs off on our own clock, doubling while the 429s keep
    # coming (a pause the partner imposes without saying how long).
    backoff = waits.blind_backoff(s.blind, now - s.blind_since if s.blind else 0.0)
    if ev.sent_at >= s.cut_at and not imposed and not closed:
        quick = 0 <= _resumed_s(s, now) < QUICK_WITHIN_S
        before = s
        pause_s = backoff if ev.retry_after_s is None else ev.retry_after_s
        s = replace(_cut(cfg, s, now, ev.sent_at, min(pause_s, cfg.max_pause_s), _lag(ev)),
                    quick=s.quick + 1 if quick else 0)
        if ev.retry_after_s is None and s.blind == 0:
            s = replace(s, uncut={k: getattr(before, k) for k in _LEARNT})
    if ev.retry_after_s is not None:
        if ev.retry_after_s > 0:
            s = _pause(cfg, s, now + ev.retry_after_s, "retry-after", now)
        return replace(s, blind=0, uncut=None)
    return replace(_pause(cfg, s, now + backoff, "429 without retry-after", now),
                   blind=s.blind + 1, blind_since=s.blind_since if s.blind else now)


def _undo(cfg: PolicyConfig, s: BudgetState) -> BudgetState:
    """``s`` as it was before the cut recorded in ``uncut`` (never above the top now)."""
    was = {k: v for k, v in (s.uncut or {}).items() if k in _LEARNT}
    s = replace(s, **was, uncut=None)
    high = top(cfg, s)
    return replace(s, rate=min(s.rate, high),
                   w_max=None if s.w_max is None else min(s.w_max, high))


# What a cut changes, and a storm's undoing restores.
_LEARNT = ("rate", "w_max", "cut_to", "cut_at", "probe_s", "strict", "learnt_at", "last_cut",
           "verified", "quick", "held", "estimate", "recover_s", "kept", "kept_level",
           "kept_since", "steps", "step_back_s", "trial_until", "trial_back")


def _resumed_s(s: BudgetState, now: float) -> float:
    """Seconds since requests went out again after the last cut and its pause."""
    return now - max(s.paused_until, s.cut_at)


def _lag(ev: Throttle) -> float:
    return max(0.0, ev.sent_at - ev.paced_at) if ev.paced_at else 0.0


def _cut(cfg: PolicyConfig, s: BudgetState, now: float, sent_at: float,
         pause_s: float, lag_s: float = 0.0) -> BudgetState:
    rate = s.rate
    high = top(cfg, s)
    if s.trial_until and now <= s.trial_until:
        # The trial level refused in time: the partner is the bucket that was measured.
        return _settle(cfg, s, s.trial_back, now, probe_s=s.probe_s)
    s = _trial_held(s, now)
    if s.w_max is None:
        if rate >= AT_TOP * high and not s.strict:
            # An edge: the partner's limit is about the ceiling and two of our requests
            # came too close together for it. Trim, pace strictly, hardly ever re-probe.
            edge = _trim_edge(cfg, s, now, "edge")
            if s.began and not s.last_cut and 0 < sent_at - s.began <= FIRST_WITHIN_S:
                # The run's first 429, soon after the start at the top: what the partner
                # took until then was its burst plus its rate over that time.
                edge = replace(edge, first_rate=rate, first_s=sent_at - s.began)
            return edge
        return _lower(cfg, s, rate * cfg.decrease_factor, rate * PLATEAU, now)
    # Refused again within a second of resuming, on the way back from the rate just cut
    # to (or right after an edge trim): the partner's burst drained at once, so the limit
    # is far below. (With the default recovery_seconds, the curve climbs a third of the way
    # during a whole-second pause: matched only at the rate cut to, a bucket of one was cut
    # by 0.8 a second for ten seconds.)
    plateau = s.w_max
    resumed_s = _resumed_s(s, now)
    if (s.last_cut in ("edge", "top", "lower") and resumed_s < FAR_WITHIN_S
            and rate <= plateau * NEAR):
        # Halve, and climb back from underneath: a climb costs no pause, every step down
        # from above costs one. Pacing stays strict after a refuted edge: strictness costs
        # a late departure's lateness (under 1 %), while a bucket of one refuses tolerant
        # pacing's catch-up bursts (a quarter of an interval early) at any rate over 3/4
        # of its limit; tolerant again, a first run there was refused at once at half the
        # ceiling, halved again to a quarter and took 1.63 - 1.76 x N/R.
        low = _lower(cfg, s, rate * HALVE, rate * HALVE, now)
        if s.last_cut in ("edge", "top"):
            # The top refused twice at once: the limit is somewhere under it, and half is
            # a floor, not a level that held. Climb at once: the probe's 429 measures the
            # limit (_measured), where holding half for a recovery period first cost a
            # quarter of a 30 s run against a limit at 84 % of the ceiling.
            low = replace(low, recover_s=0.0)
        return low
    if rate > plateau * NEAR:
        # A probe above the plateau failed: the limit lies between the plateau, which held
        # through the recovery, and this rate, which the partner's burst let through for a
        # while before the 429 (a bucket of 10 let a probe reach 1.16 x its limit). Settle
        # halfway between them, or a step under the failed rate if that is lower: a step
        # under it was still above the limit, and each step down cost a whole-second
        # Retry-After (seven 429s to find a bucket's limit, where bisecting takes four).
        # The next probe waits twice as long.
        held = max(plateau, s.held or 0.0)
        level = max(plateau, min(rate * PROBE_BACK, (held + rate) / 2))
        found = _measured(cfg, s, plateau, rate, sent_at, lag_s)
        if found is None and rate >= AT_TOP * high:
            # Refused at the top itself after climbing all the way back, and not
            # measured: the limit is the ceiling again (it came back after a drop), and
            # this was a close arrival there. Trimmed like the run's first edge; halfway
            # down to a level that held while the limit was low put a bucket of one at
            # 60 % of a limit back at R (1.58 x over HTTP, 1.43 - 1.49 now). Refused
            # again at once, it is halved as after that edge; labelled "top", not "edge",
            # so its holding keeps the burst the run's first overload measured.
            return _trim_edge(cfg, replace(s, held=None, estimate=None), now, "top")
        if found is None:
            # Not measured (a sliding log or a window has no burst to drain): the limit
            # is somewhere between the two, and the next probe waits until what it can
            # gain there repays the 429 it may cost (waits.repaid_s), or twice as long as this
            # one, whichever is longer.
            probe_s = max(2 * s.probe_s, waits.repaid_s(level, rate, high, pause_s))
            return _settle(cfg, replace(s, held=held), level, now,
                           probe_s=min(cfg.max_probe_s, probe_s))
        # Measured: settle just under it, and probe again eight times more slowly (each
        # probe costs a 429, and a limit just over the level settled on is met within
        # a 30 s run by a probe only twice as slow). Measured again where it was, the
        # edge has not moved: no probing for the longest probe.
        level = max(plateau, min(rate * PROBE_BACK, found * MEASURED_BACK))
        same = _same_edge(s, found)
        probe_s = min(cfg.max_probe_s,
                      cfg.max_probe_s if same else s.probe_s * MEASURED_PROBE)
        measured = replace(s, held=held, estimate=found)
        if rate > TRIAL_OVER * found and not same:
            # Far under what failed: try halfway first, flat until the bucket measured
            # would have refused it (the curve's recovery). Refused in time, it is that
            # bucket, and the level goes where it would have; held, it is not
            # (_trial_held). A bucket pays a 429 for the trial where its probe overshot
            # that far: three of the model's grid, limits at 10 - 35 % of the ceiling,
            # 0.024 - 0.031 slower (its mean 1.146 -> 1.148); the log 1.20 - 1.26.
            # (found < min(rate, first_rate), estimate.limit's bracket: no zero here.)
            trial = (found + rate) / 2
            hold_s = TRIAL_HOLD * (s.first_rate - found) * s.first_s / (trial - found)
            if pause_s + hold_s <= cfg.recovery_s:
                return replace(_settle(cfg, measured, trial, now, probe_s=probe_s),
                               trial_until=now + pause_s + hold_s, trial_back=level)
        return _settle(cfg, measured, level, now, probe_s=probe_s)
    if rate > plateau * JUST_OVER and now - s.cut_at >= _recovery_s(cfg, s):
        # The probe, refused just over the plateau that held through the recovery: the
        # limit is right there, so the plateau is kept (stepping down halfway to an older
        # level, as for the level itself refused, put a sliding log 1 % lower at every
        # probe). Refused where the edge was last found, it has not moved: probe eight
        # times more slowly. Otherwise the next probe comes no later (a limit that came
        # back after a drop is still found within 15 s).
        probe_s = s.probe_s * MEASURED_PROBE if _same_edge(s, rate) else s.probe_s
        return _settle(cfg, replace(s, held=max(plateau, s.held or 0.0), estimate=rate),
                       plateau, now, probe_s=min(cfg.max_probe_s, probe_s))
    if rate <= s.cut_to * NEAR and resumed_s < QUICK_WITHIN_S and s.quick:
        # The level we settled on, refused soon after we resumed, twice in a row: not a
        # close arrival (a bucket of one refuses those at random, so once soon after a
        # pause proves nothing) but a limit that moved down. Cut; refused at once, halve
        # (a fixed window refuses a second or more after each pause: cut again, here).
        return _lower(cfg, s, rate * cfg.decrease_factor, rate * PLATEAU, now)
    if rate <= s.cut_to * NEAR:
        # The level we settled on was refused after holding a while. Under a level that
        # held (a failed probe's plateau), the limit is between the two: pace strictly
        # halfway down to it. Otherwise it may be a partner that refuses close arrivals
        # (a bucket of one token) at a rate it otherwise takes: pace strictly first;
        # already strict, a step lower. None of these is a failed probe: the next probe
        # comes no later than it would have.
        same = abs(rate - s.kept_level) <= (JUST_OVER - 1.0) * rate
        kept, since = (s.kept, s.kept_since) if same else (0, s.cut_at)
        jitter = (s.strict
                  and (now - since) * rate >= (kept + 1) * jitter_hold(rate, pause_s))
        # (A level set under a measured limit is a step from it, not halfway to an old
        # level: halfway to one held before the limit rose to 80/s put the rate at 65.)
        if (not jitter and s.held is not None and rate > s.held * NEAR
                and s.estimate is None):
            return _settle(cfg, replace(s, strict=True), (s.held + rate) / 2, now,
                           probe_s=s.probe_s)
        if not s.strict:
            return _settle(cfg, replace(s, strict=True), min(rate, top(cfg, s)), now,
                           probe_s=s.probe_s)
        if jitter:
            # Already strict, and refused no more often since the level was set than
            # jitter_hold allows: the host's jitter meeting a strict partner, not a level
            # too high. Keep it (the pauses are the whole cost). Stepping down on every
            # rare one lost 3 % a time for good (a bucket of one at 20/s fell to 83 % over
            # 920 s); counted from the last refusal, not on average, refusals at random
            # came too close half the time (the same behind nginx fell to 75 %).
            return replace(s, cut_to=rate, cut_at=now, learnt_at=now, last_cut="probe",
                           kept=kept + 1, kept_level=rate, kept_since=since)
        # Stepped back up once the lower level has held for the step's break-even
        # (_recover): a partner that stalls now and then refuses at any level, and every
        # step kept for good walked a long run down (a bucket of one at 20/s to 17.1/s).
        step = rate * PROBE_BACK
        return replace(_settle(cfg, s, step, now, probe_s=s.probe_s), steps=s.steps + 1,
                       step_back_s=jitter_hold(step, pause_s) / step)
    # Throttled while climbing back to the plateau: the plateau itself is too high.
    return _lower(cfg, s, rate * cfg.decrease_factor, rate * PLATEAU, now)


def jitter_hold(rate: float, pause_s: float) -> float:
    """Requests per refusal (on average) under which a strictly paced level is kept, when
    a refusal costs a pause of ``pause_s``: the host's jitter, not a level too high.

    Keeping the level costs each refusal its pause and its request; a step down costs
    ``1 - PROBE_BACK`` of every request after it. Refused more rarely than that break-even,
    the level costs less than the step would. Behind nginx (a bare 429, our 0.1 s pause)
    that is 100 requests, where a fixed 1,000 stepped a 20/s run down 3 % a time to 75 %
    of its limit within 390 s; a whole-second Retry-After at 20/s asks for 700.
    """
    return max(JITTER_MIN_HELD, (pause_s * rate + 1.0) / (1.0 - PROBE_BACK))


def _measured(cfg: PolicyConfig, s: BudgetState, plateau: float, failed: float,
              refused_at: float, lag_s: float = 0.0) -> float | None:
    """The partner's rate, from a probe above ``plateau`` refused at ``refused_at``, its
    requests paced at the curve ``lag_s`` late (measured on the curve itself, replicas'
    slots reserved up to 0.5 s ahead measured a bucket of 50/s at 51 - 53/s)."""
    start = s.cut_at + _recovery_s(cfg, s)
    return estimate.limit(lambda t: curve(cfg, s, max(s.cut_at, t - lag_s)), start,
                          refused_at, plateau, min(failed, s.first_rate), s.first_rate,
                          s.first_s)


def _trial_held(s: BudgetState, now: float) -> BudgetState:
    """``s`` with a trial that has run its course without a 429 concluded: the trial
    level held longer than the bucket measured could have let it through, so the partner
    is not that bucket (a window, a log) and the measurement is void; the limit lies
    between the trial level, which held, and the rate that failed. The next probe keeps
    the measurement's slower pace: in the model a 16 s one found a log of 70/s sooner over
    300 s (1.085 -> 1.051) and cost a 30 s run a 429 more (1.20 - 1.26 -> 1.21 - 1.27)."""
    if not s.trial_until or now <= s.trial_until:
        return s
    return replace(s, trial_until=0.0, trial_back=0.0, held=s.w_max, estimate=None)


def _same_edge(s: BudgetState, rate: float) -> bool:
    """Whether ``rate`` is where the edge was last found (measured or refused)."""
    return s.estimate is not None and abs(rate - s.estimate) <= (NEAR - 1.0) * s.estimate


def _recovery_s(cfg: PolicyConfig, s: BudgetState) -> float:
    return cfg.recovery_s if s.recover_s is None else s.recover_s


def _trim_edge(cfg: PolicyConfig, s: BudgetState, now: float, label: str) -> BudgetState:
    """A 429 at the top taken for a close arrival at a limit right there: trim the rate
    by ``edge_trim``, pace strictly, and hardly ever probe again."""
    trimmed = _settle(cfg, replace(s, strict=True), s.rate * (1.0 - cfg.edge_trim), now,
                      probe_s=cfg.max_probe_s)
    return replace(trimmed, last_cut=label)


def _settle(cfg: PolicyConfig, s: BudgetState, w_max: float, now: float,
            probe_s: float | None = None) -> BudgetState:
    """Settle at ``w_max``; the next probe takes ``probe_s`` (default: twice as long)."""
    w_max = max(cfg.floor, w_max)
    probe_s = min(cfg.max_probe_s, s.probe_s * 2) if probe_s is None else probe_s
    return replace(s, rate=w_max, w_max=w_max, cut_to=w_max, cut_at=now, learnt_at=now,
                   probe_s=probe_s, last_cut="probe", recover_s=None, steps=0,
                   trial_until=0.0, trial_back=0.0)


def _lower(cfg: PolicyConfig, s: BudgetState, cut_to: float, w_max: float,
           now: float) -> BudgetState:
    # A cut says the limit moved down (or was never found): what held before says nothing.
    cut_to = max(cfg.floor, cut_to)
    return replace(s, w_max=max(cut_to, w_max), cut_to=cut_to, cut_at=now, rate=cut_to,
                   probe_s=cfg.probe_s, learnt_at=now, last_cut="lower", held=None,
                   trial_until=0.0, trial_back=0.0,
                   estimate=None, recover_s=None, steps=0)


def _announce(cfg: PolicyConfig, s: BudgetState, ev: Announce, now: float) -> BudgetState:
    # Out of range (0, a window so short the rate overflows to infinity): no limit to
    # keep. An infinite one would also make the state unserialisable as JSON.
    if ev.rate == s.announced or (ev.rate is not None and not 0 < ev.rate < math.inf):
        return s
    was = top(cfg, s)
    s = replace(s, announced=ev.rate, uncut=None)  # what it knew before is not to come back
    high = top(cfg, s)
    if high > was and s.w_max is not None and s.w_max >= PLATEAU * was:
        # Learnt at the announced limit (an edge of it, probed every 600 s): the partner
        # now announces more, so that edge is its old limit. Kept, a limit cut to a
        # quarter and announced back held the rate at the quarter for the rest of a run.
        return replace(s, rate=high, w_max=None, verified=None, held=None,
                       probe_s=cfg.probe_s, cut_at=now, cut_to=high)
    if s.rate > high:
        # Like a cut (so a 429 in the same answer does not cut again), but to the
        # announced limit itself: the partner said exactly what it allows. What was
        # learnt is kept as it was (the curve never goes above the announcement): capped
        # here, a 429 at the top just before a lowered announcement held the rate at the
        # low one for a 600 s probe after the partner announced its limit back.
        return replace(s, rate=high, cut_at=now, cut_to=high)
    if s.w_max is None:
        return replace(s, rate=high)
    return s


def _pause(cfg: PolicyConfig, s: BudgetState, until: float, reason: str,
           now: float) -> BudgetState:
    if not math.isfinite(until):
        return s
    until = min(until, now + cfg.max_pause_s)
    if until <= s.paused_until:
        return s
    return replace(s, paused_until=until, pause_reason=reason)
