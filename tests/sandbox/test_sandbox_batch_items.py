"""A batch partner limiting both requests and items (``--batch-items-per-second``).

Two limits, as Klaviyo's bulk jobs (75 a second and 700 ids a minute) or Google's batch
(every inner call counts) set them: the rate limiter charges each batch as
``batch_cost`` says, a token bucket of ids charges it its distinct ids. Over loopback
HTTP on a stepped clock, like test_sandbox_batch.py, whose helpers these tests share.
"""

from __future__ import annotations

from typing import Any

import pytest

from cleanup_sandbox import SandboxConfig
from cleanup_sandbox.__main__ import build_parser, config_from_args
from tests.sandbox.test_sandbox_batch import ARCHIVE, BATCH, JOBS, get, post, present, sandbox

SHAPES = [("per_item", BATCH, 200), ("accepted", ARCHIVE, 204), ("job", JOBS, 202)]


@pytest.mark.parametrize(("shape", "path", "ok"), SHAPES)
async def test_the_item_limit_binds_when_it_is_the_tighter_one(
    shape: str, path: str, ok: int,
) -> None:
    # Ten batches a second could pass the rate limiter; ten ids, then five a second, the items.
    async with sandbox(batch_shape=shape, rate_per_second=10, burst=10,
                       batch_items_per_second=5, batch_items_burst=10,
                       retry_after_format="fractional", ratelimit_headers="x-ratelimit",
                       absent_share=0.0) as (running, http, clock):
        state = running.state
        ids = present(state, 12)
        status, headers, _ = await post(http, path, {"ids": ids[:6]})
        assert (status, headers["X-RateLimit-Remaining"]) == (ok, "9")
        status, headers, body = await post(http, path, {"ids": ids[6:]})
        # 4 ids left in the bucket: 2 more take 0.4 s. The rate limiter was asked, not charged.
        assert (status, body["error"], headers["Retry-After"]) == (
            429, "item_rate_limited", "0.400")
        assert (body["retry_after_seconds"], headers["X-RateLimit-Remaining"]) == (1, "9")
        assert all(state.is_present(rid) for rid in ids[6:])
        # The refusal took none of the 4 ids there were: a moment early is still short of 6...
        clock.now += 0.399
        status, headers, body = await post(http, path, {"ids": ids[6:]})
        assert (status, body["error"], headers["Retry-After"]) == (
            429, "item_rate_limited", "0.001")
        # ...and at the announced time all 6 are there.
        clock.now += 0.001
        assert (await post(http, path, {"ids": ids[6:]}))[0] == ok
        stats = state.stats()
        assert (stats["batch_item_rate_limited"], stats["rate_limited"],
                stats["quota_limited"]) == (2, 2, 0)
        # The partner's view of what it admitted: 12 ids over 0.4 s, the burst and 2 refilled.
        admitted = [entry.arrived for entry in state.requests_log if entry.status == ok]
        assert (len(admitted), max(admitted) - min(admitted)) == (12, pytest.approx(0.4))


async def test_the_request_limit_still_binds_when_it_is_the_tighter_one() -> None:
    async with sandbox(batch_shape="per_item", rate_per_second=1, burst=1,
                       batch_items_per_second=1, batch_items_burst=10,
                       retry_after_format="fractional", absent_share=0.0) as (
        running, http, clock,
    ):
        state = running.state
        ids = present(state, 15)
        assert (await post(http, BATCH, {"ids": ids[:5]}))[0] == 200
        status, headers, body = await post(http, BATCH, {"ids": ids[5:10]})
        assert (status, body["error"], headers["Retry-After"]) == (429, "rate_limited", "1.000")
        # The item limit was asked, not charged: 5 ids left and 1 refilled, 5 of them taken.
        clock.now += 1.0
        assert (await post(http, BATCH, {"ids": ids[5:10]}))[0] == 200
        # Both refuse now (a request in 1 s, 4 more ids in 4 s): the longer wait is named.
        status, headers, body = await post(http, BATCH, {"ids": ids[10:]})
        assert (status, body["error"], headers["Retry-After"]) == (
            429, "item_rate_limited", "4.000")
        clock.now += 4.0
        assert (await post(http, BATCH, {"ids": ids[10:]}))[0] == 200
        stats = state.stats()
        assert (stats["batch_item_rate_limited"], stats["rate_limited"]) == (1, 2)
        assert stats["executions"] == 15


async def test_the_longer_request_wait_is_named_when_both_refuse() -> None:
    async with sandbox(batch_shape="per_item", batch_cost="item", rate_per_second=1,
                       burst=10, batch_items_per_second=2, batch_items_burst=10,
                       retry_after_format="fractional", absent_share=0.0) as (
        running, http, clock,
    ):
        ids = present(running.state, 14)
        assert (await post(http, BATCH, {"ids": ids[:7]}))[0] == 200
        # 3 left in each: 4 more take 4 s of requests charged per id, 2 s of items.
        status, headers, body = await post(http, BATCH, {"ids": ids[7:]})
        assert (status, body["error"], headers["Retry-After"]) == (429, "rate_limited", "4.000")
        clock.now += 4.0
        assert (await post(http, BATCH, {"ids": ids[7:]}))[0] == 200
        assert running.state.stats()["batch_item_rate_limited"] == 0


async def test_job_reads_and_single_deletes_take_nothing_of_the_item_limit() -> None:
    async with sandbox(batch_shape="job", batch_items_per_second=1, batch_items_burst=5,
                       absent_share=0.0) as (running, http, _clock):
        ids = present(running.state, 7)
        status, _, body = await post(http, JOBS, {"ids": ids[:5], "tag": "b"})
        assert status == 202
        for _ in range(3):
            assert (await get(http, f"{JOBS}/{body['job_id']}"))[0] == 200
            assert (await get(http, f"{JOBS}?tag=b"))[0] == 200
        async with http.delete(f"/recipients/{ids[5]}") as resp:
            assert resp.status == 204
        status, headers, body = await post(http, JOBS, {"ids": ids[6:]})
        assert (status, body["error"], headers["Retry-After"]) == (429, "item_rate_limited", "1")


async def test_a_batch_the_item_limit_could_never_hold_answers_413_and_costs_nothing() -> None:
    async with sandbox(batch_shape="per_item", rate_per_second=1, burst=1,
                       batch_items_per_second=1, batch_items_burst=5, absent_share=0.0) as (
        running, http, _clock,
    ):
        state = running.state
        ids = present(state, 6)
        status, _, body = await post(http, BATCH, {"ids": ids})
        assert (status, body["error"], body["items"]) == (413, "batch_over_item_limit", 6)
        assert state.stats()["executions"] == 0
        # A repeated id is acted on once, so it counts once: 5 distinct ids fit, and both
        # limits were still whole (one request, five ids).
        assert (await post(http, BATCH, {"ids": [*ids[:5], ids[0]]}))[0] == 200
        assert state.stats()["executions"] == 5


async def test_the_item_burst_defaults_to_one_full_batch() -> None:
    async with sandbox(batch_shape="accepted", batch_max_items=8,
                       batch_items_per_second=4, absent_share=0.0) as (running, http, clock):
        ids = present(running.state, 16)
        assert (await post(http, ARCHIVE, {"ids": ids[:8]}))[0] == 204
        status, headers, body = await post(http, ARCHIVE, {"ids": ids[8:]})
        assert (status, body["error"], headers["Retry-After"]) == (429, "item_rate_limited", "2")
        clock.now += 2.0
        assert (await post(http, ARCHIVE, {"ids": ids[8:]}))[0] == 204


async def test_no_item_limit_by_default() -> None:
    async with sandbox(batch_shape="per_item", batch_max_items=100, absent_share=0.0) as (
        running, http, _clock,
    ):
        ids = present(running.state, 200)
        for start in range(0, 200, 100):
            assert (await post(http, BATCH, {"ids": ids[start:start + 100]}))[0] == 200


# -- configuration -----------------------------------------------------------------------


def test_cli_flags_reach_the_item_limit() -> None:
    parser = build_parser()
    args = parser.parse_args(["--batch", "job", "--batch-items-per-second", "11.5",
                              "--batch-items-burst", "700"])
    config = config_from_args(parser, args, {})
    assert (config.batch_items_per_second, config.batch_items_burst,
            config.batch_items_capacity) == (11.5, 700.0, 700.0)
    default = config_from_args(parser, parser.parse_args(["--batch-max-items", "40"]), {})
    assert (default.batch_items_per_second, default.batch_items_burst,
            default.batch_items_capacity) == (0.0, 0.0, 40.0)


def test_a_bad_item_flag_is_a_usage_error_naming_the_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    args = parser.parse_args(["--batch-items-per-second", "5", "--batch-items-burst", "0.5"])
    with pytest.raises(SystemExit) as exited:
        config_from_args(parser, args, {})
    assert exited.value.code == 2
    assert "batch_items_burst" in capsys.readouterr().err


@pytest.mark.parametrize(("field", "value"), [
    ("batch_items_per_second", -1), ("batch_items_per_second", float("nan")),
    ("batch_items_per_second", float("inf")), ("batch_items_burst", -2),
    ("batch_items_burst", 0.5), ("batch_items_burst", float("inf")),
])
def test_config_names_the_bad_item_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SandboxConfig(**{field: value})
