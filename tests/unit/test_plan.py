"""`cleanup-supervisor plan`: N / R, whether cron alone fits, and the finish against the
digest cutoff, judged on the worst measured overhead."""

from __future__ import annotations

import pytest

from supervisor.plan import CRON_MARGIN, OVERHEADS, Plan, duration, render

START = 1_800_000_000.0


def _plan(n: int, rate: float, cutoff_s: float | None = None, limit: str = "known",
          ceiling: float = 900.0) -> Plan:
    return Plan(candidates=n, rate=rate, cron_ceiling_s=ceiling, limit=limit,  # type: ignore[arg-type]
                start=START, cutoff_s=cutoff_s)


def test_the_articles_monday_does_not_fit_cron_alone() -> None:
    p = _plan(18_400, 20, cutoff_s=6 * 3600)
    assert p.ideal_s == 920
    assert not p.cron_fits
    typical, worst = p.drain_s
    assert typical == pytest.approx(920 * OVERHEADS["known"].typical)
    assert worst == pytest.approx(920 * OVERHEADS["known"].worst)
    assert p.fits_cutoff is True
    text = render(p)
    assert "does not fit" in text
    assert "102%" in text
    assert "fits," in text


def test_cron_alone_fits_only_with_half_the_ceiling_to_spare() -> None:
    assert _plan(int(900 * CRON_MARGIN * 20), 20).cron_fits
    tight = _plan(int(900 * CRON_MARGIN * 20) + 20, 20)
    assert not tight.cron_fits
    assert "too tight" in render(tight)


def test_the_cutoff_is_judged_on_the_worst_case() -> None:
    # 10,000 s ideal: the typical drain (x1.012) ends before a 10,500 s cutoff, the worst
    # (x1.134) after it.
    p = _plan(200_000, 20, cutoff_s=10_500)
    assert START + p.drain_s[0] < p.cutoff  # type: ignore[operator]
    assert p.fits_cutoff is False
    assert "MISSED by" in render(p)
    assert _plan(200_000, 20).fits_cutoff is None
    assert "not set" in render(_plan(200_000, 20))


def test_a_limit_learnt_from_429s_plans_for_more_overhead() -> None:
    assert _plan(6000, 20, limit="learnt").drain_s[1] > _plan(6000, 20).drain_s[1]
    assert all(o.worst >= o.typical >= 1 for o in OVERHEADS.values())


def test_durations_read_like_a_person_wrote_them() -> None:
    assert duration(920) == "15 min 20 s"
    assert duration(3600) == "1 h"
    assert duration(0.4) == "0 s"
    assert duration(3725) == "1 h 2 min 5 s"


def test_a_quota_smaller_than_n_sets_the_least_time() -> None:
    # 18,400 at 20/s is 920 s, but a daily quota of 10,000 makes it a day and a bit.
    p = Plan(candidates=18_400, rate=20, cron_ceiling_s=900, limit="known", start=START,
             cutoff_s=6 * 3600, quotas=(("day", 10_000, 86_400.0),))
    assert p.quota_s(10_000, 86_400) == 86_400
    assert p.least_s == 86_400
    assert p.drain_s == (86_400, 86_400)  # the quota, not the rate, is the bound
    assert p.fits_cutoff is False
    text = render(p)
    assert "quota day" in text
    assert "10,000 per 24 h: N needs at least 24 h" in text
    # A quota N fits inside changes nothing.
    roomy = Plan(candidates=18_400, rate=20, cron_ceiling_s=900, limit="known", start=START,
                 cutoff_s=None, quotas=(("day", 100_000, 86_400.0),))
    assert roomy.least_s == roomy.ideal_s == 920
