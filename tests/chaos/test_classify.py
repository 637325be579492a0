"""The drills' client-side verdicts, on hand-made byte streams (no servers)."""

from __future__ import annotations

import json

import pytest

from tests.chaos.drill import classify

SSE = "text/event-stream; charset=utf-8"


def chunk(text: str, finish: str | None = None) -> bytes:
    obj = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
ERROR = (
    b'data: {"error": {"message": "boom", "type": "server_error", '
    b'"code": "upstream_disconnect"}}\n\n'
)


@pytest.mark.parametrize(
    ("raw", "outcome", "rescued", "code"),
    [
        (chunk("a") + chunk("b", "stop") + DONE, "complete", False, ""),
        (
            chunk("a") + b": brownout-rescue from=primary to=fallback reason=x\n\n"
            + chunk("b", "length") + DONE,
            "complete", True, "",
        ),
        (b": ping\n\n" + chunk("a") + ERROR + DONE, "error", False, "upstream_disconnect"),
        (chunk("a") + chunk("b"), "truncated", False, "no finish_reason and [DONE]"),
        (chunk("a") + DONE, "truncated", False, "no finish_reason"),
        (chunk("a", "stop"), "truncated", False, "no [DONE]"),
        (chunk("a", "stop").replace(b"\n", b"\r\n") + DONE, "complete", False, ""),
    ],
)  # fmt: skip
def test_stream_verdicts(raw: bytes, outcome: str, rescued: bool, code: str) -> None:
    v = classify(200, SSE, raw)
    assert (v.outcome, v.rescued, v.code) == (outcome, rescued, code)


def test_a_cut_connection_is_an_error_not_a_success() -> None:
    v = classify(200, SSE, chunk("a"), transport_error="ClientPayloadError")
    assert (v.outcome, v.code) == ("error", "transport:ClientPayloadError")


def test_http_errors_keep_their_code() -> None:
    body = (
        b'{"error": {"message": "busy", "type": "rate_limit_error", "code": "rate_limit_exceeded"}}'
    )
    assert classify(429, "application/json", body).code == "429:rate_limit_exceeded"
    assert classify(503, "text/html", b"<html>").code == "503:http_503"


def test_non_streaming_bodies() -> None:
    ok = {"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]}
    assert classify(200, "application/json", json.dumps(ok).encode()).outcome == "complete"
    cut = {"choices": [{"message": {"content": "x"}, "finish_reason": None}]}
    assert classify(200, "application/json", json.dumps(cut).encode()).outcome == "truncated"
