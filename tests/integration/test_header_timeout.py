"""Slow-loris (defect 14): a request's headers must be complete within
`server.header_timeout_s` of its first byte, or the connection is closed —
on the real listening path of `brownout serve` (`proxy.server.start_site`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.server import start_site
from tests.integration.conftest import FakeUpstream, free_port

TIMEOUT_S = 0.3


@pytest.fixture
async def served(fake_upstream: FakeUpstream) -> AsyncIterator[int]:
    policy = parse_policy(
        f"""
server:
  header_timeout_s: {TIMEOUT_S}
  body_timeout_s: 5
backends:
  primary:
    url: {fake_upstream.url}
""",
        "t.yaml",
    )
    app = create_app(policy)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    port = free_port()
    await start_site(runner, app, "127.0.0.1", port)
    yield port
    await runner.cleanup()


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def _trickle(port: int) -> float:
    """Send a request head a byte every 0.1 s; seconds until the server hung up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40
    try:
        for byte in head:
            writer.write(bytes([byte]))
            await writer.drain()
            if await _closed_within(reader, 0.1):
                return loop.time() - t0
        return float("inf")
    except ConnectionError:
        return loop.time() - t0
    finally:
        writer.close()


async def test_slow_headers_are_cut_and_others_are_not(served: int) -> None:
    port = served
    # Meanwhile: an idle keep-alive connection (one request done, no byte of a
    # next one) is not cut; neither is a request whose body is slow.
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
    idle_w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await idle_r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    await idle_r.readexactly(len(b'{"status": "ok"}'))

    slow_body_r, slow_body_w = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"tier": "x"}'
    slow_body_w.write(
        b"POST /brownout/tier HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    )

    cut = await asyncio.gather(*(_trickle(port) for _ in range(3)))
    # Cut a deadline after the first byte (and not before it).
    assert all(TIMEOUT_S <= t < TIMEOUT_S + 0.5 for t in cut), cut

    slow_body_w.write(body)  # ~0.6 s after its headers
    answer = await asyncio.wait_for(slow_body_r.readuntil(b"\r\n\r\n"), 2)
    assert answer.startswith(b"HTTP/1.1 403"), answer  # admin disabled: the app answered
    slow_body_w.close()

    idle_w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    metrics = await asyncio.wait_for(idle_r.read(), 2)
    assert metrics.startswith(b"HTTP/1.1 200")
    assert b"brownout_header_timeouts_total 3.0" in metrics
    idle_w.close()


async def test_headers_in_several_packets_within_the_deadline_are_served(served: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served)
    for part in (b"GET /hea", b"lthz HTTP/1.1\r\n", b"Host: x\r\n", b"Connection: close\r\n\r\n"):
        writer.write(part)
        await asyncio.sleep(TIMEOUT_S / 5)
    answer = await asyncio.wait_for(reader.read(), 2)
    assert answer.startswith(b"HTTP/1.1 200")
    writer.close()


async def test_a_body_read_after_the_answer_is_no_slow_header(served: int) -> None:
    # A 405 is answered before the body is read; the body that follows is
    # drained by aiohttp, and the connection then idles as keep-alive.
    reader, writer = await asyncio.open_connection("127.0.0.1", served)
    writer.write(b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
    assert head.startswith(b"HTTP/1.1 405")
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    writer.write(b"0123456789")
    await asyncio.sleep(TIMEOUT_S * 2)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 2)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    writer.close()
