"""The layout's promises that import-linter cannot see: the service's wheel carries only the
service, nothing of the service imports the benchmarks or the tests (neither is a package
import-linter could name), and no module grows past the size the project keeps to."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "supervisor"
# ~600 lines is the project's rule; a module past it is a module with two jobs.
MAX_MODULE_LINES = 620


def _service_modules() -> list[Path]:
    return sorted(SERVICE.rglob("*.py"))


def test_the_service_wheel_holds_the_service_only() -> None:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]
    packages = find_packages(str(ROOT), include=find["include"])
    assert "supervisor" in packages
    assert all(p == "supervisor" or p.startswith("supervisor.") for p in packages), packages
    # The sandbox ships apart: it is not a subpackage of the service any more.
    assert not (SERVICE / "sandbox").exists()
    assert (ROOT / "sandbox" / "cleanup_sandbox" / "__init__.py").is_file()


@pytest.mark.parametrize("path", _service_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_service_module_imports_the_benchmarks_or_the_tests(path: Path) -> None:
    # bench/ and tests/ are folders of scripts, not installed packages: import-linter's
    # contracts cannot name them, so each import is read here.
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    bench_modules = {p.stem for p in (ROOT / "bench").glob("*.py")}
    wrong = [n for n in names if n.split(".")[0] in {"bench", "tests", "conftest"}
             or n in bench_modules]
    assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


@pytest.mark.parametrize("path", _service_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_service_module_is_past_the_size_the_project_keeps_to(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)}: {lines} lines"
