"""The streaming pump: upstream SSE events → client, as they arrive.

Per request, not per chunk: the idle watchdog and the heartbeat are timer
callbacks that re-arm themselves only when they fire
(`proxy.pipeline.streamtimers`), so a chunk costs a read, a parse (one
`find` in the common case), a few byte checks and a write.

Token telemetry rides along at a few operations per region, no JSON: the
usage chunk is recognised by one byte test (`proxy.openai.usage`),
decoded once, and removed when Brownout asked for it on its own behalf; the
time between content events goes to `brownout_inter_token_seconds` as one
bucket increment per region (a region of k events that arrived g seconds
after the previous one counts k gaps of g/k).

Until the first event arrives the client has not seen a status line yet, so a
failure there (an error event, a timeout) can still become a proper HTTP
error. If the upstream is slow to start (long prefill), headers and an SSE
comment heartbeat go out after `heartbeat_s` so that nginx and load balancers
keep the connection; from then on failures are reported in-band:
`data: {"error": ...}` then `data: [DONE]`, never a silent truncation.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import aiohttp
from aiohttp import web

from proxy.guard.stream import StreamGuard
from proxy.guard.verdicts import Trip
from proxy.openai.chunkrun import ChunkRuns, Run
from proxy.openai.chunks import error_status, is_error_event, markers
from proxy.openai.errors import error_body
from proxy.openai.headers import STREAM_ONLY
from proxy.openai.sse import (
    DONE_EVENT,
    MAX_EVENT_BYTES,
    EventTooLarge,
    SSEFramer,
    error_events,
    error_payload,
    json_event,
)
from proxy.openai.usage import Usage, find_usage
from proxy.pipeline.streamtimers import Pump
from proxy.telemetry.metrics import Buckets

Outcome = Literal[
    "complete",  # [DONE] (or finish_reason then EOF) seen
    "guard_trip",  # the output guard stopped invalid output
    "upstream_error",  # the upstream sent an in-band error event
    "truncated",  # upstream closed without finishing
    "idle_timeout",
    "first_byte_timeout",
    "upstream_disconnect",
    "client_disconnect",
    "event_too_large",  # an event outgrew server.max_event_bytes
]


class EventStream(web.StreamResponse):
    """The client's event stream, its head held back until the first write:
    the status line and headers leave in the same `send()` as the first
    region (a 16-chunk answer in one), not in one of their own. (aiohttp's
    `web.Response` does the same; its `StreamResponse` sends the head when
    prepared. Without the attribute, an older aiohttp sends it then.) The
    pump writes the head alone (`write(b"")`) wherever it would otherwise
    wait or return with nothing written after preparing it."""

    _send_headers_immediately = False


@dataclass(slots=True)
class StreamResult:
    outcome: Outcome
    status: int  # HTTP status the client saw (or will see)
    client: web.StreamResponse | None = None
    # Set when the client has seen nothing yet: the error answer to send (or
    # to drop, when the caller retries the request elsewhere).
    response: web.Response | None = None
    events: int = 0
    headers_sent_at: float | None = None  # loop time of the client's first byte
    first_event_at: float | None = None  # loop time of the upstream's first event
    detail: str = ""
    code: str = ""  # error code for an in-band error event
    error_event: bytes = b""  # the upstream's own error event, when it sent one
    regions: list[bytes] | None = None  # what was forwarded, when asked to keep it
    # Per kept region, its run of text chunks (`proxy.openai.chunkrun`) when it
    # had one: the answer's text is then read from the run's literals, not
    # searched for again in its bytes (`proxy.openai.partial`).
    runs: list[Run | None] | None = None
    trip: Trip | None = None  # why the guard stopped the stream
    kept_overflow: bool = False  # more than keep_limit bytes: regions were let go
    usage: Usage | None = None  # the backend's usage chunk, when it sent one
    last_event_at: float | None = None  # loop time of the last events (a complete answer)

    @property
    def started(self) -> bool:
        return self.headers_sent_at is not None


async def relay_stream(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    headers: Mapping[str, str],
    *,
    heartbeat_s: float,
    first_byte_deadline: float,
    idle_s: float,
    client: web.StreamResponse | None = None,
    keep: bool = False,
    guard: StreamGuard | None = None,
    end_response: bool = True,
    max_event_bytes: int = MAX_EVENT_BYTES,
    keep_limit: int = 1 << 62,
    prefix: bytes = b"",
    strip_usage: bool = False,
    itl: Buckets | None = None,
) -> StreamResult:
    """Relay an upstream SSE answer; the caller owns (and closes) `upstream`.

    `first_byte_deadline` is a loop time by which the first event must arrive.
    Pass `client` to continue an answer already under way (a rescue).

    When the answer fails after the client has seen bytes, nothing terminal
    is written here: the result says what happened (`outcome`, `code`,
    `error_event`) and the caller either rescues the stream or ends it with
    `end_with_error`. With `keep`, the forwarded regions are kept, so the
    partial answer can be recovered without decoding every chunk on the way.
    With `end_response`, a complete answer also ends the HTTP response (one
    send); without it the caller still has work before the client may see
    the end (a session save: the next turn must find this one).
    At most `keep_limit` bytes are kept (then `kept_overflow`, nothing kept);
    an event over `max_event_bytes` ends the stream (`event_too_large`).
    `prefix`: bytes of the stream the caller already read (to learn its format).
    The backend's usage chunk, when it sends one, is read into `usage`; with
    `strip_usage` (Brownout asked for it, the client did not) it is not
    forwarded. `itl` gets the time between the answer's events.
    """
    if client is None:
        client = EventStream(status=200, headers=headers)
    pump = Pump(request, upstream, client, heartbeat_s, idle_s, first_byte_deadline)
    loop = pump.loop
    framer = SSEFramer(max_event_bytes)
    runs = ChunkRuns()
    result = StreamResult("truncated", 200, client=client)
    if keep:
        result.regions = []
        result.runs = []
    kept = result.regions
    kept_runs = result.runs
    kept_bytes = 0
    content = upstream.content
    # Inter-token latency, inline (a method call per region would cost more
    # than the bucket increment itself); its sum is added once, at the end.
    itl_counts, itl_bounds = (itl.counts, itl.bounds) if itl is not None else ([], ())
    itl_sum = 0.0
    try:
        # ---- until the first event: failures can still be HTTP errors.
        region = b""
        try:
            if prefix:
                region = framer.feed(prefix)
            # Past the first-byte deadline the pump's timer closes the
            # upstream, which ends this read with an error (`pump.expired`).
            while not region:
                chunk = await content.readany()
                if not chunk:
                    break
                region = framer.feed(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            if pump.expired:
                result.outcome = "first_byte_timeout"
                result.detail = "no answer from the backend before the first-byte deadline"
                return await _fail(pump, result, 504, "upstream_timeout")
            # Nothing reached the client yet: an HTTP error the caller may retry.
            result.outcome = "upstream_disconnect"
            result.detail = f"backend connection lost before the answer ({type(exc).__name__})"
            return await _fail(pump, result, 502, "upstream_disconnect")
        except EventTooLarge as exc:
            result.outcome = "event_too_large"
            result.detail = f"backend stream: {exc}"
            return await _fail(pump, result, 502, "upstream_event_too_large")
        pump.first_event()  # or the end of the stream: the deadline is over
        if not region:
            region = framer.flush()
            if not region:
                result.outcome = "truncated"
                result.detail = "backend closed the stream before sending anything"
                return await _fail(pump, result, 502, "upstream_truncated")
        result.first_event_at = pump.last_activity = loop.time()
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
                    result.error_event = region[: region.find(b"\n\n") + 2]
                    result.response = _json_response(status, body, headers)
                    return result

        # ---- the answer: forward every complete event as soon as it is here.
        await pump.settle_heartbeat()
        head = False  # prepared here: the head waits for the first write
        if not client.prepared:
            await client.prepare(request)
            head = True
        result.headers_sent_at = loop.time()
        pump.start_idle_watch()
        write = client.write
        saw_finish = False
        final = False
        last_at = result.first_event_at  # the previous region's arrival (ITL)
        while True:
            in_usage = 0  # the usage chunk is one of this region's events
            # A usage chunk ends "}}\n\n", a region with [DONE] "E]\n\n": one
            # byte read per region (`find_usage` then checks for real).
            try:
                tail = region[-4]
            except IndexError:
                tail = 0
            if tail == 125 or tail == 69:
                found = find_usage(region)
                if found is not None:
                    start, end, result.usage = found
                    if strip_usage:
                        # One copy: a slice and then a concatenation would
                        # copy a burst twice, in two blocks of its size (a
                        # 1,024-chunk one: 134 -> 4 us in a loop, dev box).
                        view = memoryview(region)
                        region = b"".join((view[:start], view[end:]))
                    else:
                        in_usage = 1
            run = runs.cut(region) if not final and region else None
            if guard is not None and region:
                verdict = guard.feed_final(region) if final else guard.feed(region, run)
                if verdict is not region:
                    if isinstance(verdict, Trip):
                        # Nothing of the offending event reaches the client.
                        if verdict.prefix:
                            await write(verdict.prefix)
                            if kept is not None and kept_runs is not None:
                                kept.append(verdict.prefix)
                                kept_runs.append(None)
                        elif head:
                            await write(b"")  # the head, before the caller's ending
                        result.outcome = "guard_trip"
                        result.trip = verdict
                        result.code = "invalid_output"
                        result.detail = verdict.message
                        result.error_event = json_event(
                            error_payload(verdict.message, "server_error", "invalid_output")
                        )
                        return result
                    region = verdict  # malformed events dropped
                    run = None
            # Byte searches, not JSON: a region holds whole events with LF
            # line ends, and these markers can only match at a line start. A
            # run of plain text chunks holds none of them: only the events
            # around it are searched.
            events, err_at, finished, done_at = markers(region, run)
            result.events += events
            if itl is not None:
                now = pump.last_activity
                # Content events only: not [DONE], not the usage chunk; k of
                # them g seconds after the previous read: k gaps of g/k.
                n = events - in_usage - (done_at >= 0)
                if n > 0 and now > last_at:
                    gap = now - last_at
                    itl_counts[bisect_left(itl_bounds, gap / n)] += n
                    itl_sum += gap
                last_at = now
            if err_at >= 0:
                # Forward what came before the error; the caller decides how
                # the answer ends (rescue, or this error and [DONE]).
                end = region.find(b"\n\n", err_at) + 2
                result.error_event = region[err_at:end]
                result.outcome = "upstream_error"
                result.detail = "backend reported an error mid-answer"
                result.code = "upstream_error"
                if err_at:
                    await write(region[:err_at])
                    if kept is not None and kept_runs is not None:
                        kept.append(region[:err_at])
                        kept_runs.append(run if run is not None and run.end <= err_at else None)
                elif head:
                    await write(b"")  # the head, before the caller's ending
                return result
            if finished:
                saw_finish = True
            if done_at >= 0:
                end = region.find(b"\n\n", done_at) + 2
                if end < len(region):
                    region = region[:end]
                if end_response:
                    # The last chunk and the chunked-encoding terminator in one send.
                    await client.write_eof(region)
                else:
                    await write(region)
                if kept is not None and kept_runs is not None:
                    kept.append(region)
                    kept_runs.append(run if run is not None and run.end <= end else None)
                result.outcome = "complete"
                result.last_event_at = pump.last_activity
                return result
            if region:  # the guard may have dropped every event of it
                await write(region)
                if kept is not None and kept_runs is not None:
                    kept.append(region)
                    kept_runs.append(run)
                    kept_bytes += len(region)
                    if kept_bytes > keep_limit:
                        kept.clear()
                        kept = result.regions = None
                        kept_runs = result.runs = None
                        result.kept_overflow = True
            elif head:
                await write(b"")  # the head, before waiting for the next read
            head = False
            region = b""
            while not region:
                try:
                    chunk = await content.readany()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                    if pump.timed_out:
                        result.outcome = "idle_timeout"
                        result.detail = f"backend silent for {idle_s:g}s mid-answer"
                        result.code = "upstream_timeout"
                    else:
                        result.outcome = "upstream_disconnect"
                        result.detail = f"backend connection lost mid-answer ({type(exc).__name__})"
                        result.code = "upstream_disconnect"
                    return result
                if not chunk:
                    region = framer.flush()
                    if region:
                        final = True
                        break  # a final event without its blank line
                    if saw_finish:
                        # The answer finished; only the terminator was missing.
                        await write(DONE_EVENT)
                        result.outcome = "complete"
                        result.last_event_at = pump.last_activity
                    else:
                        result.outcome = "truncated"
                        result.detail = "backend closed the stream before the answer finished"
                        result.code = "upstream_truncated"
                    return result
                pump.last_activity = loop.time()
                try:
                    region = framer.feed(chunk)
                except EventTooLarge as exc:
                    result.outcome = "event_too_large"
                    result.detail = f"backend stream: {exc}"
                    result.code = "upstream_event_too_large"
                    return result
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        result.outcome = "client_disconnect"
        return result
    finally:
        pump.stop()
        if itl is not None:
            itl.sum += itl_sum


async def end_with_error(result: StreamResult) -> None:
    """End a started stream that failed: the upstream's own error event when it
    sent one, else ours; then [DONE]. Never a silent truncation."""
    client = result.client
    if client is None:
        return
    with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionResetError):
        if result.error_event:
            await client.write(result.error_event + DONE_EVENT)
        else:
            await client.write(error_events(result.detail, "server_error", result.code))


async def _fail(pump: Pump, result: StreamResult, status: int, code: str) -> StreamResult:
    """A stream that produced no answer: an HTTP error if the client has not
    seen a status line yet (heartbeats may have gone out), in-band otherwise."""
    await pump.settle_heartbeat()
    pump.stop()
    result.code = code
    if pump.client.prepared:
        result.headers_sent_at = pump.loop.time()
        return result
    result.status = status
    body = error_body(result.detail, "server_error", code)
    result.response = _json_response(status, body, pump.client.headers)
    return result


def _json_response(status: int, body: bytes, headers: Mapping[str, str]) -> web.Response:
    h = {k: v for k, v in headers.items() if k.lower() not in STREAM_ONLY}
    h["Content-Type"] = "application/json"
    return web.Response(status=status, body=body, headers=h)
