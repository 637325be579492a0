"""Stream chunks on bytes: the markers the relay looks for, found without JSON.

A region is whole SSE events with LF line ends (`proxy.openai.sse.SSEFramer`). JSON
payloads cannot hold a raw newline, so a marker found at a line start is a
real SSE field, and a key found with its quotes is a real key (inside a JSON
string every `"` is escaped).

Substring tests on the relay's path are `find(...) >= 0`, not `in`: CPython
3.11's `bytes.__contains__` first tries its argument as an int, and raises
and discards a formatted TypeError before it searches (~1,100 instructions a
test, a dozen tests a request).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Final

from proxy.openai.sse import error_payload, find_line

if TYPE_CHECKING:
    from proxy.openai.chunkrun import Run

# A JSON string literal after its key; group 1 is its raw (escaped) contents.
LITERAL: Final = rb'\s*"([^"\\]*(?:\\.[^"\\]*)*)"'
CONTENT_RE: Final = re.compile(rb'"content":' + LITERAL)
TEXT_RE: Final = re.compile(rb'"text":' + LITERAL)

ERROR_LINE: Final = b'data: {"error"'
DONE_LINE: Final = b"data: [DONE]"


def has_finish_reason(data: bytes) -> bool:
    """True when a chunk carries a non-null finish_reason (vLLM sends `null` on
    every other chunk, so the key alone is not enough). Inside a JSON string
    the quotes would be escaped, so token text cannot match."""
    return data.find(b'"finish_reason":"') >= 0 or data.find(b'"finish_reason": "') >= 0


def single_choice_events(region: bytes) -> bool:
    """Every event of `region` is one `data:` line of a chunk with one choice,
    index 0 (`"choices":[{"index":0,` and no other `"index"` key): k such
    events need k of each marker and 2k newlines. Three C scans."""
    k = region.count(b'"choices":[{"index":0,') or region.count(b'"choices": [{"index": 0, ')
    return bool(k) and region.count(b'"index":') == k and region.count(b"\n") == 2 * k


def is_chunk_stream(region: bytes) -> bool:
    """The first region of a stream is chat or completion chunks (the format
    the guard and rescue know), not e.g. Responses API events."""
    return region.find(b'"choices"') >= 0


def markers(region: bytes, run: Run | None = None) -> tuple[int, int, bool, int]:
    """(events, first error event, any finish_reason, [DONE]) of a region of
    whole events, positions -1 if none. A run of plain text chunks holds none
    of the markers, so only the events around it are searched."""
    if run is None:
        return _search(region, 0)
    start, end = run.start, run.end
    events, err_at, finished, done_at = _search(region[:start], 0) if start else _NOTHING
    if err_at < 0 and done_at < 0 and end < len(region):
        more, err_at, fin, done_at = _search(region[end:], end)
        events += more
        finished = finished or fin
    return events + run.events, err_at, finished, done_at


_NOTHING: Final = (0, -1, False, -1)  # `_search(b"", 0)`


def _search(region: bytes, offset: int) -> tuple[int, int, bool, int]:
    err_at = find_line(region, ERROR_LINE)
    done_at = find_line(region, DONE_LINE)
    return (
        region.count(b"\n\n"),
        err_at + offset if err_at >= 0 else -1,
        has_finish_reason(region),
        done_at + offset if done_at >= 0 else -1,
    )


def is_error_event(data: bytes) -> bool:
    return data[:12].replace(b" ", b"").startswith(b'{"error"')


def error_status(data: bytes) -> tuple[int, bytes]:
    """HTTP status and JSON body for an error event that arrived before any
    answer bytes: the event's own `code` when it is an HTTP status."""
    try:
        obj = json.loads(data)
        code = obj["error"].get("code")
    except (ValueError, KeyError, AttributeError, TypeError):
        body = error_payload("upstream sent a malformed error event", "server_error", 502)
        return 502, json.dumps(body).encode()
    status = code if isinstance(code, int) and 400 <= code <= 599 else 502
    return status, data
