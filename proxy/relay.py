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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import aiohttp
from aiohttp import web

from proxy.errors import error_body
from proxy.sse import DONE_EVENT, HEARTBEAT, Event, SSEParser, error_events

Outcome = Literal[
    "complete",  # [DONE] (or finish_reason then EOF) seen
    "upstream_error",  # the upstream sent an in-band error event
    "truncated",  # upstream closed without finishing
    "idle_timeout",
    "first_byte_timeout",
    "upstream_disconnect",
    "client_disconnect",
]

_FINISH_KEY = b'"finish_reason":'


def has_finish_reason(data: bytes) -> bool:
    """True when a chunk carries a non-null finish_reason (vLLM sends `null` on
    every other chunk, so the key alone is not enough)."""
    i = data.find(_FINISH_KEY)
    if i < 0:
        return False
    j = i + len(_FINISH_KEY)
    while data[j : j + 1] == b" ":
        j += 1
    return data[j : j + 1] == b'"'


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
    parser = SSEParser()
    result = StreamResult("truncated", 200)
    content = upstream.content
    try:
        # ---- until the first event: failures can still be HTTP errors.
        events: list[Event] = []
        try:
            async with asyncio.timeout_at(first_byte_deadline):
                while not events:
                    chunk = await content.readany()
                    if not chunk:
                        break
                    events = parser.feed(chunk)
        except TimeoutError:
            result.outcome = "first_byte_timeout"
            result.detail = "no answer from the backend before the first-byte deadline"
            return await _fail(pump, result, 504, "upstream_timeout")
        if not events:
            events = parser.flush()
            if not events:
                result.outcome = "truncated"
                result.detail = "backend closed the stream before sending anything"
                return await _fail(pump, result, 502, "upstream_truncated")
        result.first_event_at = loop.time()
        first = events[0]
        if first.data is not None and is_error_event(first.data):
            await pump.settle_heartbeat()
            if not client.prepared:
                pump.stop()
                status, body = error_status(first.data)
                result.outcome = "upstream_error"
                result.status = status
                result.detail = "backend sent an error before the answer"
                return _json_response(status, body, headers), result

        # ---- the answer: forward every event as it arrives.
        await pump.settle_heartbeat()
        if not client.prepared:
            await client.prepare(request)
        result.headers_sent_at = loop.time()
        pump.start_idle_watch()
        write = client.write
        saw_finish = False
        done = False
        while True:
            for ev in events:
                d = ev.data
                if d is None:
                    continue
                result.events += 1
                if d == b"[DONE]":
                    done = True
                    break
                if not saw_finish and has_finish_reason(d):
                    saw_finish = True
                elif d[:2] == b'{"' and is_error_event(d):
                    result.outcome = "upstream_error"
            if len(events) == 1:
                await write(events[0].raw)
            else:
                await write(b"".join(ev.raw for ev in events))
            if done:
                if result.outcome != "upstream_error":
                    result.outcome = "complete"
                return client, result
            try:
                chunk = await content.readany()
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                if pump.timed_out:
                    result.outcome = "idle_timeout"
                    result.detail = f"backend silent for {idle_s:g}s mid-answer"
                    await write(error_events(result.detail, "server_error", "upstream_timeout"))
                else:
                    result.outcome = "upstream_disconnect"
                    result.detail = f"backend connection lost mid-answer ({type(exc).__name__})"
                    await write(error_events(result.detail, "server_error", "upstream_disconnect"))
                return client, result
            if not chunk:
                events = parser.flush()
                if events:
                    continue  # a final event without its blank line
                break
            pump.last_activity = loop.time()
            events = parser.feed(chunk)
        # EOF without [DONE].
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
        return client, result
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        result.outcome = "client_disconnect"
        return client, result
    finally:
        pump.stop()


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
