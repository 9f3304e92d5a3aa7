"""Batch partners end to end (issue 19, docs/batch.md): the service against the partner
simulator playing each answer shape with the quirks real partners have. Every operation
settles on its own item's verdict (or its own probe); nothing is executed twice; what
the partner refuses whole is sent again without being counted as an attempt."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.harness import E2E, Sandbox, Service

pytestmark = pytest.mark.e2e

N = 600


def _service(e2e: E2E, sandbox: Sandbox, shape: str, rate: float = 50.0,
             partner: dict[str, Any] | None = None, **batch: Any) -> Service:
    path = {"per_item": "/recipients/batch-delete", "accepted": "/recipients/batch-archive",
            "job": "/recipients/batch-jobs"}[shape]
    overrides: dict[str, dict[str, Any]] = {
        "batch": {"shape": shape, "path": path, "max_items": 50, "linger_seconds": 0.02,
                  "poll_initial_seconds": 0.2, "poll_max_seconds": 1.0, **batch},
        "partner": {"backoff_initial_seconds": 0.05, "backoff_max_seconds": 0.5,
                    **(partner or {})},
        "limits": {"rate_per_second": rate, "concurrency": 4}}
    return e2e.service(sandbox, overrides)


async def _drain(svc: Service) -> dict[str, Any]:
    await svc.start()
    run = await svc.wait_done(await svc.open_run())
    assert run["unfinished"] == 0, run
    return run


async def _attempt_details(svc: Service, run_id: str, state: str) -> list[str]:
    out = []
    for op in await svc.operations(run_id, state=state):
        detail = await svc.operation(op["id"])
        out.append(detail["attempts_log"][-1]["detail"] or "")
    return out


async def test_per_item_each_operation_settles_on_its_own_verdict(e2e: E2E) -> None:
    sandbox = await e2e.sandbox("--recipients", N, "--rate", 200, "--batch", "per_item",
                                "--batch-item-throttle-share", 0.1,
                                "--batch-item-error-share", 0.03)
    svc = _service(e2e, sandbox, "per_item")
    run = await _drain(svc)
    stats = await sandbox.stats()
    c = run["counts"]
    assert c["deleted"] + c["already_absent"] + c["failed"] == N, run
    assert c["ambiguous"] == 0, run
    # The ids the partner fails for good are the failed operations, and only they are
    # left present: a per-item 429 was sent again until it was deleted.
    # The ids the partner fails for good are the failed operations (present or not).
    assert c["failed"] == stats["batch_item_errors"] > 0, (run, stats)
    assert stats["present"] <= c["failed"], (run, stats)
    assert c["already_absent"] + c["failed"] >= stats["initially_absent"], (run, stats)
    assert stats["deleted"] == c["deleted"], stats
    assert stats["duplicates"] == 0, stats
    assert stats["batch_item_throttled"] > 0, stats
    # A batch request per 50 ids, plus the resends of throttled items: far below one
    # request per operation.
    assert stats["requests"] < N / 5, stats
    details = await _attempt_details(svc, run["id"], "failed")
    assert all(d.startswith("item HTTP 422 in batch bat_") for d in details), details


async def test_a_bad_id_is_split_out_and_fails_alone(e2e: E2E) -> None:
    # HubSpot's legacy batch: one bad id fails the whole batch (400), nothing done.
    sandbox = await e2e.sandbox("--recipients", 200, "--rate", 500, "--batch", "per_item",
                                "--batch-bad-id-pattern", "^r-000077$")
    svc = _service(e2e, sandbox, "per_item")
    run = await _drain(svc)
    failed = await svc.operations(run["id"], state="failed")
    assert [op["recipient_id"] for op in failed] == ["r-000077"], run
    stats = await sandbox.stats()
    assert stats["present"] == 1, stats
    assert stats["deleted"] == run["counts"]["deleted"], stats
    assert stats["duplicates"] == 0, stats
    # Halving a batch of 50 down to the bad id takes a handful of requests, not 50.
    assert stats["batch_refused_bad_id"] <= 2 * 6, stats


async def test_the_partners_cap_is_learnt_from_413(e2e: E2E) -> None:
    sandbox = await e2e.sandbox("--recipients", 300, "--rate", 500, "--batch", "per_item",
                                "--batch-max-items", 20)
    svc = _service(e2e, sandbox, "per_item", max_items=100)
    run = await _drain(svc)
    stats = await sandbox.stats()
    assert run["counts"]["deleted"] + run["counts"]["already_absent"] == 300, run
    assert stats["present"] == 0, stats
    assert stats["deleted"] == run["counts"]["deleted"], stats
    assert stats["duplicates"] == 0, stats
    # Halved on each refusal until it fits (100, 50, 25, then 12): the batches of each
    # size refused at most once each per request in flight (4) before the cap is learnt,
    # a whole batch refused splitting into two of the next size. Never again after.
    assert 1 <= stats["batch_refused_too_large"] <= 4 * (1 + 2 + 4), stats


async def test_accepted_whole_is_confirmed_by_probes_and_silent_misses_sent_again(
        e2e: E2E) -> None:
    sandbox = await e2e.sandbox("--recipients", 300, "--rate", 500, "--batch", "accepted",
                                "--batch-silent-miss-share", 0.1)
    svc = _service(e2e, sandbox, "accepted")
    run = await _drain(svc)
    stats = await sandbox.stats()
    c = run["counts"]
    assert c["deleted"] == 300, run
    assert c["failed"] == c["ambiguous"] == 0, run
    assert stats["present"] == 0, stats  # every silent miss found and deleted
    assert stats["batch_silent_misses"] > 0, stats
    # A silent miss is sent again once found present; nothing is deleted twice.
    assert stats["deleted"] == 300 - stats["initially_absent"], stats
    assert stats["duplicates"] == 0, stats


async def test_accepted_unprobed_settles_on_the_batch_as_its_setting_warns(e2e: E2E) -> None:
    sandbox = await e2e.sandbox("--recipients", 200, "--rate", 500, "--batch", "accepted",
                                "--batch-silent-miss-share", 0.1)
    svc = _service(e2e, sandbox, "accepted",
                   settle_accepted_unprobed_risking_silent_misses=True)
    run = await _drain(svc)
    stats = await sandbox.stats()
    assert run["counts"]["deleted"] == 200, run
    # The risk its name warns of: silent misses go unseen.
    assert stats["present"] == stats["batch_silent_misses"] > 0, stats
    assert stats["requests"] <= 200 / 50 + 2, stats  # no probe was sent


async def test_jobs_are_polled_and_their_per_item_results_copied(e2e: E2E) -> None:
    sandbox = await e2e.sandbox("--recipients", N, "--rate", 200, "--batch", "job",
                                "--batch-job-seconds", 0.5, "--batch-max-jobs", 2,
                                "--batch-item-error-share", 0.03)
    svc = _service(e2e, sandbox, "job", max_jobs_in_flight=2)
    run = await _drain(svc)
    stats = await sandbox.stats()
    c = run["counts"]
    assert c["deleted"] + c["already_absent"] + c["failed"] == N, run
    assert c["failed"] == stats["batch_item_errors"] > 0, (run, stats)
    assert stats["present"] <= c["failed"], (run, stats)
    assert stats["deleted"] == c["deleted"], stats
    assert stats["duplicates"] == 0, stats
    assert stats["batch_jobs_submitted"] >= N / 50, stats
    # The cap is ours, not the partner's 429: no submission was refused for it.
    assert stats["batch_jobs_refused"] == 0, stats
    details = await _attempt_details(svc, run["id"], "deleted")
    assert all(d.startswith("item HTTP 200 in batch bat_") for d in details[:20]), details


async def test_a_job_whose_results_expired_is_settled_by_probes(e2e: E2E) -> None:
    # Results kept no time at all (Zendesk's "only the last 100 jobs"): the poller
    # finds the job gone and probes; a failed item is still present and, since a job
    # might yet act on it, is held ambiguous rather than resubmitted.
    sandbox = await e2e.sandbox("--recipients", 200, "--rate", 500, "--batch", "job",
                                "--batch-job-seconds", 0.2,
                                "--batch-job-result-ttl-seconds", 0,
                                "--batch-item-error-share", 0.05)
    svc = _service(e2e, sandbox, "job", poll_initial_seconds=1.0)
    run = await _drain(svc)
    stats = await sandbox.stats()
    c = run["counts"]
    assert stats["batch_jobs_expired"] > 0, stats
    assert c["ambiguous"] == stats["present"] > 0, (run, stats)
    assert c["deleted"] == 200 - stats["present"], run  # absent ones too: a probe saw them gone
    assert stats["deleted"] == 200 - stats["initially_absent"] - stats["present"], stats
    assert stats["duplicates"] == 0, stats
    reasons = [op["reason"] for op in await svc.operations(run["id"], state="ambiguous")]
    assert all("not resent" in r for r in reasons), reasons


async def test_a_per_item_cost_is_paced_in_ids(e2e: E2E) -> None:
    # The partner charges every id (Graph, Google): 100 ids per second, whatever the
    # batch size. The service, told so, never runs into its limit.
    sandbox = await e2e.sandbox("--recipients", 400, "--rate", 100, "--burst", 50,
                                "--batch", "per_item", "--batch-cost", "item")
    svc = _service(e2e, sandbox, "per_item", rate=100.0, cost="items")
    run = await _drain(svc)
    stats = await sandbox.stats()
    assert run["counts"]["deleted"] + run["counts"]["already_absent"] == 400, run
    assert stats["rate_limited"] <= 2, stats
    assert stats["deleted"] == run["counts"]["deleted"], stats
    assert stats["duplicates"] == 0, stats


async def test_two_limits_the_ids_limit_learns_from_the_429s_it_caused(e2e: E2E) -> None:
    # The partner counts requests (40 a second) and ids (100 a second); the service is
    # told 400 ids a second, four times too many. At 50 ids a batch the ids' limit binds
    # (400 / 50 = 8 batches a second, under 40): its 429s, and the items throttled on
    # their own, are the ids' budget's to learn from; the requests' budget learns nothing.
    sandbox = await e2e.sandbox("--recipients", N, "--rate", 40, "--burst", 2,
                                "--batch", "per_item", "--batch-items-per-second", 100,
                                "--batch-item-throttle-share", 0.02)
    svc = _service(e2e, sandbox, "per_item", rate=40.0, cost="both", items_per_second=400.0)
    run = await _drain(svc)
    stats = await sandbox.stats()
    assert run["counts"]["deleted"] + run["counts"]["already_absent"] == N, run
    assert stats["deleted"] == run["counts"]["deleted"], stats
    assert stats["duplicates"] == 0, stats
    assert stats["batch_item_rate_limited"] >= 1, stats  # the ids' limit was met
    m = await svc.metrics()
    assert 0 < m.value("cleanup_limiter_items_learnt_rate_per_second") < 400, m
    assert m.value("cleanup_limiter_items_rate_per_second") < 400, m
    assert m.value("cleanup_limiter_learnt_rate_per_second") == 0, m  # requests: untouched
    assert m.value("cleanup_limiter_rate_per_second") > 30, m


async def test_two_limits_the_requests_limit_learns_from_the_429s_it_caused(e2e: E2E) -> None:
    # The other way round: the partner takes 5 requests a second and ids without end;
    # the service is told 20 requests and 5,000 ids a second. At 50 ids a batch the
    # requests' limit binds (5,000 / 50 = 100 a second, over 20): its 429s are the
    # requests' budget's, and the ids' budget learns nothing.
    sandbox = await e2e.sandbox("--recipients", N, "--rate", 5, "--burst", 1,
                                "--batch", "per_item", "--batch-items-per-second", 100_000,
                                "--batch-items-burst", 100_000)
    svc = _service(e2e, sandbox, "per_item", rate=20.0, cost="both", items_per_second=5000.0)
    run = await _drain(svc)
    stats = await sandbox.stats()
    assert run["counts"]["deleted"] + run["counts"]["already_absent"] == N, run
    assert stats["duplicates"] == 0, stats
    assert stats["batch_item_rate_limited"] == 0, stats
    assert stats["rate_limited"] >= 1, stats
    m = await svc.metrics()
    assert 0 < m.value("cleanup_limiter_learnt_rate_per_second") < 20, m
    assert m.value("cleanup_limiter_items_learnt_rate_per_second") == 0, m
    assert m.value("cleanup_limiter_items_rate_per_second") > 4000, m


async def test_short_lived_results_are_read_before_they_expire(e2e: E2E) -> None:
    # Jobs of 3 s whose results are kept 1.5 s once finished, one at a time, and a
    # poll_max_seconds far longer. Doubling alone reads each job at 0.3, 0.6, 1.2 and
    # 2.4 s (running), then at 4.8 s: 0.3 s after its results expired, every item
    # probed. The partner announces each running job's expiry (expires_at, rounded
    # down), and the next read is brought forward to poll_initial_seconds before it:
    # every job is read from the first on, so nothing is ever probed. (A partner that
    # announces nothing while a job runs has the lifetime seen on its first finished job
    # cap the interval at half of it: tests/unit/test_job_schedule.py.)
    jobs = 3
    sandbox = await e2e.sandbox("--recipients", 50 * jobs, "--rate", 500, "--batch", "job",
                                "--batch-job-seconds", 3.0, "--batch-max-jobs", 1,
                                "--batch-job-result-ttl-seconds", 1.5)
    svc = _service(e2e, sandbox, "job", max_jobs_in_flight=1, poll_initial_seconds=0.3,
                   poll_max_seconds=20.0)
    run = await _drain(svc)
    m = await svc.metrics()
    polls = "cleanup_batch_job_polls_total"
    assert m.get(polls, found="expired") == 0, m.text
    assert m.get(polls, found="done") == jobs, m.text
    probes = sum(v for (name, _), v in m.samples.items() if name == "cleanup_probes_total")
    assert probes == 0, m.text
    stats = await sandbox.stats()
    c = run["counts"]
    assert c["deleted"] + c["already_absent"] == 50 * jobs, run
    assert stats["present"] == 0, stats
    assert stats["deleted"] == c["deleted"], stats
    assert stats["duplicates"] == 0, stats
    assert stats["batch_jobs_submitted"] == jobs, stats
    # Each item settled on its job's own result, not on a probe.
    for state in ("deleted", "already_absent"):
        details = await _attempt_details(svc, run["id"], state)
        assert all(d.startswith(("item HTTP 200 in batch bat_", "item HTTP 404 in batch bat_"))
                   for d in details), details


# -- verdicts that are not statuses, ids outside the body ---------------------------------

_PATHS = {"per_item": "/recipients/batch-delete", "accepted": "/recipients/batch-archive",
          "job": "/recipients/batch-jobs"}


async def test_salesforce_style_verdicts_matched_by_position_settle_each_item(
        e2e: E2E) -> None:
    # sObject Collections: HTTP 200 whatever each item did, {success, errors} per item in
    # request order, no id on a failure: only position matches those. Throttled items
    # (REQUEST_LIMIT_EXCEEDED) are sent again, failing ones (INVALID_ID_FIELD) fail,
    # absent ones (ENTITY_IS_DELETED) are done; none is left to a probe.
    sandbox = await e2e.sandbox("--recipients", N, "--rate", 200, "--batch", "per_item",
                                "--batch-verdict", "success",
                                "--batch-result-ids", "omit-on-error",
                                "--batch-item-throttle-share", 0.1,
                                "--batch-item-error-share", 0.03)
    svc = _service(e2e, sandbox, "per_item", item_verdict="success", item_order="position")
    run = await _drain(svc)
    stats = await sandbox.stats()
    c = run["counts"]
    assert c["ambiguous"] == 0, run
    assert c["deleted"] == stats["deleted"] > 0, (run, stats)
    assert c["failed"] == stats["batch_item_errors"] > 0, (run, stats)
    assert c["already_absent"] == N - stats["deleted"] - stats["batch_item_errors"] > 0, \
        (run, stats)
    assert c["already_absent"] <= stats["initially_absent"], (run, stats)
    assert stats["present"] <= c["failed"], (run, stats)
    assert stats["batch_item_throttled"] > 0, stats
    assert stats["duplicates"] == 0, stats
    m = await svc.metrics()
    assert sum(v for (name, _), v in m.samples.items() if name == "cleanup_probes_total") == 0
    # The audit trail names the partner's own code beside the status it maps to.
    for state, said in (("failed", "item INVALID_ID_FIELD (HTTP 422)"),
                        ("already_absent", "item ENTITY_IS_DELETED (HTTP 404)")):
        details = await _attempt_details(svc, run["id"], state)
        assert all(d.startswith(f"{said} in batch bat_") for d in details), details


@pytest.mark.parametrize("shape", ["per_item", "accepted", "job"])
async def test_ids_in_the_query_drain(e2e: E2E, shape: str) -> None:
    # SendGrid's and Salesforce's DELETE ?ids=a,b: no body but a job's tag.
    sandbox = await e2e.sandbox("--recipients", 200, "--rate", 500, "--batch", shape,
                                "--batch-job-seconds", 0.3)
    svc = _service(e2e, sandbox, shape, rate=400.0, ids_in="query", method="DELETE")
    await _drained_alone(svc, sandbox, shape, 200)


@pytest.mark.parametrize("shape", ["per_item", "accepted", "job"])
async def test_ids_in_the_path_drain(e2e: E2E, shape: str) -> None:
    sandbox = await e2e.sandbox("--recipients", 200, "--rate", 500, "--batch", shape,
                                "--batch-job-seconds", 0.3)
    svc = _service(e2e, sandbox, shape, rate=400.0, ids_in="path",
                   path=_PATHS[shape] + "/{ids}")
    await _drained_alone(svc, sandbox, shape, 200)


async def _drained_alone(svc: Service, sandbox: Sandbox, shape: str, n: int) -> None:
    """Every recipient gone, each executed once, in batches (the partner answers a
    batch without its ids 400: the ids reached it where the service put them)."""
    run = await _drain(svc)
    stats = await sandbox.stats()
    c = run["counts"]
    assert c["deleted"] + c["already_absent"] == n, run
    assert stats["present"] == 0, stats
    # An accepted batch's absent ids are settled by a probe that finds them gone.
    deleted = n - stats["initially_absent"] if shape == "accepted" else c["deleted"]
    assert stats["deleted"] == deleted, (run, stats)
    assert stats["duplicates"] == 0, stats
    assert n / 50 <= stats["batch_requests"] < n / 10, stats


async def test_a_batch_timing_out_keeps_its_holds_through_a_long_backoff(e2e: E2E) -> None:
    """A batch whose answer is lost goes again under its key after a backoff. The
    backoff (6 to 12 s here) outlasts the holds its attempts were written with (the
    request's bound and 5 s): its holds are renewed through the wait,
    so the same batch goes again (the partner replays it). A hold that had run out
    would be read as taken over, and its ids sent in a new batch under a new key."""
    sandbox = await e2e.sandbox("--recipients", 50, "--rate", 1000, "--batch", "per_item",
                                "--latency-ms", 2500)
    svc = _service(e2e, sandbox, "per_item", partner={
        "connect_timeout_seconds": 0.5, "request_timeout_seconds": 1.5,
        "backoff_initial_seconds": 12.0, "backoff_max_seconds": 12.0})
    await svc.start()
    run_id = await svc.open_run()
    await sandbox.wait(batch_requests=1)
    await sandbox.control(latency_ms=0)  # the first answer is lost, the next one comes
    run = await svc.wait_done(run_id)
    assert run["counts"]["deleted"] + run["counts"]["already_absent"] == 50, run
    keys: dict[str, set[str]] = {}
    for e in await sandbox.requests():
        keys.setdefault(e["recipient_id"], set()).add(e["idempotency_key"])
    assert all(len(k) == 1 for k in keys.values()), keys
    stats = await sandbox.stats()
    assert stats["batch_requests"] == 2, stats
    assert (stats["replays"], stats["duplicates"]) == (1, 0), stats
    assert svc.current is not None
    assert not [line for line in svc.current.lines if "not sent again" in line]
