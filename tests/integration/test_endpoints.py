"""Request validation, operational endpoints and the OpenAI client's view."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from aiohttp import web

from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    ProxyFactory,
    chunk,
    free_port,
    make_policy,
)

SSE_HEADERS = {"Content-Type": "text/event-stream"}


async def _ok_upstream(fake: FakeUpstream) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "chat.completion", "choices": []})

    fake.handlers["/v1/chat/completions"] = handler
    fake.handlers["/v1/completions"] = handler


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"messages": "hi"}', 400, "invalid_type"),
        (b'{"model": "m"}', 400, "missing_field"),
        (b'{"messages": [{"role": "user", "content": 5}]}', 400, "invalid_type"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "invalid_type"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400, "invalid_type"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
            400,
            "invalid_type",
        ),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "invalid_encoding"),
    ],
)
async def test_bad_requests_get_openai_errors(
    fake_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    body: bytes,
    status: int,
    code: str,
) -> None:
    await _ok_upstream(fake_upstream)
    proxy = await start_proxy(make_policy(fake_upstream.url))
    async with proxy.session.post(
        proxy.url + "/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    ) as resp:
        assert resp.status == status
        err = (await resp.json())["error"]
        assert err["code"] == code
        assert err["type"] == "invalid_request_error"
        assert err["message"]
    # Nothing reached the backend, and the proxy still serves.
    assert not [r for r in fake_upstream.requests if r[0].endswith("completions")]
    async with proxy.session.post(
        proxy.url + "/v1/chat/completions", json={**CHAT_BODY, "stream": False}
    ) as resp:
        assert resp.status == 200


async def test_oversized_body_gets_413(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    await _ok_upstream(fake_upstream)
    proxy = await start_proxy(make_policy(fake_upstream.url))  # 4 MiB limit
    big = {"messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=big) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"

    # Chunked upload (no Content-Length): refused while reading.
    async def gen() -> Any:
        for _ in range(6):
            yield b"x" * (1024 * 1024)

    async with proxy.session.post(proxy.url + "/v1/chat/completions", data=gen()) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"


async def test_api_keys_are_enforced(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    await _ok_upstream(fake_upstream)
    policy = make_policy(fake_upstream.url, extra="")
    from dataclasses import replace

    policy = replace(policy, server=replace(policy.server, api_keys=("k1",)))
    proxy = await start_proxy(policy)
    body = {**CHAT_BODY, "stream": False}
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "invalid_api_key"
    async with proxy.session.post(
        proxy.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer k1"}
    ) as resp:
        assert resp.status == 200
    # Without a backend api_key, the client's Authorization passes through.
    sent = [h for p, h, _ in fake_upstream.requests if p == "/v1/chat/completions"]
    assert sent[-1]["Authorization"] == "Bearer k1"


async def test_backend_api_key_replaces_client_authorization(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    await _ok_upstream(fake_upstream)
    from dataclasses import replace

    policy = make_policy(fake_upstream.url)
    primary = replace(policy.backends.primary, api_key="backend-secret")
    policy = replace(policy, backends=replace(policy.backends, primary=primary))
    proxy = await start_proxy(policy)
    async with proxy.session.post(
        proxy.url + "/v1/chat/completions",
        json={**CHAT_BODY, "stream": False},
        headers={"Authorization": "Bearer client"},
    ) as resp:
        assert resp.status == 200
    sent = [h for p, h, _ in fake_upstream.requests if p == "/v1/chat/completions"]
    assert sent[-1]["Authorization"] == "Bearer backend-secret"


async def test_models_and_other_v1_paths_pass_through(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    models = {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 1024}]}

    async def models_handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(models)

    async def embeddings(request: web.Request) -> web.StreamResponse:
        return web.json_response({"echo": json.loads(await request.read())}, status=201)

    fake_upstream.handlers["/v1/models"] = models_handler
    fake_upstream.handlers["/v1/embeddings"] = embeddings
    proxy = await start_proxy(make_policy(fake_upstream.url))
    async with proxy.session.get(proxy.url + "/v1/models") as resp:
        assert resp.status == 200
        assert await resp.json() == models
        assert resp.headers["X-Brownout-Backend"] == "primary"
    async with proxy.session.post(proxy.url + "/v1/embeddings", json={"input": "x"}) as resp:
        assert resp.status == 201
        assert await resp.json() == {"echo": {"input": "x"}}


async def test_health_ready_status_metrics(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    await _ok_upstream(fake_upstream)
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await start_proxy(make_policy(fake_upstream.url, dead))
    async with proxy.session.get(proxy.url + "/healthz") as resp:
        assert resp.status == 200
    await asyncio.sleep(0.3)  # let the first probes run
    async with proxy.session.get(proxy.url + "/readyz") as resp:
        assert resp.status == 200
        assert await resp.json() == {
            "ready": True,
            "backends": {"primary": True, "fallback": False},
        }
    async with proxy.session.get(proxy.url + "/brownout/status") as resp:
        st = await resp.json()
    assert st["tier"] == "normal"
    assert st["backends"]["primary"]["healthy"] is True
    assert st["backends"]["fallback"]["healthy"] is False
    assert "connection failed" in st["backends"]["fallback"]["last_error"]
    assert st["backends"]["primary"]["breaker"] == "closed"
    assert st["concurrency"]["limit"] >= 1
    async with proxy.session.post(
        proxy.url + "/v1/chat/completions", json={**CHAT_BODY, "stream": False}
    ) as resp:
        assert resp.status == 200
    async with proxy.session.get(proxy.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert 'brownout_requests_total{backend="primary",endpoint="chat",status="200"} 1.0' in text
    assert 'brownout_backend_up{backend="fallback"} 0.0' in text
    assert "brownout_proxy_overhead_seconds_count 1.0" in text
    assert "brownout_inflight_requests 0.0" in text
    assert 'brownout_ttft_seconds_count{backend="primary"} 1.0' in text


async def test_readyz_is_503_when_no_backend_answers(start_proxy: ProxyFactory) -> None:
    proxy = await start_proxy(make_policy(f"http://127.0.0.1:{free_port()}"))
    await asyncio.sleep(0.3)
    async with proxy.session.get(proxy.url + "/readyz") as resp:
        assert resp.status == 503


async def test_openai_client_raises_on_in_band_error(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(chunk("partial "))
        request.transport.abort()  # type: ignore[union-attr]
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    got: list[str] = []
    with pytest.raises(openai.APIError) as info:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        async for c in stream:
            got.append(c.choices[0].delta.content or "")
    assert got == ["partial "]
    assert "mid-answer" in info.value.message or "before the answer" in info.value.message
    await client.close()


async def test_slow_body_gets_408_and_the_proxy_keeps_serving(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    await _ok_upstream(fake_upstream)
    from dataclasses import replace

    policy = make_policy(fake_upstream.url)
    policy = replace(policy, server=replace(policy.server, body_timeout_s=0.5))
    proxy = await start_proxy(policy)
    port = int(proxy.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    await writer.drain()
    t0 = asyncio.get_running_loop().time()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
    assert head.startswith(b"HTTP/1.1 408")
    assert asyncio.get_running_loop().time() - t0 < 2
    writer.close()
    # Header injection through a model name changes nothing upstream.
    body = {**CHAT_BODY, "stream": False, "model": "m\r\nX-Evil: 1"}
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    sent = [h for p, h, _ in fake_upstream.requests if p == "/v1/chat/completions"]
    assert "X-Evil" not in sent[-1]
