"""Incremental Server-Sent Events parsing and writing, on bytes.

The relay forwards each event's original bytes (no re-serialisation), so the
parser's job is to find event boundaries cheaply and expose the `data` field.
The common case — LF line endings, one `data:` line per event — takes one
`bytes.find` per event; CR/CRLF input is normalised to LF first (a trailing
CR is held back until the next read, since it may be half of a CRLF).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
HEARTBEAT = b": ping\n\n"


@dataclass(frozen=True, slots=True)
class Event:
    """One SSE event: its wire bytes (normalised to LF, ending in a blank line)
    and the joined value of its `data` lines (None for comment-only events)."""

    raw: bytes
    data: bytes | None
    event: bytes | None = None

    @property
    def is_done(self) -> bool:
        return self.data == DONE


def _parse_block(block: bytes) -> Event:
    """Fields of one event block (without its terminating blank line)."""
    raw = block + b"\n\n"
    if block.startswith(b"data:") and b"\n" not in block:
        # Fast path: a single data line, the shape every LLM server emits.
        value = block[5:]
        return Event(raw, value[1:] if value[:1] == b" " else value)
    data: list[bytes] = []
    event: bytes | None = None
    for line in block.split(b"\n"):
        if not line or line[:1] == b":":
            continue  # comment
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value
        # id / retry / unknown fields carry nothing the relay needs.
    return Event(raw, b"\n".join(data) if data else None, event)


class SSEParser:
    """Feed bytes as they arrive; get complete events back."""

    __slots__ = ("_buf", "_cr_pending")

    def __init__(self) -> None:
        self._buf = b""
        self._cr_pending = False

    def feed(self, chunk: bytes) -> list[Event]:
        if self._cr_pending:
            chunk = b"\r" + chunk
            self._cr_pending = False
        if chunk.find(b"\r") >= 0:  # `find`, not `in`: see proxy.openai.chunks
            if chunk.endswith(b"\r"):
                # Might be the first half of CRLF: decide when the next read comes.
                chunk = chunk[:-1]
                self._cr_pending = True
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self._buf + chunk if self._buf else chunk
        events: list[Event] = []
        start = 0
        # A stream may open with blank lines; they are not events.
        while buf.startswith(b"\n", start):
            start += 1
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            events.append(_parse_block(buf[start:end]))
            start = end + 2
            while buf.startswith(b"\n", start):
                start += 1
        self._buf = buf[start:] if start else buf
        return events

    def flush(self) -> list[Event]:
        """Events left when the stream ended (a final event without its blank line)."""
        rest = self._buf
        if self._cr_pending:
            self._cr_pending = False
        self._buf = b""
        rest = rest.rstrip(b"\n")
        return [_parse_block(rest)] if rest else []

    @property
    def pending(self) -> int:
        """Bytes buffered for an incomplete event."""
        return len(self._buf)


class EventTooLarge(Exception):
    """An event grew past the framer's bound without its blank line."""

    def __init__(self, pending: int, limit: int) -> None:
        super().__init__(f"a stream event exceeded {limit} bytes without ending ({pending} so far)")
        self.pending = pending
        self.limit = limit


MAX_EVENT_BYTES = 1 << 20


class SSEFramer:
    """Cuts a byte stream at event boundaries without looking inside events.

    The relay's hot path: each read returns every complete event received so
    far as one bytes region (one `rfind`), ready to be written as is; the
    incomplete tail waits for the next read. Line endings are normalised to
    LF like the parser does, so byte searches on the region can rely on
    `\n` line starts.

    An incomplete event is kept as a list of pieces and joined once, when its
    blank line arrives: linear in its size. One that grows past
    `max_event_bytes` raises `EventTooLarge` (a stream of one endless event
    would otherwise hold memory and reset every idle watchdog forever).
    """

    __slots__ = ("_cr_pending", "_last_nl", "_limit", "_parts", "_pending")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._parts: list[bytes] = []
        self._pending = 0
        self._last_nl = False  # the pending bytes end in "\n"
        self._cr_pending = False
        self._limit = max_event_bytes

    def feed(self, chunk: bytes) -> bytes:
        if self._cr_pending:
            chunk = b"\r" + chunk
            self._cr_pending = False
        if chunk.find(b"\r") >= 0:  # `find`, not `in`: see proxy.openai.chunks
            if chunk.endswith(b"\r"):
                chunk = chunk[:-1]
                self._cr_pending = True
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if not chunk:
            return b""
        parts = self._parts
        if parts:
            if chunk.find(b"\n\n") < 0 and not (self._last_nl and chunk[:1] == b"\n"):
                # Still no end of event: keep the piece, join nothing.
                parts.append(chunk)
                self._pending += len(chunk)
                self._last_nl = chunk[-1:] == b"\n"
                if self._pending > self._limit:
                    raise EventTooLarge(self._pending, self._limit)
                return b""
            parts.append(chunk)
            buf = b"".join(parts)
            parts.clear()
        else:
            buf = chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            rest = buf
            out = b""
        else:
            end += 2
            rest = buf[end:]
            out = buf[:end] if rest else buf
        if rest:
            parts.append(rest)
            self._last_nl = rest[-1:] == b"\n"
            if len(rest) > self._limit:
                self._pending = len(rest)
                raise EventTooLarge(len(rest), self._limit)
        self._pending = len(rest)
        return out

    def flush(self) -> bytes:
        """A final event that lacked its blank line, completed; or b""."""
        rest = b"".join(self._parts).rstrip(b"\n")
        self._parts.clear()
        self._pending = 0
        self._last_nl = False
        self._cr_pending = False
        return rest + b"\n\n" if rest else b""

    @property
    def pending(self) -> int:
        return self._pending


def find_line(region: bytes, prefix: bytes, start: int = 0) -> int:
    """Index of the first line of `region` that starts with `prefix`, or -1.

    JSON payloads cannot contain a raw newline, so a match at a line start is
    a real SSE field, never text inside a token.
    """
    i = region.find(prefix, start)
    while i > 0 and region[i - 1] != 0x0A:
        i = region.find(prefix, i + 1)
    return i


def data_event(payload: bytes) -> bytes:
    """`data: ...` framing for a single-line payload (JSON has no raw newlines)."""
    return b"data: " + payload + b"\n\n"


def json_event(obj: Any) -> bytes:
    return data_event(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())


def error_payload(
    message: str, type_: str, code: str | int | None, param: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object, as vLLM and the OpenAI API shape it."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_events(message: str, type_: str, code: str | int | None) -> bytes:
    """An in-band error event followed by [DONE]: how a stream that already
    sent its 200 reports failure (the OpenAI SDK raises APIError on it)."""
    return json_event(error_payload(message, type_, code)) + DONE_EVENT
