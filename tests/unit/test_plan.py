"""`cleanup-supervisor plan`: N / R, whether cron alone fits, and the finish against the
digest cutoff, judged on the worst measured overhead; for a batch partner, what its limit
counts, its probes and its jobs."""

from __future__ import annotations

import math

import pytest

from supervisor.batchsettings import BatchConfig
from supervisor.plan import (
    CRON_MARGIN,
    OVERHEADS,
    Batching,
    Plan,
    batching,
    duration,
    polls_per_job,
    render,
)

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


# Batch partners ([batch], docs/batch.md): the article's 18,400 at 20/s, K = 100.

def _batch(shape: str, cost: str = "requests", probe: bool = True,
           job_s: float | None = None, n: int = 18_400, cutoff_s: float | None = 6 * 3600,
           quotas: tuple[tuple[str, int, float], ...] = (),
           items_per_second: float = 0.0) -> Plan:
    b = Batching(shape=shape, size=100, cost=cost, probe_accepted=probe,  # type: ignore[arg-type]
                 max_jobs_in_flight=4, job_s=job_s, poll_initial_s=0.5, poll_max_s=30.0,
                 items_per_second=items_per_second)
    return Plan(candidates=n, rate=20, cron_ceiling_s=900, limit="known", start=START,
                cutoff_s=cutoff_s, quotas=quotas, batch=b)


def test_single_says_so_and_keeps_its_numbers() -> None:
    p = _plan(18_400, 20)
    assert (p.shape, p.batches, p.probes, p.polls, p.requests, p.units) == (
        "single", 18_400, 0, 0, 18_400, 18_400)
    text = render(p)
    assert 'shape            single: one DELETE per recipient (batch.shape = "")' in text
    assert "N / R            = 15 min 20 s (920 s): the least any tool can take" in text
    doc = p.as_dict()
    assert (doc["batch"], doc["shape"], doc["ideal_seconds"]) == (None, "single", 920)


def test_a_batch_charged_per_request_takes_184_requests_and_9_seconds() -> None:
    p = _batch("per_item")
    assert (p.batches, p.requests, p.units) == (184, 184, 184)
    assert p.ideal_s == p.least_s == pytest.approx(9.2)
    assert p.cron_fits
    assert p.drain_s == pytest.approx((9.2 * OVERHEADS["known"].typical,
                                       9.2 * OVERHEADS["known"].worst))
    text = render(p)
    assert "shape            batch per_item: up to K = 100 ids a request; R counts requests" in text
    assert "ceil(N / K) = 184 batches" in text
    assert "ceil(N / K) / R  = 9 s (9.2 s)" in text
    assert "cron alone       fits" in text


def test_a_batch_charged_per_id_is_no_faster_than_singles() -> None:
    p = _batch("per_item", cost="items")
    assert p.batches == 184  # requests sent...
    assert p.units == 18_400  # ...but the limit counts ids
    assert p.ideal_s == 920
    assert not p.cron_fits
    text = render(p)
    assert "R = 20 ids/s" in text
    assert "batches do not speed it up; they send 184 requests instead of 18,400" in text


def test_an_accepted_batch_pays_a_probe_per_id_as_much_as_singles() -> None:
    p = _batch("accepted")
    assert (p.batches, p.probes, p.requests) == (184, 18_400, 18_584)
    assert p.ideal_s == pytest.approx((184 + 18_400) / 20)  # 929.2 s, singles take 920 s
    assert not p.cron_fits
    text = render(p)
    assert "(ceil(N / K) + N) / R = 15 min 29 s (929 s)" in text
    assert "costs about as much as one DELETE per recipient at the same rate" in text
    # Charged per id, the probes double the singles' time.
    items = _batch("accepted", cost="items")
    assert items.ideal_s == 2 * 920
    assert "costs twice one DELETE per recipient" in render(items)


def test_an_accepted_batch_settled_unprobed_is_fast_and_says_what_it_risks() -> None:
    p = _batch("accepted", probe=False)
    assert (p.probes, p.requests) == (0, 184)
    assert p.ideal_s == pytest.approx(9.2)
    assert p.cron_fits
    assert "a silent miss goes unseen" in render(p)


def test_jobs_of_unknown_duration_leave_cron_and_the_cutoff_undecided() -> None:
    p = _batch("job")
    assert (p.batches, p.waves, p.polls, p.job_floor_s) == (184, 46, None, None)
    assert p.ideal_s == pytest.approx(9.2)  # the submissions alone
    assert p.cron_fits is None
    assert p.fits_cutoff is None  # the submissions fit; the jobs' time decides
    text = render(p)
    assert "the floor is ceil(184 / 4) x D = 46 x D" in text
    assert "cron alone       unknown" in text
    assert "--job-seconds D" in text
    doc = p.as_dict()
    assert (doc["cron_alone_fits"], doc["polls"], doc["job_floor_seconds"]) == (None, None, None)
    # Submissions that miss the cutoff on their own miss it whatever the jobs take.
    assert _batch("job", cutoff_s=5).fits_cutoff is False


def test_jobs_of_a_known_duration_bound_the_drain_in_rounds_of_jobs_in_flight() -> None:
    p = _batch("job", job_s=60)
    # Read at ages 0.5, 1, 2, 4, 8, 16 and 32 s (the wait as long as the job's age), then
    # 30 s later: 8 reads a job.
    assert polls_per_job(60, 0.5, 30) == 8
    assert (p.batches, p.polls, p.requests) == (184, 184 * 8, 184 * 9)
    assert p.ideal_s == pytest.approx(184 * 9 / 20)  # each poll is one request of the budget
    assert p.job_floor_s == 46 * 60  # ceil(184 / 4) rounds of 60 s
    assert p.least_s == p.drain_s[0] == p.drain_s[1] == 2760
    assert not p.cron_fits
    text = render(p)
    assert "46 rounds x 1 min = 46 min" in text
    assert "8 a job (from 0.5 s, the wait doubling to 30 s), 1,472 in all" in text
    assert "the jobs' own time, not the rate, bounds it" in text
    # Charged per id, a status read carries none.
    items = _batch("job", cost="items", job_s=60)
    assert (items.units, items.ideal_s) == (18_400, 920)


def test_polls_of_a_long_job_are_counted_not_looped() -> None:
    assert polls_per_job(0.5, 0.5, 30) == 1
    assert polls_per_job(3600, 0.5, 30) == 7 + 119  # read at 32 s, then every 30 s
    assert polls_per_job(86_400 * 365, 0.5, 30) == 7 + math.ceil((86_400 * 365 - 32) / 30)
    assert polls_per_job(100, 30, 30) == 4  # 30, 60, 90, 120


def test_cron_alone_fits_when_one_request_takes_the_whole_batch() -> None:
    p = _batch("per_item", n=80)
    assert (p.batches, p.requests) == (1, 1)
    assert p.cron_fits
    assert "one request takes all 80 ids (N <= K)" in render(p)
    # Many batches well inside the ceiling fit too, as singles do: 9,000 batches at 20/s
    # are exactly half of 900 s.
    assert _batch("per_item", n=int(900 * CRON_MARGIN * 20) * 100).cron_fits
    assert not _batch("per_item", n=int(900 * CRON_MARGIN * 20) * 100 + 1).cron_fits


def test_a_quota_counts_what_the_limit_counts() -> None:
    day = (("day", 100, 86_400.0),)
    # 184 batch requests against 100 a day: two days' allowances, one day waited out.
    assert _batch("per_item", quotas=day).least_s == 86_400
    # Per id, 18,400 ids are 184 allowances.
    assert _batch("per_item", cost="items", quotas=day).least_s == 183 * 86_400


def test_the_batch_section_and_the_flags_make_the_batching() -> None:
    assert batching(BatchConfig()) is None  # shape "": one DELETE per recipient
    b = batching(BatchConfig(shape="accepted", max_items=50, cost="items",
                             settle_accepted_unprobed_risking_silent_misses=True,
                             max_jobs_in_flight=2))
    assert b == Batching(shape="accepted", size=50, cost="items", probe_accepted=False,
                         max_jobs_in_flight=2)
    # The flags win over the section, "" included.
    b = batching(BatchConfig(shape="accepted"), shape="job", size=200, cost="requests",
                 job_s=30)
    assert b is not None
    assert (b.shape, b.size, b.cost, b.job_s) == ("job", 200, "requests", 30)
    assert batching(BatchConfig(shape="job"), shape="") is None


def test_two_limits_take_the_longer_of_the_requests_and_the_ids() -> None:
    # 184 batches at 20 requests/s take 9.2 s; 18,400 ids at 500 ids/s take 36.8 s.
    p = _batch("per_item", cost="both", items_per_second=500.0)
    assert (p.requests, p.units) == (184, 184)
    assert p.items_s == pytest.approx(36.8)
    assert p.ideal_s == p.least_s == pytest.approx(36.8)
    assert "the ids' limit binds" in render(p)
    # 5,000 ids/s: the requests bind again (3.68 s of ids, 9.2 s of requests).
    p = _batch("per_item", cost="both", items_per_second=5000.0)
    assert p.ideal_s == pytest.approx(9.2)
    assert "the requests' limit binds" in render(p)
    # An accepted partner's probes take an id's token each as well.
    p = _batch("accepted", cost="both", items_per_second=500.0)
    assert p.items_s == pytest.approx(2 * 18_400 / 500)
