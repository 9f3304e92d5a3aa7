"""Text from outside made fit for a log line and an error message: a webhook receiver's
error body, a managed service's error message and hint, an exception naming a URL.

Escaped (a newline in it cannot start a forged log line), bounded (a receiver answering a
megabyte of HTML costs one short line), and URLs cut to scheme and host (a sink's URL may
carry a token in its path, query or user part; aiohttp's errors repeat the whole URL).
"""

from __future__ import annotations

import re

LIMIT = 200
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<netloc>[^/?#\s'\"<>]*)"
                  r"(?P<rest>[/?#][^\s'\"<>]*)?")


def _cut(m: re.Match[str]) -> str:
    host = m["netloc"].rpartition("@")[2]  # user:password@ goes
    return f"{m['scheme']}://{host}" + ("/..." if m["rest"] else "")


def redact_urls(text: str) -> str:
    """Every URL in ``text`` cut to its scheme and host."""
    return _URL.sub(_cut, text)


def outside(text: str, limit: int = LIMIT) -> str:
    """``text`` with URLs cut, control and non-ASCII characters escaped (``\\n``,
    ``\\x1b``, ``\\u2028``), and at most ``limit`` characters of it (then ``...``)."""
    escaped = redact_urls(text).encode("unicode_escape").decode("ascii")
    return escaped if len(escaped) <= limit else escaped[:limit] + "..."
