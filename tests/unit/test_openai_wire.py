"""proxy.openai: the OpenAI wire knowledge, each piece once."""

from __future__ import annotations

import json

import pytest

from proxy.openai.auth import bearer_token, is_valid_utf8, key_matches
from proxy.openai.errors import error_body, error_type_for, upstream_error_body
from proxy.openai.headers import SSE_HEADERS, STREAM_ONLY
from proxy.openai.messages import last_user_text, question_text


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer abc", "abc"),
        ("BEARER  abc ", "abc"),
        ("Bearer ", None),
        ("Bearer", None),
        ("Basic YWJj", None),
        ("", None),
        (None, None),
        ("Bearerabc", None),
    ],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def test_key_matches_every_key_and_only_whole_keys() -> None:
    keys = ("k-one", "k-two", "ünï")
    assert key_matches("k-two", keys)
    assert key_matches("ünï", keys)
    assert not key_matches("k-tw", keys)
    assert not key_matches("k-two ", keys)
    assert not key_matches(None, keys)
    assert not key_matches("", ("",))
    # Bytes that are not UTF-8 (aiohttp's surrogateescape) compare, never raise.
    assert not key_matches("\udcff\udcfe", keys)
    assert not is_valid_utf8("Bearer \udcff")
    assert is_valid_utf8("Bearer ünï") and is_valid_utf8("Bearer abc")


def test_error_body_is_the_openai_object_and_total() -> None:
    obj = json.loads(error_body("bad \udcff path", "invalid_request_error", "x", "p"))
    assert obj == {
        "error": {
            "message": "bad \udcff path",
            "type": "invalid_request_error",
            "param": "p",
            "code": "x",
        }
    }
    assert error_type_for(404) == "invalid_request_error"
    assert error_type_for(429) == "rate_limit_error"
    assert error_type_for(503) == "server_error"


def test_upstream_error_body() -> None:
    ours = b'{"error": {"message": "m", "type": "t", "param": null, "code": 400}}'
    assert upstream_error_body(400, ours) == ours
    wrapped = json.loads(upstream_error_body(502, b"<html>Bad Gateway</html>"))["error"]
    assert wrapped["message"] == "backend error: <html>Bad Gateway</html>"
    assert (wrapped["type"], wrapped["code"]) == ("server_error", 502)
    empty = json.loads(upstream_error_body(500, b""))["error"]
    assert empty["message"] == "backend error: HTTP 500"
    deep = b"[" * 100_000
    assert json.loads(upstream_error_body(500, deep))["error"]["code"] == 500


def _chat(*messages: dict[str, object]) -> dict[str, object]:
    return {"messages": list(messages)}


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (_chat({"role": "user", "content": "hi"}), "hi"),
        (
            _chat(
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": [{"type": "text", "text": "second"}]},
            ),
            "second",
        ),
        # Text parts only, joined the way vLLM renders them (newlines).
        (
            _chat(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "image_url", "image_url": {"url": "u"}, "text": "not me"},
                        {"text": "b"},
                        {"type": "text", "text": 5},
                    ],
                }
            ),
            "a\nb",
        ),
        # The last user message is the question, even without text: never an older one.
        (
            _chat(
                {"role": "user", "content": "older"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
            ),
            None,
        ),
        (_chat({"role": "user", "content": "older"}, {"role": "user", "content": None}), None),
        (_chat({"role": "system", "content": "s"}), None),
        ({"messages": "nope"}, None),
        ({"prompt": "p"}, None),
    ],
)
def test_last_user_text(body: dict[str, object], text: str | None) -> None:
    assert last_user_text(body) == text


def test_question_text() -> None:
    assert question_text(_chat({"role": "user", "content": "q"})) == "q"
    assert question_text(_chat({"role": "assistant", "content": "a"})) == ""
    assert question_text({"prompt": "p"}) == "p"
    assert question_text({"prompt": ["a", "b"]}) == ""


def test_stream_headers() -> None:
    assert dict(SSE_HEADERS) == {
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
    }
    assert {"content-type", "cache-control", "x-accel-buffering"} == STREAM_ONLY
