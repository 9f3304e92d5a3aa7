"""What the packaging promises an operator, read from the files the runtime reads.

No container runtime or systemd runs here, so these tests hold the files to the service's
own numbers: a stop timeout shorter than the drain turns every stop into a SIGKILL, and
an image without the config its commands default to fails on first use.
"""

from __future__ import annotations

import configparser
import re
import shlex
import tomllib
from pathlib import Path

import yaml

from supervisor import config
from supervisor.cli import parser
from supervisor.service import max_stop_seconds

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging"
TOKENS = {"CLEANUP_TRIGGER_TOKEN": "t" * 32, "CUSTOMER_API_TOKEN": "c" * 24}


def _seconds(value: str) -> float:
    """systemd and compose durations as used here: '30', '30s', '1m30s'."""
    total, units = 0.0, {"h": 3600, "m": 60, "s": 1, "": 1}
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*(h|m|s|)", value):
        total += float(number) * units[unit]
    return total


def _containerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of the final stage, continuation lines joined."""
    text = (ROOT / "Containerfile").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    stages: list[list[tuple[str, str]]] = []
    for line in lines:
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stages.append([])
        stages[-1].append((word.upper(), rest.strip()))
    return stages[-1]


def _drain_budget(grace: float) -> float:
    # The service's own bound on a stop (the grace, the final writes, the closing).
    return max_stop_seconds(grace)


def test_systemd_waits_longer_than_the_drain() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(PACKAGING / "cleanup-supervisor.service")
    service = unit["Service"]
    assert service["KillSignal"] == "SIGTERM"
    # The unit runs the default grace (its config sets none).
    grace = config.ServiceConfig().shutdown_grace_seconds
    assert _seconds(service["TimeoutStopSec"]) > _drain_budget(grace)


def test_compose_stop_grace_covers_each_replicas_drain() -> None:
    doc = yaml.safe_load((PACKAGING / "compose.yaml").read_text())
    replicas = {name: svc for name, svc in doc["services"].items() if name.startswith("replica")}
    assert replicas
    for name, svc in replicas.items():
        grace = float(svc["environment"].get("CLEANUP__SERVICE__SHUTDOWN_GRACE_SECONDS",
                                             config.ServiceConfig().shutdown_grace_seconds))
        assert svc["stop_signal"] == "SIGTERM", name
        assert _seconds(svc["stop_grace_period"]) > _drain_budget(grace), name


def test_image_documents_a_stop_timeout_longer_than_the_drain() -> None:
    # An image cannot carry a stop timeout: the run command in its header must.
    header = (ROOT / "Containerfile").read_text()
    timeouts = [float(t) for t in re.findall(r"--stop-timeout\s+(\d+)", header)]
    grace = tomllib.loads((PACKAGING / "container.toml").read_text())["service"][
        "shutdown_grace_seconds"]
    assert timeouts
    assert min(timeouts) > _drain_budget(grace)
    readme = (ROOT / "README.md").read_text()
    assert all(float(t) > _drain_budget(grace)
               for t in re.findall(r"--stop-timeout\s+(\d+)", readme))


def _image_source(stage: list[tuple[str, str]], path: Path) -> Path | None:
    """The repository file that ends up at ``path`` in the image, or None."""
    workdir, found = Path("/"), None
    for word, args in stage:
        if word == "WORKDIR":
            workdir = workdir / args
        elif word == "COPY" and "--from" not in args:
            *sources, dest = shlex.split(args)
            target = workdir / dest
            for src in sources:
                if target == path:  # a file copied to this name
                    found = ROOT / src
                elif path.is_relative_to(target) and (ROOT / src).is_dir():
                    candidate = ROOT / src / path.relative_to(target)
                    found = candidate if candidate.exists() else found
    return found


def test_image_holds_the_config_serve_and_demo_read() -> None:
    stage = _containerfile()
    env = " ".join(args for word, args in stage if word == "ENV")
    serve_config = re.search(r"CLEANUP_CONFIG=(\S+)", env)
    assert serve_config, "the image must say where serve's config is"
    serve_source = _image_source(stage, Path(serve_config.group(1)))
    assert serve_source is not None, f"{serve_config.group(1)} is not in the image"
    cfg = config.load(serve_source, environ=TOKENS)  # valid once the two secrets are given
    assert cfg.service.listen.startswith("0.0.0.0:")
    # Off loopback the safe defaults hold in the image too: a Secure cookie, and HSTS.
    assert cfg.status.secure_cookie is True
    assert cfg.service.hsts_seconds == 365 * 86400
    # demo's default config path is relative: it resolves in the image's working directory.
    workdir = Path([args for word, args in stage if word == "WORKDIR"][-1])
    demo_default = parser().parse_args(["demo"]).config
    demo_source = _image_source(stage, workdir / demo_default)
    assert demo_source is not None, f"{workdir / demo_default} is not in the image"
    config.load(demo_source, environ=TOKENS)
