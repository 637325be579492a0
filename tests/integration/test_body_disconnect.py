"""A client that goes away while its body is still being read (it sent less
than its Content-Length, then closed or half-closed the connection): aiohttp
cancels the handler, so the request never reaches the pipeline. It still
gets its one `request_rejected` line (499) and its count, and nothing
reaches the backend."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from tests.integration.conftest import FakeUpstream, ProxyFactory
from tests.integration.test_ingress import forwarded, make_policy
from tests.integration.test_pipeline import metrics, total, wait_until

HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n"
)


@pytest.mark.parametrize("half_close", [True, False], ids=["half-close", "close"])
async def test_a_client_gone_mid_body_gets_one_line(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, half_close: bool
) -> None:
    proxy = await start_proxy(make_policy(fake_upstream.url, "  body_timeout_s: 30"))
    port = int(proxy.url.rsplit(":", 1)[1])
    with structlog.testing.capture_logs() as logs:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + b'{"model":')
        await writer.drain()
        if half_close:
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await wait_until(lambda: any(e["event"] == "request_rejected" for e in logs))
        await asyncio.sleep(0.05)  # no second line follows
    lines = [e for e in logs if e["event"] in ("request", "request_rejected")]
    assert [(e["event"], e["status"], e["reason"]) for e in lines] == [
        ("request_rejected", 499, "client_disconnect")
    ]
    assert forwarded(fake_upstream) == []
    m = await metrics(proxy)
    assert total(m, "brownout_requests_total", status="499") == 1
