"""nginx/brownout.conf's own duties, through a real nginx.

nginx answers for the sidecar when the sidecar cannot (it is down: an OpenAI
JSON 503 with Retry-After on the API, an HTML page for browsers), limits each
client address (an OpenAI JSON 429 after the burst, a cap on parallel
streams), and otherwise stays out of the way: streams pass unbuffered and the
sidecar's own 429/503 answers reach the client unchanged. A fake upstream
stands in for the sidecar.
"""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import openai
import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.openai.sse import SSEParser
from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    StartNginx,
    chunk,
    free_port,
)
from tests.integration.conftest import NGINX_SITE as SITE

pytestmark = pytest.mark.real


def site_setting(pattern: str) -> int:
    """A number from the site file, so the tests follow its tuning."""
    found = re.findall(pattern, SITE.read_text())
    assert len(found) == 1, f"expected one match of {pattern!r} in {SITE}, got {found}"
    return int(found[0])


BURST = site_setting(r"limit_req zone=brownout_req burst=(\d+)")
CONN_LIMIT = site_setting(r"limit_conn brownout_conn (\d+);")


def openai_error(body: bytes) -> dict[str, object]:
    obj = json.loads(body)
    assert isinstance(obj, dict) and set(obj) == {"error"}, obj
    err = obj["error"]
    assert isinstance(err, dict)
    assert isinstance(err["message"], str) and err["message"]
    return err


# -- the sidecar is down -------------------------------------------------------


async def test_sidecar_down_api_gets_openai_503_with_retry_after(
    start_nginx: StartNginx,
) -> None:
    nginx_url = await start_nginx(free_port())  # nobody listens there
    async with (
        aiohttp.ClientSession() as s,
        s.post(nginx_url + "/v1/chat/completions", json=CHAT_BODY) as resp,
    ):
        assert resp.status == 503
        assert resp.content_type == "application/json"
        assert resp.headers["Retry-After"] == "30"
        err = openai_error(await resp.read())
    assert err["type"] == "server_error"
    assert err["code"] == "sidecar_unavailable"

    # What an OpenAI SDK user sees: a 503 status error carrying our code.
    client = openai.AsyncOpenAI(base_url=nginx_url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
            )
    finally:
        await client.close()
    assert info.value.status_code == 503
    assert info.value.code == "sidecar_unavailable"


async def test_sidecar_down_health_answers_openai_503(start_nginx: StartNginx) -> None:
    nginx_url = await start_nginx(free_port())
    async with aiohttp.ClientSession() as s:
        for path in ("/healthz", "/readyz"):
            async with s.get(nginx_url + path) as resp:
                assert resp.status == 503, path
                assert resp.headers["Retry-After"] == "30"
                assert openai_error(await resp.read())["code"] == "sidecar_unavailable"


async def test_sidecar_answers_pass_through_unchanged(
    fake_upstream: FakeUpstream, start_nginx: StartNginx
) -> None:
    """Brownout's own 503 (maintenance) and 429 (shed) are not replaced by nginx's."""
    own_503 = {"error": {"message": "maintenance", "type": "server_error", "code": "maintenance"}}
    own_429 = {"error": {"message": "shed", "type": "rate_limit_error", "code": "shed"}}

    async def chat(request: web.Request) -> web.StreamResponse:
        return web.json_response(own_503, status=503, headers={"Retry-After": "7"})

    async def completions(request: web.Request) -> web.StreamResponse:
        return web.json_response(own_429, status=429, headers={"Retry-After": "3"})

    fake_upstream.handlers["/v1/chat/completions"] = chat
    fake_upstream.handlers["/v1/completions"] = completions
    nginx_url = await start_nginx(fake_upstream.port)
    async with aiohttp.ClientSession() as s:
        async with s.post(nginx_url + "/v1/chat/completions", json=CHAT_BODY) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "7"
            assert await resp.json() == own_503
        async with s.post(nginx_url + "/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 429
            assert resp.headers["Retry-After"] == "3"
            assert await resp.json() == own_429


# -- per-address limits --------------------------------------------------------


async def test_rate_limit_answers_openai_429_after_the_burst(
    fake_upstream: FakeUpstream, start_nginx: StartNginx
) -> None:
    async def chat(request: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": []})

    async def healthz(request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    fake_upstream.handlers["/v1/chat/completions"] = chat
    fake_upstream.handlers["/healthz"] = healthz
    nginx_url = await start_nginx(fake_upstream.port)
    body = {**CHAT_BODY, "stream": False}
    statuses: list[int] = []
    first_refusal: tuple[CIMultiDict[str], bytes] | None = None
    async with aiohttp.ClientSession() as s:
        # One after the other, as fast as they go: far faster than the rate,
        # so the burst is used up well before the bucket leaks a whole slot.
        for _ in range(BURST + 15):
            async with s.post(nginx_url + "/v1/chat/completions", json=body) as resp:
                statuses.append(resp.status)
                if resp.status == 429 and first_refusal is None:
                    first_refusal = (resp.headers.copy(), await resp.read())
        # Health and status paths are not limited.
        async with s.get(nginx_url + "/healthz") as resp:
            assert resp.status == 200

    assert statuses[: BURST + 1] == [200] * (BURST + 1), statuses
    assert set(statuses) == {200, 429}, statuses
    assert first_refusal is not None
    headers, raw = first_refusal
    assert headers.get("Retry-After") == "1"
    assert headers.get("Content-Type") == "application/json"
    err = openai_error(raw)
    assert err["type"] == "rate_limit_error"
    assert err["code"] == "rate_limit_exceeded"
    # Refused requests never reached the sidecar.
    chats = [p for p, _h, _b in fake_upstream.requests if p == "/v1/chat/completions"]
    assert len(chats) == statuses.count(200)


async def test_parallel_streams_per_address_are_capped(
    fake_upstream: FakeUpstream, start_nginx: StartNginx
) -> None:
    assert CONN_LIMIT <= BURST, "the test opens CONN_LIMIT + 1 streams inside one burst"
    release = asyncio.Event()
    started = 0
    all_started = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal started
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("held "))
        started += 1
        if started == CONN_LIMIT:
            all_started.set()
        await release.wait()
        await resp.write(chunk("", "stop") + b"data: [DONE]\n\n")
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = chat
    nginx_url = await start_nginx(fake_upstream.port)

    async def stream(s: aiohttp.ClientSession) -> tuple[int, bytes]:
        async with s.post(nginx_url + "/v1/chat/completions", json=CHAT_BODY) as resp:
            return resp.status, await resp.read()

    async with aiohttp.ClientSession() as s:
        held = [asyncio.create_task(stream(s)) for _ in range(CONN_LIMIT)]
        await asyncio.wait_for(all_started.wait(), 10)
        async with s.post(nginx_url + "/v1/chat/completions", json=CHAT_BODY) as resp:
            assert resp.status == 429
            assert resp.headers["Retry-After"] == "1"
            err = openai_error(await resp.read())
            assert err["code"] == "rate_limit_exceeded"
        release.set()
        done = await asyncio.wait_for(asyncio.gather(*held), 10)
    for status, raw in done:
        assert status == 200
        assert raw.endswith(b"data: [DONE]\n\n")
    assert started == CONN_LIMIT


# -- and otherwise out of the way ----------------------------------------------


async def test_sse_still_streams_token_by_token(
    fake_upstream: FakeUpstream, start_nginx: StartNginx
) -> None:
    received = [asyncio.Event() for _ in range(5)]

    async def chat(request: web.Request) -> web.StreamResponse:
        # No X-Accel-Buffering here (Brownout sends it; test_nginx.py covers
        # that): the site's own settings must keep the stream unbuffered.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(5):
            await resp.write(chunk(f"t{i} "))
            # The next token only once the client behind nginx has this one.
            await asyncio.wait_for(received[i].wait(), 3)
        await resp.write(chunk("", "stop") + b"data: [DONE]\n\n")
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = chat
    nginx_url = await start_nginx(fake_upstream.port)
    n = 0
    async with (
        aiohttp.ClientSession() as s,
        s.post(nginx_url + "/v1/chat/completions", json=CHAT_BODY) as resp,
    ):
        assert resp.status == 200
        parser = SSEParser()
        async for data in resp.content.iter_any():
            for _ev in parser.feed(data):
                if n < 5:
                    received[n].set()
                n += 1
    assert n == 7
