"""Issue 14, items 7 and 8 end to end: the official `openai` client, the real
proxy and the real fallback server on the tiny model (a scripted fake primary,
which a real server cannot be made to fail on cue).

8: in failover, every field either reaches a fallback that advertises it, or
   the client gets an error naming it (`drop`: a header naming it) — never a
   200 of plain text that silently ignored it.
7: a stream cut mid-answer is rescued on the real fallback, by prefill, and
   by prompt when a shim in front of the fallback refuses prefills.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.policy import Policy
from proxy.runtime.keys import STATE
from tests.fallback.conftest import FallbackServer, start_server, stop_server
from tests.integration.conftest import (
    RANDOM_MODEL_GUARD,
    FakeUpstream,
    ProxyFactory,
    RunningProxy,
    chunk,
    free_port,
    make_policy,
)

pytestmark = [pytest.mark.slow]

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def real_fallback(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FallbackServer]:
    log_path = tmp_path_factory.mktemp("fallback-fields") / "server.log"
    server = start_server(tiny_model_dir, log_path, ["--served-model-name", "tiny"])
    try:
        yield server
    finally:
        stop_server(server)


def policy_for(primary: str, fallback: str, extra: str = "") -> Policy:
    pol = make_policy(primary, fallback, extra=RANDOM_MODEL_GUARD + extra)
    b = pol.backends
    assert b.fallback is not None
    slow = replace(b.fallback.timeouts, first_byte_s=60, idle_s=30)
    return replace(pol, backends=replace(b, fallback=replace(b.fallback, timeouts=slow)))


async def discovered(proxy: RunningProxy) -> dict[str, Any]:
    """Wait until the proxy read the fallback's capabilities; what it advertises."""
    fb = proxy.app[STATE].current.upstreams["fallback"]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while fb.caps is None or "tools" not in fb.caps.chat:
        assert loop.time() < deadline, "capabilities never discovered"
        await asyncio.sleep(0.05)
    async with aiohttp.ClientSession() as s, s.get(fb.policy.url + "/v1/models") as r:
        caps: dict[str, Any] = (await r.json())["data"][0]["capabilities"]
    return caps


def client(proxy: RunningProxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)


async def test_failover_honours_or_names_every_field(
    real_fallback: FallbackServer, start_proxy: ProxyFactory
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # the primary refuses connections
    proxy = await start_proxy(policy_for(dead, real_fallback.url))
    caps = await discovered(proxy)
    oai = client(proxy)

    # Tools are advertised: they reach the fallback and the answer is its own.
    raw = await oai.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=8
    )
    assert raw.headers["x-brownout-backend"] == "fallback"
    assert "x-brownout-dropped" not in raw.headers
    assert raw.parse().choices[0].finish_reason in ("stop", "length", "tool_calls")

    # logprobs: honoured when advertised, else an error naming it — never dropped.
    if caps["logprobs"]:
        r = await oai.chat.completions.create(
            model="tiny", messages=MESSAGES, logprobs=True, top_logprobs=1, max_tokens=4
        )
        assert r.choices[0].logprobs is not None
    else:
        with pytest.raises(openai.APIStatusError) as exc:
            await oai.chat.completions.create(
                model="tiny", messages=MESSAGES, logprobs=True, max_tokens=4
            )
        assert exc.value.status_code == 503 and "logprobs" in exc.value.message

    # A field the fallback does not honour at all: the proxy names it, the
    # fallback never sees the request.
    with pytest.raises(openai.APIStatusError) as exc:
        await oai.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, extra_body={"best_of": 3}
        )
    assert exc.value.status_code == 503
    body: Any = exc.value.body
    assert body["code"] == "unsupported_fields" and body["param"] == "best_of"

    # Image parts: not honoured by a text model — named, not stripped.
    with pytest.raises(openai.APIStatusError) as exc:
        await oai.chat.completions.create(
            model="tiny",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
                    ],
                }
            ],
        )
    assert "image_url" in exc.value.message


async def test_drop_policy_answers_and_names_what_it_dropped(
    real_fallback: FallbackServer, start_proxy: ProxyFactory
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    extra = "ladder:\n  failover:\n    unsupported_fields: drop\n"
    proxy = await start_proxy(policy_for(dead, real_fallback.url, extra))
    await discovered(proxy)
    raw = await client(proxy).chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=4, extra_body={"best_of": 3}
    )
    assert raw.headers["x-brownout-dropped"] == "best_of"
    assert raw.parse().choices[0].message is not None


# ---------------------------------------------------------------------------- item 7


@pytest.fixture
async def prefill_shim(real_fallback: FallbackServer) -> AsyncIterator[FakeUpstream]:
    """The real fallback behind a shim that refuses `continue_final_message`
    (as an OpenAI-compatible server without prefill does); the rest is relayed."""
    fake = FakeUpstream(free_port())
    session = aiohttp.ClientSession(auto_decompress=False)

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        fake.requests.append((request.path, CIMultiDict(request.headers), body))
        if body and json.loads(body).get("continue_final_message"):
            return web.json_response(
                {
                    "error": {
                        "message": "Unrecognized request argument supplied: continue_final_message",
                        "type": "invalid_request_error",
                        "param": "continue_final_message",
                        "code": "unknown_parameter",
                    }
                },
                status=400,
            )
        async with session.request(
            request.method,
            real_fallback.url + request.path_qs,
            data=body or None,
            headers={"Content-Type": "application/json"},
        ) as up:
            resp = web.StreamResponse(status=up.status)
            resp.content_type = up.content_type
            await resp.prepare(request)
            async for part in up.content.iter_any():
                await resp.write(part)
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", relay)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", fake.port).start()
    yield fake
    await runner.cleanup()
    await session.close()


def dying_primary(fake: FakeUpstream) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("The weather") + chunk(" in Paris"))
        await asyncio.sleep(0.05)  # let the proxy relay the bytes first
        assert request.transport is not None
        request.transport.abort()
        return resp

    fake.handlers["/v1/chat/completions"] = handler


async def rescued_text(proxy: RunningProxy) -> tuple[str, str | None]:
    stream = await client(proxy).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, stream=True
    )
    text, finish = [], None
    async for ev in stream:
        if ev.choices:
            text.append(ev.choices[0].delta.content or "")
            finish = ev.choices[0].finish_reason or finish
    return "".join(text), finish


@pytest.mark.parametrize("shim", [False, True], ids=["prefill", "no-prefill"])
async def test_a_cut_stream_is_rescued_on_the_real_fallback(
    fake_upstream: FakeUpstream,
    real_fallback: FallbackServer,
    prefill_shim: FakeUpstream,
    start_proxy: ProxyFactory,
    shim: bool,
) -> None:
    dying_primary(fake_upstream)
    fallback_url = prefill_shim.url if shim else real_fallback.url
    proxy = await start_proxy(policy_for(fake_upstream.url, fallback_url))
    text, finish = await rescued_text(proxy)  # no exception: the stream completed
    assert text.startswith("The weather in Paris")
    assert finish in ("stop", "length")
    fb = proxy.app[STATE].current.upstreams["fallback"]
    assert fb.supports_continuation is (not shim)
    assert fb.breaker.state == "closed"
    if shim:
        sent = [json.loads(b) for p, _, b in prefill_shim.requests if p.endswith("/completions")]
        assert [bool(s.get("continue_final_message")) for s in sent] == [True, False]
        assert sent[1]["messages"][-2] == {"role": "assistant", "content": "The weather in Paris"}
