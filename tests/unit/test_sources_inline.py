"""Candidate validation and the inline source's paging (pure logic, no I/O)."""

from __future__ import annotations

import pytest

from supervisor.sources import MAX_ID_LENGTH, InlineSource, check_recipient_id


@pytest.mark.parametrize(("value", "reason"), [
    ("r-000001", None),
    ("user@example.com", None),
    ("ünïcødé", None),
    ("x" * MAX_ID_LENGTH, None),
    (None, "not_a_string"),
    (42, "not_a_string"),
    (["r-1"], "not_a_string"),
    ({"id": "r-1"}, "not_a_string"),
    ("", "empty"),
    ("   ", "empty"),
    ("x" * (MAX_ID_LENGTH + 1), "too_long"),
    ("x" * 10_000, "too_long"),
    ("a\x00b", "control_character"),
    ("a\nb", "control_character"),
    ("a\x7fb", "control_character"),
    ("a\ud800b", "control_character"),  # a lone surrogate cannot be sent anywhere
])
def test_check_recipient_id(value: object, reason: str | None) -> None:
    assert check_recipient_id(value) == reason


async def test_inline_pages_with_an_index_cursor() -> None:
    source = InlineSource([f"r-{i}" for i in range(5)])
    first = await source.page(None, 2)
    assert (first.ids, first.next_cursor) == (["r-0", "r-1"], "2")
    second = await source.page(first.next_cursor, 2)
    assert (second.ids, second.next_cursor) == (["r-2", "r-3"], "4")
    last = await source.page(second.next_cursor, 2)
    assert (last.ids, last.next_cursor) == (["r-4"], None)


async def test_inline_exact_multiple_ends_on_the_last_full_page() -> None:
    source = InlineSource(["a", "b", "c", "d"])
    first = await source.page(None, 2)
    last = await source.page(first.next_cursor, 2)
    assert (last.ids, last.next_cursor) == (["c", "d"], None)


async def test_inline_empty() -> None:
    page = await InlineSource([]).page(None, 10)
    assert (page.ids, page.next_cursor, page.skipped.total()) == ([], None, 0)


async def test_inline_skips_garbage_with_reasons_and_in_page_duplicates() -> None:
    page = await InlineSource(["a", "", None, "a", "b\x00", "b"]).page(None, 10)
    assert page.ids == ["a", "b"]
    assert dict(page.skipped) == {"empty": 1, "not_a_string": 1, "duplicate_in_page": 1,
                                  "control_character": 1}


async def test_inline_resumes_from_any_cursor() -> None:
    ids = [f"r-{i}" for i in range(7)]
    source = InlineSource(ids)
    for start in range(len(ids)):
        seen: list[str] = []
        cursor: str | None = str(start)
        while True:
            page = await source.page(cursor, 3)
            seen += page.ids
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert seen == ids[start:]


@pytest.mark.parametrize(("candidate", "kept"), [
    ("../../admin", False), ("..", False), (".", False), ("a/../b", False), ("a\\..\\b", False),
    ("./x", False), ("a/b", True), ("...", True), ("a..b", True), ("r-1.", True), ("..a", True),
])
async def test_path_like_candidates_are_skipped(candidate: str, kept: bool) -> None:
    """A dot segment stays inside one percent-encoded path segment, but a proxy that
    decodes %2F would aim the DELETE elsewhere: such candidates are refused at the scan."""
    page = await InlineSource([candidate]).page(None, 10)
    assert page.ids == ([candidate] if kept else [])
    assert dict(page.skipped) == ({} if kept else {"path_traversal": 1})
