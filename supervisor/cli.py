"""The ``cleanup-supervisor`` command: serve, demo, trigger, runs, budget, check-config."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import orjson

from supervisor import __version__, config, logs
from supervisor.errors import EXIT_RUNTIME, EXIT_USAGE, CleanupError, ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is installed (it is a dependency everywhere but Windows)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


def _config_path(value: str | None) -> Path | None:
    value = value or os.environ.get("CLEANUP_CONFIG")
    return Path(value) if value else None


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        cfg = config.load(_config_path(args.config))
    except ConfigError as exc:
        print(f"{args.config or 'configuration'}: {len(exc.problems)} problem(s)", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return EXIT_USAGE
    print(f"ok: {cfg.ledger_path}, listen {cfg.service.listen}, source {cfg.source.kind}, "
          f"partner {cfg.partner.base_url}, <= {cfg.limits.rate_per_second:g}/s, "
          f"{cfg.limits.concurrency} workers")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from supervisor.service import Service, install_signal_handlers

    cfg = config.load(_config_path(args.config))
    logs.configure(args.log_level or cfg.service.log_level, fmt=cfg.service.log_format)

    async def serve() -> int:
        service = Service(cfg)
        undo = install_signal_handlers(service)
        try:
            return await service.run()
        finally:
            undo()

    return run_async(serve())


def cmd_migrate(args: argparse.Namespace) -> int:
    """Apply the schema migrations the configured ledger lacks, and say which."""
    from supervisor import composition

    cfg = config.load(_config_path(args.config))
    where, applied = run_async(composition.migrate(cfg))
    print(f"{where}: " + (", ".join(f"applied {a}" for a in applied) if applied
                          else "up to date"))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """N / R (or a batch partner's requests / R) against the cron ceiling and the digest
    cutoff (supervisor/plan.py)."""
    from supervisor import plan
    from supervisor.batchsettings import Shape

    path = _config_path(args.config)
    # Without a file the arithmetic needs no secret: the defaults, not a validated load.
    cfg = config.load(path, require_secrets=False) if path is not None else config.Config()
    pages = None
    if args.count_source:
        candidates, pages = run_async(plan.count_source(cfg))
    elif args.candidates is not None:
        candidates = args.candidates
    else:
        print("error: give --candidates N, or --count-source to count the configured source",
              file=sys.stderr)
        return EXIT_USAGE
    rate = args.rate if args.rate is not None else cfg.limits.rate_per_second
    cutoff = args.cutoff_seconds if args.cutoff_seconds is not None else \
        cfg.schedule.digest_cutoff_seconds
    if args.start is not None:
        try:
            start = datetime.fromisoformat(args.start)
        except ValueError:
            start = None
        if start is None or start.tzinfo is None:
            print("error: --start must be an ISO 8601 time with a UTC offset "
                  "(e.g. 2026-12-07T02:00:00+00:00)",
                  file=sys.stderr)
            return EXIT_USAGE
        start_ts = start.timestamp()
    else:
        start_ts = plan.start_time(cfg, datetime.now(UTC))
    shape: Shape | None = None if args.batch_shape is None else \
        "" if args.batch_shape == "single" else args.batch_shape
    batch = plan.batching(cfg.batch, shape=shape, size=args.batch_size, cost=args.batch_cost,
                          job_s=args.job_seconds, items_per_second=args.items_rate)
    # A flag the arithmetic would silently ignore is a usage error, named.
    if batch is None and (args.batch_size, args.batch_cost, args.job_seconds,
                          args.items_rate) != (None,) * 4:
        print("error: --batch-size, --batch-cost, --items-rate and --job-seconds need a batch "
              "shape (--batch-shape, or batch.shape in the configuration)", file=sys.stderr)
        return EXIT_USAGE
    if batch is not None and (batch.cost == "both") != (batch.items_per_second > 0):
        print("error: --batch-cost both needs the ids' limit (--items-rate, or "
              "batch.items_per_second), and --items-rate needs --batch-cost both",
              file=sys.stderr)
        return EXIT_USAGE
    if args.job_seconds is not None and batch is not None and batch.shape != "job":
        print(f"error: --job-seconds is for batch shape 'job', not {batch.shape!r}",
              file=sys.stderr)
        return EXIT_USAGE
    result = plan.Plan(candidates=candidates, rate=rate, cron_ceiling_s=args.cron_ceiling,
                       limit=args.limit, start=start_ts, cutoff_s=cutoff, counted_pages=pages,
                       quotas=tuple((q.name, q.limit, q.period_seconds)
                                    for q in cfg.limits.quotas), batch=batch)
    if args.json:
        print(orjson.dumps(result.as_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(plan.render(result))
    return 0


def _positive_number(kind: type[int] | type[float]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value

    return parse


def cmd_demo(args: argparse.Namespace) -> int:
    # The demos drive the partner simulator and the Infrai emulator, which ship apart from
    # the service (the cleanup-sandbox distribution): imported here, only for this command.
    try:
        from cleanup_sandbox import demo
    except ImportError:
        print("error: the demo needs the sandbox: pip install -e ./sandbox (make demo does)",
              file=sys.stderr)
        return EXIT_USAGE

    logs.configure(args.log_level or "warning")
    opts = demo.DemoOptions(config_path=Path(args.config), recipients=args.recipients,
                            partner_rate=args.rate, absent_share=args.absent_share,
                            fault_5xx=args.fault_5xx, fault_timeout_after_act=args.fault_timeout,
                            queue=args.queue, partner=args.partner)
    return run_async(demo.run_shape(args.shape, opts))


async def _request(method: str, url: str, body: Any = None, tick: bool = False
                   ) -> tuple[int, Any]:
    """``tick``: a cron caller holding only the tick token may send that instead."""
    import aiohttp

    token = os.environ.get("CLEANUP_TRIGGER_TOKEN", "")
    if tick and not token:
        token = os.environ.get("CLEANUP_TICK_TOKEN", "")
    headers = {"Authorization": f"Bearer {token}"}
    data = None
    if body is not None:
        data = orjson.dumps(body)
        headers["Content-Type"] = "application/json"
    async with aiohttp.ClientSession() as session, \
            session.request(method, url, data=data, headers=headers) as resp:
        return resp.status, orjson.loads(await resp.read() or b"null")


def _trigger_via_infrai(args: argparse.Namespace, body: dict[str, Any]) -> int:
    """Publish the tick to Infrai's tick queue: the service pulls it (no inbound traffic)."""
    from supervisor import composition
    from supervisor.ticks import publish_tick

    cfg = config.load(_config_path(args.config))
    if not cfg.infrai.tick_queue:
        print("trigger --via infrai: infrai.tick_queue is not set", file=sys.stderr)
        return EXIT_USAGE
    if args.ids:
        print("trigger --via infrai: inline IDs do not travel as ticks", file=sys.stderr)
        return EXIT_USAGE
    tick = {k: v for k, v in body.items() if k in ("schedule", "scheduled_for")}

    async def publish() -> str:
        async with composition.infrai_session(cfg.infrai, cfg.infrai.tick_queue) as channel:
            return await publish_tick(composition.tick_source(channel), tick)

    try:
        message_id = run_async(publish())
    except ValueError as exc:
        print(f"trigger --via infrai: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(orjson.dumps({"queue": cfg.infrai.tick_queue, "message_id": message_id,
                        "tick": tick}).decode())
    return 0


def cmd_trigger(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if args.schedule:
        body["schedule"] = args.schedule
    if args.scheduled_for:
        body["scheduled_for"] = args.scheduled_for
    if args.ids:
        body["recipient_ids"] = args.ids
    if args.via == "infrai":
        return _trigger_via_infrai(args, body)
    status, doc = run_async(_request("POST", f"{args.url.rstrip('/')}/v1/runs", body,
                                     tick=True))
    print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    return 0 if status < 300 else EXIT_RUNTIME


def cmd_runs(args: argparse.Namespace) -> int:
    base = f"{args.url.rstrip('/')}/v1/runs"
    if args.run_id and args.state:
        url = f"{base}/{args.run_id}/operations?state={args.state}&limit={args.limit}"
    elif args.run_id:
        url = f"{base}/{args.run_id}"
    else:
        url = f"{base}?limit={args.limit}"
    status, doc = run_async(_request("GET", url))
    print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    return 0 if status < 300 else EXIT_RUNTIME


def cmd_ambiguous(args: argparse.Namespace) -> int:
    url = f"{args.url.rstrip('/')}/v1/operations?state=ambiguous&limit={args.limit}"
    status, doc = run_async(_request("GET", url))
    if status >= 300:
        print(orjson.dumps(doc).decode(), file=sys.stderr)
        return EXIT_RUNTIME
    for op in doc["operations"]:
        print(f"{op['id']}  run={op['run_id']}  recipient={op['recipient_id']}  "
              f"attempts={op['attempts']}  reason={op['reason']}")
    if not doc["operations"]:
        print("no ambiguous operations")
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    body = {"outcome": args.outcome, "by": args.by, "reason": args.reason}
    url = f"{args.url.rstrip('/')}/v1/operations/{args.operation_id}/resolve"
    status, doc = run_async(_request("POST", url, body))
    print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    return 0 if status < 300 else EXIT_RUNTIME


def cmd_budget(args: argparse.Namespace) -> int:
    """``budget show``: what holds the workers and the latest resumes; ``budget resume``:
    lift the pause (``--forget-limit``: and the learnt limit), recorded with who and why."""
    base = f"{args.url.rstrip('/')}/v1/budget"
    if args.action == "show":
        status, doc = run_async(_request("GET", base))
    else:
        if not args.by or not args.reason:
            print("budget resume: --by and --reason are required (recorded in the ledger)",
                  file=sys.stderr)
            return EXIT_USAGE
        status, doc = run_async(_request("POST", f"{base}/resume", {
            "by": args.by, "reason": args.reason, "forget_limit": args.forget_limit}))
    print(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    return 0 if status < 300 else EXIT_RUNTIME


def cmd_dlq_redrive(args: argparse.Namespace) -> int:
    """Move Infrai's dead-lettered messages back to the queue. Safe at any time: a message
    whose operation is settled is acked on sight."""
    from supervisor import composition

    cfg = config.load(_config_path(args.config))
    if cfg.queue.backend != "infrai":
        print("dlq-redrive: queue.backend is not 'infrai'; the embedded queue has no "
              "dead-letter queue (redrive republishes from the ledger)", file=sys.stderr)
        return 2

    async def redrive() -> Any:
        async with composition.infrai_session(cfg.infrai) as channel:
            return await channel.redrive_dead_letters()

    result = run_async(redrive())
    print(orjson.dumps({"queue": cfg.infrai.queue, "result": result}).decode())
    return 0


def cmd_infrai_cron(args: argparse.Namespace) -> int:
    """``infrai cron apply``: the Infrai cron job for the configured schedule, created or
    kept as it is (applying twice changes nothing); ``status``: the job, its next run and
    its recent runs."""
    from supervisor import composition
    from supervisor.infrai.cron import CronRefused, InfraiCron, masked

    cfg = config.load(_config_path(args.config))
    s = cfg.schedule
    if s.cron is None:
        print("infrai cron: schedule.cron is not set", file=sys.stderr)
        return EXIT_USAGE
    if cfg.infrai.token is None:
        print(f"infrai cron: ${cfg.infrai.token_env} is not set", file=sys.stderr)
        return EXIT_USAGE
    if args.action == "apply" and cfg.trigger.tick_token is None:
        var = cfg.trigger.tick_token_env
        print(f"infrai cron: trigger.tick_token_env: ${var} (or ${var}_FILE) is not set; "
              "the job carries the tick token, never the operator token", file=sys.stderr)
        return EXIT_USAGE

    async def act() -> dict[str, Any]:
        async with composition.infrai_session(cfg.infrai) as channel:
            cron = InfraiCron(channel.client, cfg.infrai, cfg.trigger.tick_token)
            spec = cron.spec(s.name, s.cron or "", s.timezone)
            if args.action == "apply":
                done, job = await cron.apply(spec, replace=args.replace)
                return {"result": done, "job": job}
            jobs = [j for j in await cron.jobs() if j.get("name") == spec.name]
            if not jobs:
                return {"job": None, "hint": "run `infrai cron apply`"}
            runs = await cron.runs(jobs[0])
            return {"job": jobs[0], "next_run_at": jobs[0].get("next_run_at"),
                    "recent_runs": runs[-args.runs:]}

    try:
        out = run_async(act())
    except CronRefused as exc:
        print(f"infrai cron: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # Infrai's records may echo a job's headers anywhere (the job, its task, its runs).
    out = masked(out, (cfg.trigger.tick_token, cfg.trigger.token, cfg.infrai.token))
    print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    return 0


def cmd_infrai_push(args: argparse.Namespace) -> int:
    """``infrai push subscribe``: have Infrai POST the queue's messages to this service's
    /v1/push/{queue} (infrai.push_url), signed with the push secret."""
    from supervisor import composition
    from supervisor.infrai.client import InfraiError
    from supervisor.infrai.push import SubscribeRefused, subscribe, subscription

    cfg = config.load(_config_path(args.config))
    if cfg.infrai.token is None:
        print(f"infrai push: ${cfg.infrai.token_env} is not set", file=sys.stderr)
        return EXIT_USAGE
    try:
        sub = subscription(cfg.infrai, allow_private=args.allow_private)
    except SubscribeRefused as exc:
        print(f"infrai push: {exc}", file=sys.stderr)
        return EXIT_USAGE

    async def act() -> dict[str, Any]:
        async with composition.infrai_session(cfg.infrai) as channel:
            return await subscribe(channel.client, sub)

    try:
        out = run_async(act())
    except InfraiError as exc:
        hint = " (this Infrai has no push_subscribe route)" if exc.status == 404 else ""
        print(f"infrai push: {exc}{hint}", file=sys.stderr)
        return EXIT_RUNTIME
    print(orjson.dumps({"result": "subscribed", "subscription": out},
                       option=orjson.OPT_INDENT_2).decode())
    return 0


CONFIG_HELP = "TOML file (default: $CLEANUP_CONFIG, or defaults)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cleanup-supervisor", description=__doc__)
    p.add_argument("--version", action="version", version=__version__)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", required=True)

    _service_commands(sub)
    _infrai_commands(sub)
    _client_commands(sub)
    return p


def _service_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The commands that run or check the service here: serve, migrate, check-config, plan, demo."""
    s = sub.add_parser("serve", help="run the service")
    s.add_argument("--config", "-c", help=CONFIG_HELP)
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("migrate", help="apply the ledger's schema migrations (also done at start)")
    s.add_argument("--config", "-c", help=CONFIG_HELP)
    s.set_defaults(func=cmd_migrate)

    s = sub.add_parser("check-config", help="validate a configuration; exit 2 on problems")
    s.add_argument("config", nargs="?")
    s.set_defaults(func=cmd_check_config)

    s = sub.add_parser("plan", help="N / R against the cron ceiling and the digest cutoff")
    s.add_argument("--config", "-c", help=CONFIG_HELP)
    n = s.add_mutually_exclusive_group()
    n.add_argument("--candidates", type=_positive_number(int), help="how many stale recipients")
    n.add_argument("--count-source", action="store_true",
                   help="count them by paging the configured source (file or http)")
    s.add_argument("--rate", type=_positive_number(float),
                   help="the partner's requests per second (default: limits.rate_per_second)")
    s.add_argument("--limit", choices=["known", "learnt", "remembered"], default="known",
                   help="whether the rate is the partner's documented limit, one to be learnt "
                        "from 429s, or one an earlier run learnt (picks the measured overhead)")
    s.add_argument("--cron-ceiling", type=_positive_number(float), default=900.0,
                   help="the cron provider's execution ceiling in seconds (default 900)")
    s.add_argument("--cutoff-seconds", type=_positive_number(float),
                   help="digest cutoff after the start (default: schedule.digest_cutoff_seconds)")
    s.add_argument("--start", help="when the run opens, ISO 8601 with offset (default: the "
                                   "schedule's next slot, or now)")
    s.add_argument("--batch-shape", choices=["single", "per_item", "accepted", "job"],
                   help="one DELETE per recipient, or a batch partner's answer shape "
                        "(default: batch.shape; docs/batch.md)")
    s.add_argument("--batch-size", type=_positive_number(int), metavar="K",
                   help="ids per batch request (default: batch.max_items)")
    s.add_argument("--batch-cost", choices=["requests", "items", "both"],
                   help="what the partner's limit counts: requests, ids, or both as two limits "
                        "(default: batch.cost)")
    s.add_argument("--items-rate", type=_positive_number(float), metavar="I",
                   help="with --batch-cost both: the partner's limit on ids per second "
                        "(default: batch.items_per_second)")
    s.add_argument("--job-seconds", type=_positive_number(float), metavar="D",
                   help="how long one of a job partner's jobs takes (default: unknown)")
    s.add_argument("--json", action="store_true", help="one JSON object instead of text")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("demo", help="a full run against the local partner simulator")
    s.add_argument("--config", default="config/default.toml")
    s.add_argument("--recipients", type=int, default=3000)
    s.add_argument("--rate", type=float, default=100.0, help="the simulated partner's limit")
    s.add_argument("--absent-share", type=float, default=0.05)
    s.add_argument("--fault-5xx", type=float, default=0.0)
    s.add_argument("--fault-timeout", type=float, default=0.0,
                   help="share of deletes where the partner acts, then times out")
    s.add_argument("--queue", choices=["sqlite", "infrai", "redis", "rabbitmq"],
                   default="sqlite",
                   help="infrai: through the local Infrai emulator, pulled; redis, rabbitmq: "
                   "a queue of the demo's own on the broker $CLEANUP_REDIS_URL or "
                   "$CLEANUP_RABBITMQ_URL names (default: this machine's), removed after")
    s.add_argument("--partner", choices=["single", "batch", "per_item", "accepted", "job"],
                   default="single",
                   help="batch (= per_item), accepted, job: a partner that deletes 100 ids a "
                   "request, answering per id, accepting whole (each id probed), or as a "
                   "job polled for its results (docs/batch.md)")
    s.add_argument("--shape", choices=["embedded", "managed", "scale"], default="embedded",
                   help="managed: Infrai cron -> trigger -> Infrai queue -> delete -> "
                   "events to three sinks, all on the local emulator; scale: three "
                   "replicas on PostgreSQL ($CLEANUP_DATABASE_URL or 127.0.0.1:5432)")
    s.set_defaults(func=cmd_demo)


def _infrai_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Infrai's side: dead letters, the cron job, the push subscription."""
    s = sub.add_parser("dlq-redrive",
                       help="move Infrai's dead-lettered messages back to the queue")
    s.add_argument("--config", "-c", help=CONFIG_HELP)
    s.set_defaults(func=cmd_dlq_redrive)

    s = sub.add_parser("infrai", help="Infrai's clock: the cron job for the schedule")
    infrai = s.add_subparsers(dest="infrai_command", required=True)
    cron = infrai.add_parser("cron", help="apply or show the Infrai cron job")
    cron.add_argument("action", choices=["apply", "status"])
    cron.add_argument("--config", "-c", help=CONFIG_HELP)
    cron.add_argument("--runs", type=int, default=10, help="status: how many recent runs")
    cron.add_argument("--replace", action="store_true",
                      help="apply: replace the job even if it looks the same (a new tick token)")
    cron.set_defaults(func=cmd_infrai_cron)
    push = infrai.add_parser("push", help="register this service's push endpoint")
    push.add_argument("action", choices=["subscribe"])
    push.add_argument("--config", "-c", help=CONFIG_HELP)
    push.add_argument("--allow-private", action="store_true",
                      help="accept an http or private push_url (an emulator on loopback)")
    push.set_defaults(func=cmd_infrai_push)


def _client_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The API's clients: trigger, runs, ambiguous, resolve, budget."""
    url_default = os.environ.get("CLEANUP_URL", "http://127.0.0.1:8080")
    s = sub.add_parser("trigger", help="open a run (token from $CLEANUP_TRIGGER_TOKEN, "
                                       "else $CLEANUP_TICK_TOKEN)")
    s.add_argument("--url", default=url_default)
    s.add_argument("--schedule")
    s.add_argument("--scheduled-for", help="ISO 8601 slot this tick stands for")
    s.add_argument("ids", nargs="*", help="inline recipient IDs")
    s.add_argument("--via", choices=["webhook", "infrai"], default="webhook",
                   help="infrai: publish the tick to infrai.tick_queue for the service to pull")
    s.add_argument("--config", "-c", help="with --via infrai: TOML file (or $CLEANUP_CONFIG)")
    s.set_defaults(func=cmd_trigger)

    s = sub.add_parser("runs", help="list runs, show one, or list its operations by state")
    s.add_argument("--url", default=url_default)
    s.add_argument("run_id", nargs="?")
    s.add_argument("--state", help="with RUN_ID: list operations in this state")
    s.add_argument("--limit", type=int, default=20)
    s.set_defaults(func=cmd_runs)

    s = sub.add_parser("ambiguous", help="list operations waiting for reconciliation")
    s.add_argument("--url", default=url_default)
    s.add_argument("--limit", type=int, default=100)
    s.set_defaults(func=cmd_ambiguous)

    s = sub.add_parser("resolve", help="an operator's decision on an ambiguous operation")
    s.add_argument("--url", default=url_default)
    s.add_argument("operation_id")
    s.add_argument("outcome", choices=["deleted", "already_absent", "failed", "retry"])
    s.add_argument("--by", required=True, help="who decided (recorded in the ledger)")
    s.add_argument("--reason", required=True, help="why (recorded in the ledger)")
    s.set_defaults(func=cmd_resolve)

    s = sub.add_parser("budget", help="show the rate budget's pause and learnt limit, or "
                                      "lift them (resume)")
    s.add_argument("action", choices=["show", "resume"])
    s.add_argument("--url", default=url_default)
    s.add_argument("--by", help="resume: who decided (recorded in the ledger)")
    s.add_argument("--reason", help="resume: why (recorded in the ledger)")
    s.add_argument("--forget-limit", action="store_true",
                   help="resume: also forget the limit learnt from 429s and headers")
    s.set_defaults(func=cmd_budget)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except ConfigError as exc:
        print(f"configuration has {len(exc.problems)} problem(s):", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return exc.exit_code
    except CleanupError as exc:
        log.debug("failure", exc_info=exc)
        _report(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        _report(str(exc))
        return EXIT_RUNTIME


def _report(message: str) -> None:
    """A failure that ends the command: a log line in the configured format (a shipper
    reading JSON logs sees why ``serve`` exited), else the plain ``error:`` line."""
    if logs.json_configured():
        log.error("error: %s", message, extra={"action": "exit_error"})
    else:
        print(f"error: {message}", file=sys.stderr)
