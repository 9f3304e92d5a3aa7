"""docs/configuration.md against the configuration's dataclasses (issue 18, point 8), as
uvicorn's ``test_run_match_config_params`` holds its settings page to ``Config``: every key
of every section (entries of a list of tables too, as ``limits.quota.limit``) has its row,
every row names a key that exists, and each default written there is the code's."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest

from supervisor import config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
# Fields the loader fills from the environment (``*_env`` names the variable): never a key.
SECRETS = {"token", "tick_token", "metrics_token", "secret", "push_secret", "dsn",
           "redis_dsn", "rabbitmq_dsn"}
ROW = re.compile(r"^\| `([a-z_]+(?:\.[a-z_]+)+)` \| ([^|]*) \|", re.MULTILINE)


def _keys(cls: type[Any], prefix: str) -> dict[str, Any]:
    """``section.key`` -> default, for a section dataclass and its lists of tables."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in SECRETS:
            continue
        args = typing.get_args(hints[f.name])
        if typing.get_origin(hints[f.name]) is tuple and args and dataclasses.is_dataclass(args[0]):
            out.update(_keys(args[0], f"{prefix}.{f.name}"))  # type: ignore[arg-type]
        else:
            out[f"{prefix}.{f.name}"] = f.default
    return out


def code_keys() -> dict[str, Any]:
    hints = typing.get_type_hints(config.Config)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config.Config):
        out.update(_keys(hints[f.name], f.name))
    return out


def doc_rows() -> dict[str, str]:
    rows: dict[str, str] = {}
    for key, default in ROW.findall(DOC.read_text(encoding="utf-8")):
        assert key not in rows, f"{key} has two rows"
        rows[key] = default.strip()
    return rows


def test_the_walk_sees_every_section_and_the_lists_of_tables() -> None:
    keys = code_keys()
    assert {k.split(".")[0] for k in keys} == {f.name for f in dataclasses.fields(config.Config)}
    assert "events.sink.secret_env" in keys
    assert "limits.quota.period_seconds" in keys
    assert "trigger.token" not in keys
    assert "ledger.dsn_env" in keys


def test_every_key_has_its_row_and_every_row_a_key() -> None:
    code, doc = set(code_keys()), set(doc_rows())
    assert sorted(code - doc) == [], "keys without a row in docs/configuration.md"
    assert sorted(doc - code) == [], "rows in docs/configuration.md for keys that do not exist"


def _written(cell: str) -> Any:
    """The default as the page writes it: a TOML value in backticks, or "unset"."""
    if cell == "unset":
        return None
    match = re.fullmatch(r"`(.+)`", cell)
    assert match, f"a default is a TOML value in backticks, 'unset' or 'required': {cell!r}"
    return tomllib.loads(f"v = {match.group(1)}")["v"]


@pytest.mark.parametrize("key", sorted(code_keys()))
def test_each_default_is_the_codes(key: str) -> None:
    cell = doc_rows()[key]
    default = code_keys()[key]
    if cell == "required":
        # Only an entry of a list of tables has no usable default.
        assert key.count(".") == 2, f"{key}: only list-of-tables entries are 'required'"
        return
    written = _written(cell)
    if isinstance(default, tuple):
        written = tuple(written)
    elif isinstance(default, Path):
        written = Path(written)
    assert written == default, f"{key}: the page says {cell}, the code {default!r}"


def test_the_demo_file_is_not_called_the_reference() -> None:
    # config/default.toml is the demo's configuration; the reference is this page alone.
    header = (ROOT / "config" / "default.toml").read_text(encoding="utf-8").split("\n\n")[0]
    assert "docs/configuration.md" in header
    for path in (ROOT / "README.md", DOC, ROOT / "config" / "default.toml"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"default\.toml`? (is|as) the (commented )?reference", text), path


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_link_between_the_pages_lands() -> None:
    # The README and docs/ link to each other's sections: a moved heading must not strand one.
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []
