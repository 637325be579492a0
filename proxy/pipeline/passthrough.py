"""The relay of pass-through answers (`/v1/models`, `/v1/embeddings`,
`/v1/responses`, ...): the body as the backend sent it, streamed.

Their formats are not the proxy's business, so the guard only looks at SSE
streams of chat/completion chunks (see `relay_events`); everything else is
passed on byte for byte. A redirect is never followed: a same-origin one is
passed on with a relative `Location` (so the client's next request comes
through the proxy, and its protections, again); any other is a 502.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from aiohttp import web
from yarl import URL

from proxy.backends.upstream import Upstream
from proxy.openai.chunks import is_chunk_stream
from proxy.openai.errors import upstream_error_body
from proxy.pipeline.call import failed
from proxy.pipeline.record import AttemptResult, RequestRecord
from proxy.pipeline.relay import PASSTHROUGH_HEADERS, RETRYABLE_STATUS, relay_events, shed_fault

# An error body read to pass it on is at most this long (an error, not an answer).
_ERROR_BODY_MAX = 64 * 1024


def relative_location(up: Upstream, location: str) -> str | None:
    """`location` as a path on the proxy, or None when it leaves the backend."""
    target = URL(location)
    if target.is_absolute():
        base = up.base
        if (target.scheme, target.host, target.port) != (base.scheme, base.host, base.port):
            return None
    path = target.raw_path
    if not path.startswith("/"):
        return None
    return path + (f"?{target.raw_query_string}" if target.raw_query_string else "")


async def relay_passthrough(
    rec: RequestRecord,
    up: Upstream,
    resp: aiohttp.ClientResponse,
    deadline: float,
    t_call: float,
    *,
    sse: bool,
) -> AttemptResult:
    idle_s = up.policy.timeouts.idle_s
    status = resp.status
    first = b""
    if sse:
        # The first bytes tell the format: chat/completion chunks get the
        # pump and the guard; any other stream is relayed byte for byte.
        try:
            async with asyncio.timeout_at(deadline):
                first = await resp.content.readany()
        except TimeoutError:
            return failed(
                up,
                504,
                "backend did not answer before the deadline",
                "upstream_timeout",
                "first_byte_timeout",
            )
        except aiohttp.ClientError as exc:
            name = type(exc).__name__
            return failed(
                up, 502, f"backend answer could not be read: {name}", "upstream_error", "body", name
            )
        if is_chunk_stream(first):
            return await relay_events(rec, up, resp, deadline, t_call, keep=False, prefix=first)
    if status in RETRYABLE_STATUS:
        try:
            async with asyncio.timeout(idle_s):
                body = await resp.content.read(_ERROR_BODY_MAX)
        except (TimeoutError, aiohttp.ClientError):
            body = b""
        return AttemptResult(
            "failed",
            up.name,
            status,
            "error",
            fault=shed_fault(status, resp.headers),
            body=upstream_error_body(status, body),
        )
    headers = rec.headers(up.name)
    for k in PASSTHROUGH_HEADERS:
        if k in resp.headers:
            headers[k] = resp.headers[k]
    if 300 <= status < 400:
        where = relative_location(up, resp.headers.get("Location", ""))
        if where is None:
            return failed(
                up,
                502,
                f"backend answered {status} with a redirect elsewhere (not followed)",
                "upstream_redirect",
                "",
            )
        headers["Location"] = where
    out = rec.client = web.StreamResponse(status=status, headers=headers)
    if resp.content_length is not None:
        out.content_length = resp.content_length
    t_upstream = rec.loop.time()
    await out.prepare(rec.request)
    first_byte = rec.loop.time()
    content = resp.content
    try:
        if first:
            await out.write(first)
        while True:
            async with asyncio.timeout(idle_s):
                chunk = await content.readany()
            if not chunk:
                break
            await out.write(chunk)
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        return AttemptResult(
            "client_gone", up.name, status, "client_disconnect", response=out, delivered=True
        )
    except (TimeoutError, aiohttp.ClientError) as exc:
        # The status line is out: cut the connection so the client cannot
        # take a partial body for a whole one.
        transport = rec.request.transport
        if transport is not None:
            with contextlib.suppress(Exception):
                transport.close()
        return AttemptResult(
            "ended",
            up.name,
            status,
            "upstream_disconnect",
            detail=f"backend body cut off ({type(exc).__name__})",
            response=out,
            delivered=True,
            fault="body",
        )
    return AttemptResult(
        "answered",
        up.name,
        status,
        "complete",
        response=out,
        delivered=True,
        healthy=True,
        client_ttft=first_byte - rec.t0,
        overhead=rec.overhead_pre + (first_byte - t_upstream),
    )
