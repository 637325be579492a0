"""Reading a request body: within its size limit and its deadline, in a
coding the proxy can undo — or a 4xx that says which limit it broke."""

from __future__ import annotations

import asyncio

from aiohttp import web

from proxy.errors import RequestRejected
from proxy.ingress.context import BODY_ABANDONED
from proxy.ingress.headers import body_coding


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The body as the backend will get it (a `Content-Encoding` undone).

    The size limit applies to the decoded bytes (aiohttp counts what it
    inflates), so a small gzip bomb is a 413 too."""
    coding = request.headers.get("Content-Encoding")
    if body_coding(coding) == "unsupported":
        raise RequestRejected(
            415,
            f"Content-Encoding {coding!r} is not supported (use gzip, deflate or none)",
            "unsupported_content_encoding",
            "Content-Encoding",
        )
    if request.content_length is not None and request.content_length > limit:
        raise RequestRejected(
            413,
            f"request body of {request.content_length} bytes exceeds the {limit}-byte limit",
            "request_too_large",
        )
    if not request.can_read_body:
        return b""
    try:
        if request.content.is_eof():
            # All of it is already here (a small body arrives with its head):
            # nothing to wait for, so no deadline to arm and cancel.
            return await request.read()
        # A client trickling its body (slow-loris) does not hold a handler forever.
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestRejected(
            413, f"request body exceeds the {limit}-byte limit", "request_too_large"
        ) from None
    except asyncio.CancelledError:
        # The connection closed mid-body (aiohttp cancels the handler).
        request[BODY_ABANDONED] = True
        raise
    except TimeoutError:
        raise RequestRejected(
            408, f"request body not received within {timeout_s:g} s", "request_timeout"
        ) from None
    except web.RequestPayloadError:
        # A corrupt gzip/deflate stream, or a broken chunked encoding.
        how = f"decoded (Content-Encoding {coding!r})" if coding else "read"
        raise RequestRejected(400, f"request body could not be {how}", "invalid_body") from None
