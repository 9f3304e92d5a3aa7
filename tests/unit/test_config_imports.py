"""One import path per settings type (issue 18, point 9): every ``*Config`` class and
``Secret`` is imported from the module that defines it, never through another module that
happens to import it too (``supervisor.config`` once re-exported four of them)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("supervisor", "sandbox/cleanup_sandbox", "tests", "bench")


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT / "sandbox" if path.is_relative_to(ROOT / "sandbox") else ROOT)
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> list[Path]:
    return [p for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))]


def _settings_types() -> dict[str, str]:
    """Each settings type's name and the module that defines it."""
    defined: dict[str, str] = {}
    for path in sorted((ROOT / "supervisor").rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and (node.name.endswith("Config")
                                                   or node.name == "Secret"):
                assert node.name not in defined, f"{node.name} is defined twice"
                defined[node.name] = _module(path)
    return defined


def test_the_settings_types_are_found() -> None:
    types = _settings_types()
    assert types["Config"] == "supervisor.config"
    assert types["InfraiConfig"] == "supervisor.infrai.settings"
    assert types["Secret"] == "supervisor.configtypes"


def test_every_settings_type_is_imported_from_where_it_is_defined() -> None:
    types = _settings_types()
    wrong = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if not node.module.startswith("supervisor"):
                continue
            for alias in node.names:
                home = types.get(alias.name)
                if home is not None and home != node.module:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name} from "
                                 f"{node.module}, defined in {home}")
    assert wrong == []
