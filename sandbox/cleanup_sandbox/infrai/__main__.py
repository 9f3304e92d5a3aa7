"""CLI: ``python -m cleanup_sandbox.infrai [--port 0] [--key-env VAR] [flags]``.

Prints one JSON line ``{"url": ..., "pid": ...}`` once listening, then serves until
SIGTERM/SIGINT and exits 0. The API and control keys are read from environment variables
named by flags, so they never show up in ``ps``. Every config field has a flag (its help is
the field's doc); booleans take ``--flag`` / ``--no-flag``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cleanup_sandbox.infrai.config import EmulatorConfig, FieldSpec, field_specs
from cleanup_sandbox.infrai.server import start_emulator
from cleanup_sandbox.process import run, serve_until_signal

# The variable the official examples use, so a demo needs no flag beyond exporting it.
DEFAULT_KEY_ENV = "INFRAI_API_KEY"
SECRET_FIELDS = frozenset({"api_key", "control_key"})


def _optional(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.lower() in ("", "none") else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def _add_field(parser: argparse.ArgumentParser, spec: FieldSpec) -> None:
    flag = "--" + spec.name.replace("_", "-")
    doc = spec.doc.replace("%", "%%")
    if spec.kind == "bool":
        parser.add_argument(flag, dest=spec.name, action=argparse.BooleanOptionalAction,
                            default=spec.default, help=doc)
        return
    kinds: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str, "choice": str}
    kind = kinds[spec.kind]
    if spec.optional:
        doc += " ('none' unsets)"
        kind = _optional(kind)
    choices = list(spec.choices) if spec.kind == "choice" else None
    parser.add_argument(flag, dest=spec.name, type=kind, choices=choices, default=spec.default,
                        metavar=None if choices else spec.kind.upper(), help=doc)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cleanup_sandbox.infrai",
        description="Run the Infrai queue API emulator.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--key-env", metavar="VAR", default=DEFAULT_KEY_ENV,
                   help="environment variable holding the API key clients must send")
    p.add_argument("--control-key-env", metavar="VAR", default=None,
                   help="environment variable holding the /_emulator control key; "
                   "without it the control surface is disabled (404)")
    for spec in field_specs().values():
        if spec.name not in SECRET_FIELDS:
            _add_field(p, spec)
    return p


def _secret(parser: argparse.ArgumentParser, environ: Mapping[str, str], var: str) -> str:
    value = environ.get(var)
    if not value:
        parser.error(f"environment variable {var} is unset or empty")
    return value


def config_from_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, environ: Mapping[str, str]
) -> EmulatorConfig:
    values = {name: getattr(args, name) for name in field_specs() if name not in SECRET_FIELDS}
    values["api_key"] = _secret(parser, environ, args.key_env)
    if args.control_key_env is not None:
        values["control_key"] = _secret(parser, environ, args.control_key_env)
    try:
        return EmulatorConfig(**values)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))


async def serve(config: EmulatorConfig, host: str, port: int) -> None:
    emulator = await start_emulator(config, host, port)
    try:
        await serve_until_signal(emulator.url)
    finally:
        await emulator.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = config_from_args(parser, args, os.environ)
    return run(serve(config, args.host, args.port))


if __name__ == "__main__":
    raise SystemExit(main())
