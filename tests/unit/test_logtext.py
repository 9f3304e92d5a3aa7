"""Text from outside in logs and errors (issue 17, L8): escaped, bounded, URL tokens cut."""

from __future__ import annotations

import pytest

from supervisor.infrai.client import InfraiError, _error
from supervisor.logtext import outside, redact_urls


@pytest.mark.parametrize(("text", "expected"), [
    ("plain words", "plain words"),
    ("two\nlines\r", "two\\nlines\\r"),
    ("esc \x1b[2J", "esc \\x1b[2J"),
    ("line sep \u2028 here", "line sep \\u2028 here"),
    ("InvalidUrlClientError: https://hooks.example/t/sk_live_1?sig=2",
     "InvalidUrlClientError: https://hooks.example/..."),
    ("at http://user:pw@10.0.0.1:8080/x and https://h", "at http://10.0.0.1:8080/... and https://h"),
])
def test_outside_text_is_escaped_and_urls_cut(text: str, expected: str) -> None:
    assert outside(text) == expected


def test_outside_text_is_bounded() -> None:
    assert outside("x" * 5000) == "x" * 200 + "..."
    assert outside("\n" * 150, limit=10) == "\\n" * 5 + "..."


def test_redact_keeps_the_host_and_port() -> None:
    assert redact_urls("url='http://127.0.0.1:9/a/b'") == "url='http://127.0.0.1:9/...'"


def test_infrai_error_text_is_escaped_and_bounded() -> None:
    envelope = {"ok": False, "error": {"code": "BAD\nCODE", "message": "no\nINFO forged" + "m" * 500,
                                       "hint": "see https://infrai.example/docs?key=ifr_secret"}}
    code, message, hint = _error(envelope)
    text = str(InfraiError("queue.publish", 400, code, message, hint))
    assert "\n" not in text
    assert message.startswith("no\\nINFO forged")
    assert len(message) == 203
    assert hint == "see https://infrai.example/..."
    assert code == "BAD\\nCODE"
