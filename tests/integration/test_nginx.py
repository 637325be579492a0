"""Through a real nginx running nginx/brownout.conf: chunks still arrive one by one."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from proxy.openai.sse import SSEParser
from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    ProxyFactory,
    StartNginx,
    chunk,
    make_policy,
    nginx_site_conf,
)

pytestmark = pytest.mark.real


# Kept for the chaos drills, which import it from here.
nginx_conf = nginx_site_conf


async def test_chunks_pass_nginx_one_by_one(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    start_nginx: StartNginx,
) -> None:
    received = [asyncio.Event() for _ in range(5)]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(5):
            await resp.write(chunk(f"t{i} "))
            # Next token only once the client behind nginx has this one.
            await asyncio.wait_for(received[i].wait(), 3)
        await resp.write(chunk("", "stop") + b"data: [DONE]\n\n")
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    proxy_port = int(proxy.url.rsplit(":", 1)[1])
    nginx_url = await start_nginx(proxy_port)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            nginx_url + "/v1/chat/completions",
            json=CHAT_BODY,
            headers={"X-Request-Id": "via-nginx"},
        ) as resp,
    ):
        assert resp.status == 200
        # nginx consumes X-Accel-Buffering; the rest of our headers pass.
        assert "X-Accel-Buffering" not in resp.headers
        assert resp.headers["X-Brownout-Backend"] == "primary"
        assert resp.headers["X-Request-Id"] == "via-nginx"
        parser = SSEParser()
        n = 0
        async for data in resp.content.iter_any():
            for _ev in parser.feed(data):
                if n < 5:
                    received[n].set()
                n += 1
    assert n == 7


async def test_nginx_generates_a_request_id(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    start_nginx: StartNginx,
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": []})

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    nginx_url = await start_nginx(int(proxy.url.rsplit(":", 1)[1]))
    async with (
        aiohttp.ClientSession() as s,
        s.post(nginx_url + "/v1/chat/completions", json={**CHAT_BODY, "stream": False}) as resp,
    ):
        assert resp.status == 200
        rid = resp.headers["X-Request-Id"]
    assert len(rid) == 32  # nginx's $request_id, echoed by Brownout
    sent = [h for p, h, _ in fake_upstream.requests if p == "/v1/chat/completions"]
    assert sent[-1]["X-Request-Id"] == rid
