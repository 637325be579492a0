"""A rescue's continuation, read until its seam is decided (`proxy.openai.seam`).

Only the rescue path pays: the continuation's first events are held back
(heartbeat comments keep the client's connection meanwhile) until `align`
decides, at most the sent text's length plus `MARGIN_CHARS` characters; then
the held events, with the repeated text stripped, become the `prefix` the
pump relays first, and the rest of the stream is relayed as it comes, byte
for byte. The same deadlines hold as in the pump: the first event by the
first-byte deadline, then at most `idle_s` of silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from proxy.openai.chunks import has_finish_reason, is_error_event
from proxy.openai.seam import MARGIN_CHARS, Seam, Sent, align, event_text, strip_events
from proxy.openai.sse import DONE, HEARTBEAT
from proxy.pipeline.pump import Outcome, StreamResult


@dataclass(slots=True)
class SeamRead:
    seam: Seam
    prefix: bytes = b""  # what the pump relays first (held events, aligned, + any partial event)
    first_byte_deadline: float = 0.0  # for the pump: by when its first read must come
    failure: StreamResult | None = None  # the continuation failed (or the client left) first


class _Frames:
    """Whole events (LF line ends) and the incomplete rest, as the pump's framer cuts them."""

    __slots__ = ("cr", "tail")

    def __init__(self) -> None:
        self.tail = b""
        self.cr = False

    def feed(self, chunk: bytes) -> bytes:
        if self.cr:
            chunk = b"\r" + chunk
            self.cr = False
        if b"\r" in chunk:
            if chunk.endswith(b"\r"):
                chunk = chunk[:-1]
                self.cr = True
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf = self.tail + chunk
        end = buf.rfind(b"\n\n")
        if end < 0:
            self.tail = buf
            return b""
        self.tail = buf[end + 2 :]
        return buf[: end + 2]

    def rest(self) -> bytes:
        return self.tail + (b"\r" if self.cr else b"")


async def read_seam(
    resp: aiohttp.ClientResponse,
    client: web.StreamResponse,
    sent: Sent,
    *,
    endpoint: str,
    restart_only: bool,
    first_byte_deadline: float,
    idle_s: float,
    heartbeat_s: float,
    max_event_bytes: int,
) -> SeamRead:
    loop = asyncio.get_running_loop()
    content = resp.content
    frames = _Frames()
    held: list[bytes] = []
    texts: list[str] = []
    chars = 0
    check_at = 1  # align again once this many characters are held (geometric: O(n) in all)
    limit = sent.raw_len + MARGIN_CHARS
    deadline = first_byte_deadline
    beat = heartbeat_s if heartbeat_s > 0 else math.inf
    next_beat = loop.time() + beat
    got_event = False
    ended = False
    seam = align(sent, "", ended=False, restart_only=restart_only)
    reading: asyncio.Future[bytes] | None = None

    def failure(outcome: Outcome, detail: str, code: str) -> SeamRead:
        now = loop.time()
        sr = StreamResult(outcome, 200, client=client, detail=detail, code=code)
        sr.headers_sent_at = now
        sr.first_event_at = now if got_event else None
        return SeamRead(seam, failure=sr)

    try:
        while not seam.decided:
            if reading is None:
                reading = asyncio.ensure_future(content.readany())
            done, _ = await asyncio.wait(
                {reading}, timeout=max(0.0, min(deadline, next_beat) - loop.time())
            )
            if not done:
                if loop.time() >= deadline:
                    if got_event:
                        return failure(
                            "idle_timeout",
                            f"backend silent for {idle_s:g}s mid-answer",
                            "upstream_timeout",
                        )
                    return failure(
                        "first_byte_timeout",
                        "no answer from the backend before the first-byte deadline",
                        "upstream_timeout",
                    )
                try:
                    await client.write(HEARTBEAT)
                except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                    return failure("client_disconnect", "", "")
                next_beat = loop.time() + beat
                continue
            try:
                chunk = reading.result()
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                return failure(
                    "upstream_disconnect",
                    f"backend connection lost mid-answer ({type(exc).__name__})",
                    "upstream_disconnect",
                )
            reading = None
            if not chunk:
                ended = True  # what is held is all there is; the pump sees the end
            else:
                now = loop.time()
                deadline = now + idle_s
                next_beat = now + beat
                region = frames.feed(chunk)
                if region:
                    got_event = True
                    held.append(region)
                    for ev in region.split(b"\n\n"):
                        data = _data(ev)
                        if data is None:
                            continue
                        if data == DONE or is_error_event(data) or has_finish_reason(data):
                            ended = True
                        text = event_text(data, endpoint)[1]
                        if text:
                            texts.append(text)
                            chars += len(text)
                if len(frames.tail) > max_event_bytes:
                    ended = True  # the pump ends it (event_too_large)
            if ended or chars > limit or chars >= check_at:
                check_at = chars + max(1, chars // 8)
                seam = align(
                    sent, "".join(texts), ended=ended or chars > limit, restart_only=restart_only
                )
    finally:
        if reading is not None and not reading.done():
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await reading
    prefix = strip_events(b"".join(held), seam.strip, endpoint) + frames.rest()
    fbd = max(first_byte_deadline, loop.time() + idle_s) if got_event else first_byte_deadline
    return SeamRead(seam, prefix, fbd)


def _data(ev: bytes) -> bytes | None:
    """The data of one event block (no blank line), single `data:` line shape."""
    if not ev.startswith(b"data:") or b"\n" in ev:
        return None
    value = ev[5:]
    return value[1:] if value[:1] == b" " else value
