"""Candidate sources: where stale recipient IDs come from, one stable page at a time.

Every source pages with an opaque cursor that the scan stores after each committed page,
so a scan killed mid-way resumes from the last committed page. Only one page is in memory.
"""

from __future__ import annotations

import asyncio
import csv
import io
import unicodedata
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson

from supervisor.config import SourceConfig
from supervisor.errors import SourceError

MAX_ID_LENGTH = 256
MAX_PAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Page:
    ids: list[str]
    next_cursor: str | None  # None: the source is exhausted
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> rejected candidates


class CandidateSource(Protocol):
    async def page(self, cursor: str | None, limit: int) -> Page:
        """Read the page after ``cursor`` (None: the first). Raises SourceError."""


def check_recipient_id(value: object) -> str | None:
    """Return why ``value`` is not a usable recipient ID, or None when it is."""
    if not isinstance(value, str):
        return "not_a_string"
    if not value or not value.strip():
        return "empty"
    if len(value) > MAX_ID_LENGTH:
        return "too_long"
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value):
        return "control_character"
    return None


def _path_like(value: str) -> bool:
    """A ``.`` or ``..`` path segment: percent-encoding keeps it inside one segment, but a
    proxy that decodes ``%2F`` would turn a DELETE for it into one for another resource."""
    return any(segment in (".", "..") for segment in value.replace("\\", "/").split("/"))


def _collect(items: Sequence[Any], id_field: str,
             objects_only: bool = False) -> tuple[list[str], Counter[str]]:
    ids: list[str] = []
    skipped: Counter[str] = Counter()
    seen: set[str] = set()
    for item in items:
        if objects_only and not isinstance(item, Mapping):
            skipped["not_an_object"] += 1
            continue
        value = item.get(id_field) if isinstance(item, Mapping) else item
        reason = check_recipient_id(value)
        if reason is None and isinstance(value, str) and _path_like(value):
            reason = "path_traversal"
        if reason is not None:
            skipped[reason] += 1
        elif value in seen:
            skipped["duplicate_in_page"] += 1
        else:
            assert isinstance(value, str)
            seen.add(value)
            ids.append(value)
    return ids, skipped


class InlineSource:
    """IDs sent in the trigger body; the cursor is an index into them."""

    def __init__(self, ids: Sequence[Any]) -> None:
        self._ids = ids

    async def page(self, cursor: str | None, limit: int) -> Page:
        start = int(cursor or 0)
        end = min(start + limit, len(self._ids))
        ids, skipped = _collect(self._ids[start:end], "id")
        return Page(ids, str(end) if end < len(self._ids) else None, skipped)


class FileSource:
    """A JSONL file (objects with the ID field, or bare strings) or a CSV with a header.

    The cursor is a byte offset, stable as long as the file is not rewritten mid-run.
    """

    def __init__(self, path: Path, fmt: str, id_field: str) -> None:
        self.path = path
        self.fmt = fmt
        self.id_field = id_field

    async def page(self, cursor: str | None, limit: int) -> Page:
        return await asyncio.to_thread(self._read, int(cursor or 0), limit)

    def _read(self, offset: int, limit: int) -> Page:
        try:
            with self.path.open("rb") as fh:
                header: list[str] | None = None
                if self.fmt == "csv":
                    # utf-8-sig: spreadsheet exports begin with a byte order mark.
                    header = next(csv.reader([fh.readline().decode("utf-8-sig")]), [])
                    if self.id_field not in header:
                        raise SourceError(f"{self.path}: CSV header has no column "
                                          f"{self.id_field!r}")
                    offset = max(offset, fh.tell())
                fh.seek(offset)
                items: list[Any] = []
                skipped: Counter[str] = Counter()
                while len(items) + skipped.total() < limit:
                    line = fh.readline()
                    if not line:
                        break
                    if not line.strip():
                        continue
                    item = self._parse(line, header)
                    if item is None:
                        skipped["malformed_line"] += 1
                    else:
                        items.append(item)
                position = fh.tell()
                at_end = not fh.read(1)
        except OSError as exc:
            raise SourceError(f"cannot read {self.path}: {exc.strerror}") from exc
        ids, more = _collect(items, self.id_field)
        return Page(ids, None if at_end else str(position), skipped + more)

    def _parse(self, line: bytes, header: list[str] | None) -> Any:
        try:
            if header is not None:
                row = next(csv.reader(io.StringIO(line.decode("utf-8"))), [])
                return dict(zip(header, row, strict=False))
            return orjson.loads(line)
        except (UnicodeDecodeError, orjson.JSONDecodeError, csv.Error):
            return None


class HttpSource:
    """A paged HTTP endpoint: ``GET url?cursor=..&limit=..`` answering items and a cursor."""

    def __init__(self, config: SourceConfig, session: aiohttp.ClientSession) -> None:
        assert config.url is not None
        self.config = config
        self.session = session

    async def page(self, cursor: str | None, limit: int) -> Page:
        c = self.config
        params = {c.limit_param: str(limit)}
        if cursor is not None:
            params[c.cursor_param] = cursor
        headers = {}
        if c.token is not None:
            headers["Authorization"] = f"Bearer {c.token.reveal()}"
        assert c.url is not None
        try:
            async with self.session.get(c.url, params=params, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=c.timeout_seconds),
                                        ) as resp:
                if resp.status != 200:
                    raise SourceError(f"candidate source answered HTTP {resp.status}")
                body = await resp.content.read(MAX_PAGE_BYTES + 1)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise SourceError(f"candidate source unreachable: {type(exc).__name__}") from exc
        if len(body) > MAX_PAGE_BYTES:
            raise SourceError("candidate page larger than 64 MiB")
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise SourceError(f"candidate page is not JSON: {exc}") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get(c.items_field), list):
            raise SourceError(f"candidate page has no list field {c.items_field!r}")
        next_cursor = doc.get(c.next_cursor_field)
        if next_cursor is not None and not isinstance(next_cursor, str | int):
            raise SourceError(f"candidate page field {c.next_cursor_field!r} is not a string")
        # Items are objects holding the ID field; a bare value is a malformed item.
        ids, skipped = _collect(doc[c.items_field], c.id_field, objects_only=True)
        nxt = str(next_cursor) if next_cursor not in (None, "") else None
        if nxt is not None and nxt == cursor:
            raise SourceError("candidate source returned the same cursor again")
        return Page(ids, nxt, skipped)


def source_for(spec: Mapping[str, Any], config: SourceConfig,
               session: aiohttp.ClientSession) -> CandidateSource:
    """The source a run reads: ``spec`` is the run's own (``{"kind": ..., "ids": [...]}``,
    as the ledger keeps it), ``config`` the configured file or HTTP source. The one place
    a kind becomes a source (the scan, and ``plan --count-source``)."""
    kind = spec.get("kind")
    if kind == "inline":
        return InlineSource(spec.get("ids", []))
    if kind == "file" and config.path is not None:
        return FileSource(config.path, config.format, config.id_field)
    if kind == "http":
        return HttpSource(config, session)
    raise SourceError(f"unknown or unconfigured source kind {kind!r}")
