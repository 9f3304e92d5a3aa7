"""What every configuration section shares: the secret type, the one secret reader and
the common checks."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

# A PostgreSQL schema the service owns: checked once, by the config and again before any
# statement is built with it (it is spliced into SQL as an identifier).
SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,39}$")


class Secret:
    """A token that never shows itself in logs, reprs or tracebacks."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def read_secret(key: str, var: str, env: Mapping[str, str]) -> tuple[Secret | None, str]:
    """The secret in ``$var``, else in the file ``$<var>_FILE`` names, and the problem found
    (``""`` if none). ``key`` is the ``*_env`` key naming ``var``, as problems name it.

    An unset secret is ``(None, "")``: whether that is a problem is the section's to say
    (:func:`missing_secret` words it)."""
    if var in env:
        value = env[var].strip()
        return (Secret(value), "") if value else (None, f"{key}: ${var} is empty")
    file_var = f"{var}_FILE"
    if file_var in env:
        try:
            value = Path(env[file_var]).read_text(encoding="utf-8").strip()
        except OSError as exc:
            return None, f"{key}: ${file_var} cannot be read: {exc.strerror}"
        return (Secret(value), "") if value else (None, f"{key}: ${file_var} is empty")
    return None, ""


def missing_secret(key: str, var: str, why: str) -> str:
    """The problem of a required secret that is not set: every section words it so (the
    loader recognises it by :data:`MISSING_SECRET`, for commands that serve nothing)."""
    return f"{key}: ${var} (or ${var}_FILE) is not set; {why}"


MISSING_SECRET = re.compile(r"\$\S+ \(or \$\S+_FILE\) is not set")


def _positive(section: str, obj: object, *names: str) -> list[str]:
    out = []
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            out.append(f"{section}.{name} must be > 0, got {value}")
    return out
