"""File and HTTP candidate sources on real files and a real sandbox over loopback."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from cleanup_sandbox import SandboxConfig, run_sandbox
from supervisor.config import SourceConfig
from supervisor.errors import SourceError
from supervisor.sources import CandidateSource, FileSource, HttpSource, Page


async def drain(source: CandidateSource, limit: int,
                cursor: str | None = None) -> tuple[list[str], Counter[str], list[str | None]]:
    """Page until exhausted; return the IDs, the skipped reasons and every cursor seen."""
    ids: list[str] = []
    skipped: Counter[str] = Counter()
    cursors: list[str | None] = [cursor]
    for _ in range(100_000):
        page: Page = await source.page(cursor, limit)
        ids += page.ids
        skipped += page.skipped
        cursor = page.next_cursor
        if cursor is None:
            return ids, skipped, cursors
        cursors.append(cursor)
    raise AssertionError("the source never ended")


# -- files ----------------------------------------------------------------------------------


def jsonl(tmp_path: Path, lines: list[str]) -> FileSource:
    path = tmp_path / "candidates.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return FileSource(path, "jsonl", "id")


async def test_jsonl_objects_and_bare_strings(tmp_path: Path) -> None:
    source = jsonl(tmp_path, ['{"id": "r-1"}', '"r-2"', '{"id": "r-3", "extra": 1}'])
    ids, skipped, _ = await drain(source, 2)
    assert ids == ["r-1", "r-2", "r-3"]
    assert not skipped


async def test_jsonl_garbage_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    source = jsonl(tmp_path, [
        '{"id": "r-1"}', "not json", "", "   ", '{"id": ""}', '{"nope": 1}', "42",
        '{"id": "a\\u0000b"}', '{"id": "r-2"}', "{truncated",
    ])
    ids, skipped, _ = await drain(source, 3)
    assert ids == ["r-1", "r-2"]
    assert skipped == Counter({"malformed_line": 2, "empty": 1, "not_a_string": 2,
                               "control_character": 1})


async def test_jsonl_invalid_utf8_line_is_malformed(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"id": "r-1"}\n"\xff\xfe"\n{"id": "r-2"}\n')
    ids, skipped, _ = await drain(FileSource(path, "jsonl", "id"), 10)
    assert ids == ["r-1", "r-2"]
    assert skipped == Counter({"malformed_line": 1})


async def test_file_without_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'"r-1"\n"r-2"')
    ids, _, _ = await drain(FileSource(path, "jsonl", "id"), 1)
    assert ids == ["r-1", "r-2"]


async def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"")
    page = await FileSource(path, "jsonl", "id").page(None, 10)
    assert (page.ids, page.next_cursor) == ([], None)


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 50])
async def test_byte_offset_cursor_is_stable_and_resumable_from_any_cursor(
        tmp_path: Path, limit: int) -> None:
    lines = [f'{{"id": "r-{i:03d}"}}' if i % 5 else "garbage" for i in range(1, 31)]
    source = jsonl(tmp_path, lines)
    all_ids, all_skipped, cursors = await drain(source, limit)
    assert len(all_ids) == 24
    assert all_skipped == Counter({"malformed_line": 6})
    # The cursor is a byte offset into the file.
    data = (tmp_path / "candidates.jsonl").read_bytes()
    for c in cursors[1:]:
        assert c is not None
        assert data[int(c) - 1:int(c)] == b"\n"
    # Resuming from any committed cursor yields exactly the rest, nothing twice.
    seen_before = 0
    for i, cursor in enumerate(cursors):
        rest, _, again = await drain(source, limit, cursor)
        assert rest == all_ids[seen_before:]
        assert again == cursors[i:]  # the same cursors again: stable
        seen_before += len((await source.page(cursor, limit)).ids)


async def test_csv_with_header_and_extra_columns(tmp_path: Path) -> None:
    path = tmp_path / "c.csv"
    path.write_text('email,id,note\na@x,r-1,"hello, world"\nb@x,r-2,\n,,\nc@x,"r-3",x\n',
                    encoding="utf-8")
    ids, skipped, cursors = await drain(FileSource(path, "csv", "id"), 2)
    assert ids == ["r-1", "r-2", "r-3"]
    assert skipped == Counter({"empty": 1})
    # Resuming from the first cursor never re-reads the header as a candidate.
    rest, _, _ = await drain(FileSource(path, "csv", "id"), 2, cursors[1])
    assert rest == ["r-3"]


async def test_csv_resume_from_zero_skips_the_header(tmp_path: Path) -> None:
    path = tmp_path / "c.csv"
    path.write_text("id\nr-1\nr-2\n", encoding="utf-8")
    ids, _, _ = await drain(FileSource(path, "csv", "id"), 10, "0")
    assert ids == ["r-1", "r-2"]


async def test_csv_with_crlf_line_endings(tmp_path: Path) -> None:
    path = tmp_path / "c.csv"
    path.write_bytes(b"id,name\r\nr-1,a\r\nr-2,b\r\n")
    ids, skipped, _ = await drain(FileSource(path, "csv", "id"), 1)
    assert ids == ["r-1", "r-2"]
    assert not skipped


async def test_csv_with_a_byte_order_mark(tmp_path: Path) -> None:
    """Spreadsheet exports start with a UTF-8 BOM; the header is still 'id'."""
    path = tmp_path / "c.csv"
    path.write_bytes(b"\xef\xbb\xbfid,name\nr-1,a\n")
    ids, _, _ = await drain(FileSource(path, "csv", "id"), 10)
    assert ids == ["r-1"]


async def test_csv_without_the_id_column_is_a_source_error(tmp_path: Path) -> None:
    path = tmp_path / "c.csv"
    path.write_text("email\na@x\n", encoding="utf-8")
    with pytest.raises(SourceError, match="no column 'id'"):
        await FileSource(path, "csv", "id").page(None, 10)


async def test_missing_file_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="cannot read"):
        await FileSource(tmp_path / "absent.jsonl", "jsonl", "id").page(None, 10)


async def test_other_id_field(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"recipient": "r-1", "id": "no"}\n', encoding="utf-8")
    ids, _, _ = await drain(FileSource(path, "jsonl", "recipient"), 10)
    assert ids == ["r-1"]


# -- HTTP --------------------------------------------------------------------------------------


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def http_source(url: str, session: aiohttp.ClientSession, **kw: object) -> HttpSource:
    return HttpSource(SourceConfig(kind="http", url=url, **kw), session)  # type: ignore[arg-type]


async def test_http_source_against_the_sandbox(session: aiohttp.ClientSession) -> None:
    async with run_sandbox(SandboxConfig(recipients=1234)) as sb:
        source = http_source(f"{sb.url}/stale-recipients", session)
        ids, skipped, cursors = await drain(source, 100)
        assert ids == sb.state.population
        assert not skipped
        assert len(cursors) == 13  # 1234 / 100, rounded up: one fetch per page
        assert sb.state.stats()["pages_served"] == 13


async def test_http_source_skips_garbage_and_sees_every_real_id_once(
        session: aiohttp.ClientSession) -> None:
    async with run_sandbox(SandboxConfig(recipients=800, garbage_share=0.25)) as sb:
        source = http_source(f"{sb.url}/stale-recipients", session)
        ids, skipped, _ = await drain(source, 64)
        assert Counter(ids) == Counter(sb.state.population)  # every real ID, exactly once
        assert skipped.total() == sb.state.stats()["garbage_listed"] == 200
        assert set(skipped) <= {"not_a_string", "empty", "too_long", "control_character",
                                "not_an_object", "path_traversal", "duplicate_in_page"}


async def test_http_source_sends_the_token(session: aiohttp.ClientSession) -> None:
    from supervisor.configtypes import Secret

    async with run_sandbox(SandboxConfig(recipients=3, token="src-token")) as sb:
        with pytest.raises(SourceError, match="HTTP 401"):
            await http_source(f"{sb.url}/stale-recipients", session).page(None, 10)
        good = http_source(f"{sb.url}/stale-recipients", session, token=Secret("src-token"))
        assert (await good.page(None, 10)).ids == sb.state.population


async def test_http_source_unreachable_is_a_source_error(session: aiohttp.ClientSession) -> None:
    async with run_sandbox(SandboxConfig(recipients=1)) as sb:
        url = f"{sb.url}/stale-recipients"
    with pytest.raises(SourceError, match="unreachable"):
        await http_source(url, session).page(None, 10)


async def test_http_source_timeout_is_a_source_error(session: aiohttp.ClientSession) -> None:
    async with run_sandbox(SandboxConfig(recipients=1, page_delay_ms=500)) as sb:
        source = http_source(f"{sb.url}/stale-recipients", session, timeout_seconds=0.1)
        with pytest.raises(SourceError, match=r"unreachable: .*Timeout"):
            await source.page(None, 10)


async def serve(handler: web.Handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/c", handler)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/c"


@pytest.mark.parametrize(("body", "match"), [
    (b"<html>oops</html>", "not JSON"),
    (b"[1, 2]", "no list field 'items'"),
    (b'{"items": {"id": "r-1"}}', "no list field 'items'"),
    (b'{"data": []}', "no list field 'items'"),
    (b'{"items": [], "next_cursor": {"p": 1}}', "is not a string"),
    (b'{"items": [], "next_cursor": "same"}', "same cursor again"),
])
async def test_malformed_pages_are_source_errors(session: aiohttp.ClientSession, body: bytes,
                                                 match: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    runner, url = await serve(handler)
    try:
        with pytest.raises(SourceError, match=match):
            await http_source(url, session).page("same", 10)
    finally:
        await runner.cleanup()


async def test_http_source_custom_fields_and_integer_cursor(session: aiohttp.ClientSession) -> None:
    data = [{"rid": f"r-{i}"} for i in range(5)]

    async def handler(request: web.Request) -> web.Response:
        start = int(request.query.get("after", "0"))
        size = int(request.query["n"])
        end = min(start + size, len(data))
        return web.Response(body=orjson.dumps({"rows": data[start:end],
                                               "next": end if end < len(data) else None}),
                            content_type="application/json")

    runner, url = await serve(handler)
    try:
        source = http_source(url, session, cursor_param="after", limit_param="n",
                             items_field="rows", next_cursor_field="next", id_field="rid")
        ids, _, cursors = await drain(source, 2)
        assert ids == [f"r-{i}" for i in range(5)]
        assert cursors == [None, "2", "4"]
    finally:
        await runner.cleanup()
