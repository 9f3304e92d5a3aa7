"""CLI: ``python -m cleanup_sandbox [flags]``.

Prints one JSON line ``{"url": ..., "pid": ...}`` once listening, then serves until
SIGTERM/SIGINT and exits 0. The token is read from the environment variable named by
``--token-env`` so it never shows up in ``ps``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from cleanup_sandbox.config import (
    BATCH_COSTS,
    BATCH_DUPLICATES,
    BATCH_RESULT_IDS,
    BATCH_SHAPES,
    BATCH_VERDICTS,
    RATELIMIT_HEADER_STYLES,
    RETRY_AFTER_FORMATS,
    WINDOWS,
    SandboxConfig,
    parse_quota,
)
from cleanup_sandbox.process import run, serve_until_signal
from cleanup_sandbox.server import run_sandbox


def build_parser() -> argparse.ArgumentParser:
    d = SandboxConfig()
    p = argparse.ArgumentParser(
        prog="python -m cleanup_sandbox",
        description="Run the rate-limited partner API simulator.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--recipients", type=int, default=d.recipients)
    p.add_argument("--absent-share", type=float, default=d.absent_share)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--token-env",
        metavar="VAR",
        default=None,
        help="require 'Authorization: Bearer $VAR' on the partner endpoints",
    )
    p.add_argument("--rate", type=float, default=d.rate_per_second, help="<= 0 disables")
    p.add_argument("--burst", type=float, default=d.burst)
    p.add_argument(
        "--window",
        choices=WINDOWS,
        default=d.window,
        help="limiter shape: token bucket, strict GCRA at 1 ms, sliding log, "
        "fixed 1 s or 60 s windows",
    )
    p.add_argument(
        "--window-seconds",
        type=float,
        default=d.window_seconds,
        help="trailing window of --window sliding (limit = rate * this)",
    )
    p.add_argument(
        "--quota",
        dest="quotas",
        metavar="LIMIT/SECONDS",
        action="append",
        default=[],
        help="a fixed-window quota on top of the rate, e.g. 3000/3600; repeatable",
    )
    p.add_argument(
        "--retry-after-format", choices=RETRY_AFTER_FORMATS, default=d.retry_after_format
    )
    p.add_argument(
        "--ratelimit-headers",
        nargs="?",
        const="ietf",
        choices=RATELIMIT_HEADER_STYLES,
        default=d.ratelimit_headers,
        help="header style; the bare flag means ietf",
    )
    p.add_argument(
        "--no-idempotency",
        dest="honour_idempotency_keys",
        action="store_false",
        default=d.honour_idempotency_keys,
        help="ignore Idempotency-Key headers",
    )
    p.add_argument("--fault-5xx", type=float, default=d.fault_5xx)
    p.add_argument("--fault-timeout-after-act", type=float, default=d.fault_timeout_after_act)
    p.add_argument("--fault-reset-after-act", type=float, default=d.fault_reset_after_act)
    p.add_argument("--hang-seconds", type=float, default=d.hang_seconds)
    p.add_argument("--latency-ms", type=float, default=d.latency_ms)
    p.add_argument("--latency-per-inflight-ms", type=float, default=d.latency_per_inflight_ms,
                   help="added latency per DELETE already in hand (a partner queueing)")
    p.add_argument("--page-delay-ms", type=float, default=d.page_delay_ms)
    p.add_argument("--garbage-share", type=float, default=d.garbage_share)
    b = p.add_argument_group("batch endpoints (docs/batch.md)")
    b.add_argument("--batch", dest="batch_shape", choices=BATCH_SHAPES, default=d.batch_shape,
                   metavar="{per_item,accepted,job}",
                   help="answer shape of POST /recipients/batch-delete; unset: no batches")
    b.add_argument("--batch-max-items", type=int, default=d.batch_max_items,
                   help="more ids than this in one batch: 413")
    b.add_argument("--batch-item-throttle-share", type=float,
                   default=d.batch_item_throttle_share, help="per_item: share answered 429")
    b.add_argument("--batch-item-error-share", type=float, default=d.batch_item_error_share,
                   help="per_item and job: share of ids failing 422 for good")
    b.add_argument("--batch-silent-miss-share", type=float, default=d.batch_silent_miss_share,
                   help="accepted: share of present ids answered 204 but left in place")
    b.add_argument("--batch-max-jobs", type=int, default=d.batch_max_jobs,
                   help="job: with this many unfinished, a submission answers 429")
    b.add_argument("--batch-job-seconds", type=float, default=d.batch_job_seconds,
                   help="job: how long a job runs")
    b.add_argument("--batch-job-result-ttl-seconds", type=float,
                   default=d.batch_job_result_ttl_seconds,
                   help="job: how long a finished job's results are kept (then 404)")
    b.add_argument("--batch-bad-id-pattern", default=d.batch_bad_id_pattern, metavar="REGEX",
                   help="a batch holding an id this matches is refused whole (400)")
    b.add_argument("--batch-duplicates", choices=BATCH_DUPLICATES, default=d.batch_duplicates,
                   help="an id twice in one batch: acted on once, or the batch refused (400)")
    b.add_argument("--batch-cost", choices=BATCH_COSTS, default=d.batch_cost,
                   help="what the rate limiter charges a batch: one token, or one per id")
    b.add_argument("--batch-items-per-second", type=float, default=d.batch_items_per_second,
                   help="a second limit, on ids: a token bucket refilling this many ids a "
                   "second, on top of the rate limit; 0: none")
    b.add_argument("--batch-items-burst", type=float, default=d.batch_items_burst,
                   help="ids the item limit holds at once; 0: --batch-max-items")
    b.add_argument("--batch-verdict", choices=BATCH_VERDICTS, default=d.batch_verdict,
                   help="each result's verdict: an HTTP status, or Salesforce's "
                   "{success, errors: [{statusCode}]}")
    b.add_argument("--batch-result-ids", choices=BATCH_RESULT_IDS, default=d.batch_result_ids,
                   help="omit-on-error: a result for an id not deleted carries id null "
                   "(matched only by position)")
    return p


def config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str]
) -> SandboxConfig:
    token: str | None = None
    if args.token_env is not None:
        token = environ.get(args.token_env)
        if not token:
            parser.error(f"environment variable {args.token_env} is unset or empty")
    try:
        quotas = tuple(parse_quota(spec) for spec in args.quotas)
        return SandboxConfig(
            recipients=args.recipients,
            absent_share=args.absent_share,
            seed=args.seed,
            token=token,
            rate_per_second=args.rate,
            burst=args.burst,
            window=args.window,
            window_seconds=args.window_seconds,
            quotas=quotas,
            retry_after_format=args.retry_after_format,
            ratelimit_headers=args.ratelimit_headers,
            honour_idempotency_keys=args.honour_idempotency_keys,
            fault_5xx=args.fault_5xx,
            fault_timeout_after_act=args.fault_timeout_after_act,
            fault_reset_after_act=args.fault_reset_after_act,
            hang_seconds=args.hang_seconds,
            latency_ms=args.latency_ms,
            latency_per_inflight_ms=args.latency_per_inflight_ms,
            page_delay_ms=args.page_delay_ms,
            garbage_share=args.garbage_share,
            batch_shape=args.batch_shape,
            batch_max_items=args.batch_max_items,
            batch_item_throttle_share=args.batch_item_throttle_share,
            batch_item_error_share=args.batch_item_error_share,
            batch_silent_miss_share=args.batch_silent_miss_share,
            batch_max_jobs=args.batch_max_jobs,
            batch_job_seconds=args.batch_job_seconds,
            batch_job_result_ttl_seconds=args.batch_job_result_ttl_seconds,
            batch_bad_id_pattern=args.batch_bad_id_pattern,
            batch_duplicates=args.batch_duplicates,
            batch_cost=args.batch_cost,
            batch_items_per_second=args.batch_items_per_second,
            batch_items_burst=args.batch_items_burst,
            batch_verdict=args.batch_verdict,
            batch_result_ids=args.batch_result_ids,
        )
    except ValueError as exc:
        parser.error(str(exc))


async def serve(config: SandboxConfig, host: str, port: int) -> None:
    async with run_sandbox(config, host, port) as sandbox:
        await serve_until_signal(sandbox.url)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(parser, args, os.environ)
    return run(serve(config, args.host, args.port))


if __name__ == "__main__":
    raise SystemExit(main())
