"""`GET /brownout/recording?since=&until=`: a window of the flight recording
as JSON lines (admin token, checked by the ingress middleware).

`since` and `until` are Unix seconds, ISO 8601 (`2026-01-01T00:00:00Z`) or
relative to now (`-15m`, `-2h`); the defaults are the last 15 minutes up to
now. The window is preceded by the policy in force at its start, so the
download replays on its own (`brownout replay --trace window.jsonl`). Files
are read off the event loop, a chunk at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

from aiohttp import web

from proxy.errors import error_response
from proxy.runtime.keys import STATE
from proxy.telemetry.recording import parse_when, window

CHUNK_BYTES = 256 << 10
DEFAULT_SINCE = "-15m"


def _chunk(lines: Iterator[bytes]) -> bytes:
    """The next ≈ CHUNK_BYTES of `lines` (b"" at the end): run in a thread."""
    out: list[bytes] = []
    size = 0
    for line in lines:
        out.append(line)
        size += len(line)
        if size >= CHUNK_BYTES:
            break
    return b"".join(out)


async def recording(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    pol = state.current.policy.recorder
    if not pol.enabled:
        return error_response(
            409,
            "the flight recorder is off: set recorder.enabled in the policy",
            code="recorder_disabled",
        )
    now = time.time()
    try:
        since = parse_when(request.query.get("since", DEFAULT_SINCE), now)
        until = parse_when(request.query.get("until", "-0s"), now)
    except ValueError:
        return error_response(
            400,
            "since and until are Unix seconds, ISO 8601 or relative (-15m, -2h)",
            code="invalid_window",
            param="since",
        )
    if until < since:
        return error_response(400, "until is before since", code="invalid_window", param="until")
    lines = window(Path(pol.dir), since, until)
    resp = web.StreamResponse(
        headers={
            "Content-Type": "application/x-ndjson",
            "Content-Disposition": f'attachment; filename="brownout-{int(since)}-{int(until)}'
            '.jsonl"',
            "Cache-Control": "no-store",
        }
    )
    if "gzip" in request.headers.get("Accept-Encoding", ""):
        resp.enable_compression()
    await resp.prepare(request)
    while chunk := await asyncio.to_thread(_chunk, lines):
        await resp.write(chunk)
    await resp.write_eof()
    return resp
