"""Issue 20 end to end: a restart on the real fallback server (tiny model) is
not relayed twice.

The primary is a fake that sends the first chunks of the fallback's own
greedy answer and dies. In front of the real fallback, a shim plays a simple
server without prefill that answers a continuation from the start: it
refuses `continue_final_message` and drops the continuation turns, so the
real model restarts the answer. The official `openai` client must read that
answer once: exactly what the fallback says to the same request directly.
On 8c097b4 the client read the sent chunks and then the whole answer again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.openai.partial import CONTINUE_INSTRUCTION
from tests.fallback.conftest import FallbackServer, start_server, stop_server
from tests.integration.conftest import FakeUpstream, ProxyFactory, chunk, free_port
from tests.integration.test_failover_fields import discovered, policy_for
from tests.integration.test_pipeline import metrics, total

pytestmark = [pytest.mark.slow]

CHAT = "/v1/chat/completions"
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me about Paris."}]


@pytest.fixture(scope="module")
def real_fallback(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FallbackServer]:
    log_path = tmp_path_factory.mktemp("fallback-seam") / "server.log"
    server = start_server(tiny_model_dir, log_path, ["--served-model-name", "tiny"])
    try:
        yield server
    finally:
        stop_server(server)


async def deltas(url: str, body: dict[str, Any]) -> list[str]:
    """The content deltas of a streamed answer, straight from the fallback."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as oai:
        stream = await oai.chat.completions.create(**body, stream=True)
        return [ev.choices[0].delta.content or "" async for ev in stream if ev.choices]


@pytest.fixture
async def restarting_shim(real_fallback: FallbackServer) -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream(free_port())
    session = aiohttp.ClientSession(auto_decompress=False)

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == CHAT:
            obj = json.loads(body)
            if obj.get("continue_final_message"):
                err = {"message": "no prefill", "type": "invalid_request_error", "code": None}
                return web.json_response({"error": err}, status=400)
            msgs = obj["messages"]
            if msgs and msgs[-1] == {"role": "user", "content": CONTINUE_INSTRUCTION}:
                obj["messages"] = msgs[:-2]  # a simple server: it answers from the start
            body = json.dumps(obj).encode()
            fake.requests.append((request.path, CIMultiDict(request.headers), body))
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


async def test_a_restart_on_the_real_fallback_reaches_the_client_once(
    fake_upstream: FakeUpstream,
    real_fallback: FallbackServer,
    restarting_shim: FakeUpstream,
    start_proxy: ProxyFactory,
) -> None:
    greedy = {"model": "tiny", "messages": MESSAGES, "temperature": 0}
    own = await deltas(real_fallback.url, {**greedy, "max_tokens": 16})
    k = len(own) // 2
    while k < len(own) and not "".join(own[:k]).strip():
        k += 1
    sent = [d for d in own[:k] if d]
    assert "".join(sent).strip(), own

    async def dies(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"".join(chunk(d) for d in sent))
        await asyncio.sleep(0.05)  # let the proxy relay the bytes first
        assert request.transport is not None
        request.transport.abort()
        return resp

    fake_upstream.handlers[CHAT] = dies
    # The shim refuses the prefill: learnt, and the rescue goes on by prompt.
    proxy = await start_proxy(policy_for(fake_upstream.url, restarting_shim.url))
    await discovered(proxy)
    got = await deltas(proxy.url, {**greedy, "max_tokens": 24})

    [(_, _, forwarded)] = [r for r in restarting_shim.requests if r[0] == CHAT]
    restart = json.loads(forwarded)
    assert restart["messages"] == MESSAGES  # the model really started over
    again = await deltas(real_fallback.url, {**greedy, "max_tokens": restart["max_tokens"]})
    assert "".join(again).startswith("".join(sent))  # ...and said the sent text again
    assert "".join(got) == "".join(again)  # the client reads it once
    m = await metrics(proxy)
    assert total(m, "brownout_stream_rescues_total", outcome="rescued") == 1
    assert total(m, "brownout_stream_rescues_total", outcome="restart_stripped") == 1
