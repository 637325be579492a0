"""Issue 14, item 7 (and 8's rescue rule) with scripted fakes on real sockets.

A fallback that refuses the assistant prefill (`continue_final_message`) is
learnt, not blamed: the stream continues by a prompt-level continuation. A
stream that was emitting `tool_calls` is never restarted as plain text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from proxy.openai.partial import CONTINUE_INSTRUCTION
from proxy.runtime.keys import STATE
from tests.integration.conftest import FakeUpstream, ProxyFactory, chunk, free_port
from tests.integration.test_pipeline import CHAT, DONE, SSE, events_of, metrics, policy, total

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture
async def fallback_upstream() -> AsyncIterator[FakeUpstream]:
    fake = FakeUpstream(free_port())
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.dispatch)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", fake.port).start()
    yield fake
    await runner.cleanup()


def cut_after(raw: bytes) -> Any:
    """Sends `raw`, then drops the connection (no terminator): a dead stream."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        await resp.write(raw)
        await asyncio.sleep(0.05)  # let the proxy relay the bytes first
        assert request.transport is not None
        request.transport.abort()
        return resp

    return handler


async def no_prefill(request: web.Request) -> web.StreamResponse:
    """A fallback without assistant prefill: 400 on continue_final_message."""
    body = await request.json()
    if body.get("continue_final_message"):
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
    resp = web.StreamResponse(headers=SSE)
    await resp.prepare(request)
    await resp.write(chunk(" jumps") + chunk("", "stop") + DONE)
    return resp


def chat_calls(fake: FakeUpstream) -> list[dict[str, Any]]:
    return [json.loads(b) for p, _, b in fake.requests if p == CHAT]


def content_of(raw: bytes) -> str:
    out = []
    for d in events_of(raw):
        if d != b"[DONE]":
            delta = json.loads(d)["choices"][0].get("delta") or {}
            out.append(delta.get("content") or "")
    return "".join(out)


async def test_a_refused_prefill_is_learnt_and_the_rescue_goes_on_by_prompt(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """On main the 400 ended the rescued stream with an error event."""
    fake_upstream.handlers[CHAT] = cut_after(chunk("The quick") + chunk(" brown fox"))
    fallback_upstream.handlers[CHAT] = no_prefill
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        assert r.status == 200
        raw = await r.read()
    assert b'"error"' not in raw
    assert content_of(raw) == "The quick brown fox jumps"  # the relay strips nothing
    assert raw.endswith(b"data: [DONE]\n\n")
    prefill, by_prompt = chat_calls(fallback_upstream)
    assert prefill["continue_final_message"] is True
    assert by_prompt["messages"] == [
        *BODY["messages"],
        {"role": "assistant", "content": "The quick brown fox"},
        {"role": "user", "content": CONTINUE_INSTRUCTION},
    ]
    assert "continue_final_message" not in by_prompt
    assert "add_generation_prompt" not in by_prompt
    m = await metrics(proxy)
    assert total(m, "brownout_stream_rescues_total", outcome="prefill_rejected") == 1
    assert total(m, "brownout_stream_rescues_total", outcome="rescued") == 1
    # The prefill 400 is no backend failure.
    assert total(m, "brownout_upstream_errors_total", backend="fallback") == 0
    st = proxy.app[STATE].current
    assert st.upstreams["fallback"].breaker.state == "closed"
    assert st.upstreams["fallback"].supports_continuation is False

    # Learnt: the next rescue goes by prompt at once.
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        assert content_of(await r.read()) == "The quick brown fox jumps"
    assert len(chat_calls(fallback_upstream)) == 3
    assert "continue_final_message" not in chat_calls(fallback_upstream)[-1]


async def test_policy_says_no_prefill(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fake_upstream.handlers[CHAT] = cut_after(chunk("The quick"))
    fallback_upstream.handlers[CHAT] = no_prefill
    pol = policy(
        fake_upstream.url,
        fallback_upstream.url,
        extra={"backends": {"fallback": {"supports_continuation": False}}},
    )
    proxy = await start_proxy(pol)
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        assert content_of(await r.read()) == "The quick jumps"
    [sent] = chat_calls(fallback_upstream)
    assert sent["messages"][-1] == {"role": "user", "content": CONTINUE_INSTRUCTION}


async def test_when_nothing_works_the_stream_ends_with_an_explicit_error(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def refuse_all(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "no", "type": "x"}}, status=400)

    fake_upstream.handlers[CHAT] = cut_after(chunk("The quick"))
    fallback_upstream.handlers[CHAT] = refuse_all
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        raw = await r.read()
    last_two = events_of(raw)[-2:]
    assert json.loads(last_two[0])["error"]["code"] == "upstream_disconnect"
    assert last_two[1] == b"[DONE]"
    assert len(chat_calls(fallback_upstream)) == 2  # prefill, then by prompt
    m = await metrics(proxy)
    assert total(m, "brownout_stream_rescues_total", outcome="failed") == 1
    assert total(m, "brownout_upstream_errors_total", backend="fallback") == 0


async def test_a_stream_emitting_tool_calls_is_not_restarted_as_text(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    call = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"ci'},
                        }
                    ]
                },
                "finish_reason": None,
            }
        ],
    }
    fake_upstream.handlers[CHAT] = cut_after(b"data: " + json.dumps(call).encode() + b"\n\n")
    fallback_upstream.handlers[CHAT] = no_prefill
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        raw = await r.read()
    events = events_of(raw)
    assert json.loads(events[0])["choices"][0]["delta"]["tool_calls"][0]["id"] == "call_1"
    assert "error" in json.loads(events[-2])
    assert events[-1] == b"[DONE]"
    assert chat_calls(fallback_upstream) == []
