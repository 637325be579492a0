"""The streaming pump: upstream SSE events → client, as they arrive.

Per request, not per chunk: the idle watchdog and the heartbeat are timer
callbacks that re-arm themselves only when they fire, so a chunk costs a
read, a parse (one `find` in the common case), a few byte checks and a write.

Until the first event arrives the client has not seen a status line yet, so a
failure there (an error event, a timeout) can still become a proper HTTP
error. If the upstream is slow to start (long prefill), headers and an SSE
comment heartbeat go out after `heartbeat_s` so that nginx and load balancers
keep the connection; from then on failures are reported in-band:
`data: {"error": ...}` then `data: [DONE]`, never a silent truncation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import aiohttp
from aiohttp import web

from proxy.errors import error_body
from proxy.sse import DONE_EVENT, HEARTBEAT, SSEFramer, error_events, find_line

Outcome = Literal[
    "complete",  # [DONE] (or finish_reason then EOF) seen
    "upstream_error",  # the upstream sent an in-band error event
    "truncated",  # upstream closed without finishing
    "idle_timeout",
    "first_byte_timeout",
    "upstream_disconnect",
    "client_disconnect",
]


def has_finish_reason(data: bytes) -> bool:
    """True when a chunk carries a non-null finish_reason (vLLM sends `null` on
    every other chunk, so the key alone is not enough). Inside a JSON string
    the quotes would be escaped, so token text cannot match."""
    return b'"finish_reason":"' in data or b'"finish_reason": "' in data


def is_error_event(data: bytes) -> bool:
    return data[:12].replace(b" ", b"").startswith(b'{"error"')


def error_status(data: bytes) -> tuple[int, bytes]:
    """HTTP status and JSON body for an error event that arrived before any
    answer bytes: the event's own `code` when it is an HTTP status."""
    try:
        obj = json.loads(data)
        code = obj["error"].get("code")
    except (ValueError, KeyError, AttributeError, TypeError):
        return 502, error_body("upstream sent a malformed error event", "server_error", 502)
    status = code if isinstance(code, int) and 400 <= code <= 599 else 502
    return status, data


@dataclass(slots=True)
class StreamResult:
    outcome: Outcome
    status: int  # HTTP status the client saw
    events: int = 0
    headers_sent_at: float | None = None  # loop time of the client's first byte
    first_event_at: float | None = None  # loop time of the upstream's first event
    detail: str = ""


class _Pump:
    """State of one relayed stream, shared by the read loop and its timers."""

    __slots__ = (
        "_hb_handle",
        "_hb_task",
        "_idle_handle",
        "client",
        "first_event",
        "heartbeat_s",
        "idle_s",
        "last_activity",
        "loop",
        "request",
        "timed_out",
        "upstream",
    )

    def __init__(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        client: web.StreamResponse,
        heartbeat_s: float,
        idle_s: float,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.request = request
        self.upstream = upstream
        self.client = client
        self.heartbeat_s = heartbeat_s
        self.idle_s = idle_s
        self.last_activity = self.loop.time()
        self.first_event = False
        self.timed_out = False
        self._hb_task: asyncio.Task[None] | None = None
        self._hb_handle = self.loop.call_later(heartbeat_s, self._on_heartbeat)
        self._idle_handle: asyncio.TimerHandle | None = None

    # -- timers ------------------------------------------------------------------

    def start_idle_watch(self) -> None:
        self._idle_handle = self.loop.call_later(self.idle_s, self._on_idle)

    def _on_idle(self) -> None:
        due = self.last_activity + self.idle_s
        if self.loop.time() >= due:
            self.timed_out = True
            # Closing the response wakes the reader with an error right away.
            self.upstream.close()
        else:
            self._idle_handle = self.loop.call_at(due, self._on_idle)

    def _on_heartbeat(self) -> None:
        due = self.last_activity + self.heartbeat_s
        now = self.loop.time()
        if now >= due and (self._hb_task is None or self._hb_task.done()):
            self._hb_task = self.loop.create_task(self._send_heartbeat())
            due = now + self.heartbeat_s
        self._hb_handle = self.loop.call_at(due, self._on_heartbeat)

    async def _send_heartbeat(self) -> None:
        with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError):
            if not self.client.prepared:
                await self.client.prepare(self.request)
            await self.client.write(HEARTBEAT)

    async def settle_heartbeat(self) -> None:
        """Wait for a heartbeat write in progress, so writes never overlap."""
        task = self._hb_task
        if task is not None and not task.done():
            await task

    def stop(self) -> None:
        self._hb_handle.cancel()
        if self._idle_handle is not None:
            self._idle_handle.cancel()
        if self._hb_task is not None and not self._hb_task.done():
            self._hb_task.cancel()


async def relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    headers: Mapping[str, str],
    *,
    heartbeat_s: float,
    first_byte_deadline: float,
    idle_s: float,
) -> tuple[web.StreamResponse, StreamResult]:
    """Relay an upstream SSE answer; the caller owns (and closes) `upstream`.

    `first_byte_deadline` is a loop time by which the first event must arrive.
    """
    client = web.StreamResponse(status=200, headers=headers)
    pump = _Pump(request, upstream, client, heartbeat_s, idle_s)
    loop = pump.loop
    framer = SSEFramer()
    result = StreamResult("truncated", 200)
    content = upstream.content
    try:
        # ---- until the first event: failures can still be HTTP errors.
        region = b""
        try:
            async with asyncio.timeout_at(first_byte_deadline):
                while not region:
                    chunk = await content.readany()
                    if not chunk:
                        break
                    region = framer.feed(chunk)
        except TimeoutError:
            result.outcome = "first_byte_timeout"
            result.detail = "no answer from the backend before the first-byte deadline"
            return await _fail(pump, result, 504, "upstream_timeout")
        if not region:
            region = framer.flush()
            if not region:
                result.outcome = "truncated"
                result.detail = "backend closed the stream before sending anything"
                return await _fail(pump, result, 502, "upstream_truncated")
        result.first_event_at = loop.time()
        if region.startswith(b"data:"):
            first = region[5 : region.find(b"\n")].strip()
            if is_error_event(first):
                await pump.settle_heartbeat()
                if not client.prepared:
                    pump.stop()
                    status, body = error_status(first)
                    result.outcome = "upstream_error"
                    result.status = status
                    result.detail = "backend sent an error before the answer"
                    return _json_response(status, body, headers), result

        # ---- the answer: forward every complete event as soon as it is here.
        await pump.settle_heartbeat()
        if not client.prepared:
            await client.prepare(request)
        result.headers_sent_at = loop.time()
        pump.start_idle_watch()
        write = client.write
        saw_finish = False
        while True:
            # Byte searches, not JSON: a region holds whole events with LF
            # line ends, and these markers can only match at a line start.
            result.events += region.count(b"\n\n")
            if find_line(region, b'data: {"error"') >= 0:
                result.outcome = "upstream_error"
            if not saw_finish and has_finish_reason(region):
                saw_finish = True
            done_at = find_line(region, b"data: [DONE]")
            if done_at >= 0:
                end = region.find(b"\n\n", done_at) + 2
                await write(region[:end] if end < len(region) else region)
                if result.outcome != "upstream_error":
                    result.outcome = "complete"
                return client, result
            await write(region)
            region = b""
            while not region:
                try:
                    chunk = await content.readany()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                    if pump.timed_out:
                        result.outcome = "idle_timeout"
                        result.detail = f"backend silent for {idle_s:g}s mid-answer"
                        code = "upstream_timeout"
                    else:
                        result.outcome = "upstream_disconnect"
                        result.detail = f"backend connection lost mid-answer ({type(exc).__name__})"
                        code = "upstream_disconnect"
                    await write(error_events(result.detail, "server_error", code))
                    return client, result
                if not chunk:
                    region = framer.flush()
                    if region:
                        break  # a final event without its blank line
                    return client, await _finish_eof(write, result, saw_finish)
                pump.last_activity = loop.time()
                region = framer.feed(chunk)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        result.outcome = "client_disconnect"
        return client, result
    finally:
        pump.stop()


async def _finish_eof(
    write: Callable[[bytes], Awaitable[None]], result: StreamResult, saw_finish: bool
) -> StreamResult:
    """The upstream closed without [DONE]: say how the answer ended."""
    if result.outcome == "upstream_error":
        await write(DONE_EVENT)
    elif saw_finish:
        # The answer finished; only the terminator was missing.
        result.outcome = "complete"
        await write(DONE_EVENT)
    else:
        result.outcome = "truncated"
        result.detail = "backend closed the stream before the answer finished"
        await write(error_events(result.detail, "server_error", "upstream_truncated"))
    return result


async def _fail(
    pump: _Pump, result: StreamResult, status: int, code: str
) -> tuple[web.StreamResponse, StreamResult]:
    """End a stream that produced no answer: an HTTP error if the client has
    not seen a status line yet, an in-band error event otherwise."""
    await pump.settle_heartbeat()
    pump.stop()
    if pump.client.prepared:
        await pump.client.write(error_events(result.detail, "server_error", code))
        return pump.client, result
    result.status = status
    body = error_body(result.detail, "server_error", code)
    return _json_response(status, body, pump.client.headers), result


def _json_response(status: int, body: bytes, headers: Mapping[str, str]) -> web.Response:
    h = {k: v for k, v in headers.items() if k.lower() not in _STREAM_ONLY}
    h["Content-Type"] = "application/json"
    return web.Response(status=status, body=body, headers=h)


_STREAM_ONLY = frozenset({"content-type", "cache-control", "x-accel-buffering"})
