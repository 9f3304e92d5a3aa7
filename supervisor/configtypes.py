"""What every configuration section shares: the secret type and the common checks."""

from __future__ import annotations

import re

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


def _positive(section: str, obj: object, *names: str) -> list[str]:
    out = []
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            out.append(f"{section}.{name} must be > 0, got {value}")
    return out
