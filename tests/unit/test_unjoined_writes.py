"""Chunked writes on uvloop go out as aiohttp's pieces, unjoined (issue 24):
the same bytes on the wire, a big region included."""

from __future__ import annotations

import asyncio

import aiohttp.http_writer
import pytest
from aiohttp import web

from proxy.pipeline.pump import EventStream
from proxy.server import _new_loop

BIG = b"data: " + b"x" * 200_000 + b"\n\n"
LAST = b"data: [DONE]\n\n"


async def _exchange() -> bytes:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = EventStream(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(BIG)
        await resp.write(b"data: small\n\n")
        await resp.write_eof(LAST)
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = await reader.read(-1)
        writer.close()
        return raw
    finally:
        await runner.cleanup()


def test_chunked_writes_on_uvloop_are_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aiohttp.http_writer, "SKIP_WRITELINES", aiohttp.http_writer.SKIP_WRITELINES)
    loop = _new_loop()
    try:
        assert aiohttp.http_writer.SKIP_WRITELINES is False
        raw = loop.run_until_complete(_exchange())
    finally:
        loop.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert body == (
        f"{len(BIG):x}\r\n".encode()
        + BIG
        + b"\r\nd\r\ndata: small\n\n\r\n"
        + f"{len(LAST):x}\r\n".encode()
        + LAST
        + b"\r\n0\r\n\r\n"
    )
