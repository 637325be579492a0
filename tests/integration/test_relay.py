"""The streaming relay over real sockets, against a scripted fake upstream."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from aiohttp import web

from proxy.openai.sse import SSEParser
from proxy.policy import parse_policy
from tests.integration.conftest import (
    CHAT_BODY,
    NO_MAINTENANCE,
    FakeUpstream,
    ProxyFactory,
    chunk,
    free_port,
    make_policy,
)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def read_events(resp: aiohttp.ClientResponse) -> list[bytes]:
    parser = SSEParser()
    out: list[bytes] = []
    async for data in resp.content.iter_any():
        out.extend(e.raw for e in parser.feed(data))
    return out


def data_of(events: list[bytes]) -> list[bytes]:
    return [e[6:-2] for e in events if e.startswith(b"data: ")]


async def test_events_arrive_one_by_one_in_lockstep(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    # The upstream produces event i+1 only after the client has received event
    # i: any buffering or coalescing in the proxy deadlocks and fails the test.
    received = [asyncio.Event() for _ in range(6)]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        for i in range(5):
            await resp.write(chunk(f"t{i} "))
            await asyncio.wait_for(received[i].wait(), 2)
        await resp.write(chunk("", "stop"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    async with proxy.session.post(
        proxy.url + "/v1/chat/completions", json=CHAT_BODY, headers={"X-Request-Id": "req-42"}
    ) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Accel-Buffering"] == "no"
        assert resp.headers["Cache-Control"] == "no-cache"
        assert resp.headers["X-Brownout-Tier"] == "normal"
        assert resp.headers["X-Brownout-Backend"] == "primary"
        assert resp.headers["X-Request-Id"] == "req-42"
        parser = SSEParser()
        seen: list[bytes] = []
        async for data in resp.content.iter_any():
            for ev in parser.feed(data):
                seen.append(ev.data or b"")
                if len(seen) <= 5:
                    received[len(seen) - 1].set()
    assert len(seen) == 7
    assert seen[-1] == b"[DONE]"
    assert json.loads(seen[0])["choices"][0]["delta"]["content"] == "t0 "
    # The request id reached the upstream too.
    sent = [h for path, h, _ in fake_upstream.requests if path == "/v1/chat/completions"]
    assert sent[0]["X-Request-Id"] == "req-42"


async def test_stream_bytes_are_relayed_unchanged(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    body = (
        b": upstream comment\n\n"
        + chunk("h\u00e9llo")
        + b'data: {"choices":[{"delta":{"content":"x"},"finish_reason":"stop"}]}\n\n'
        + b"data: [DONE]\n\n"
    )

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        # Odd TCP framing: split in the middle of events.
        for i in range(0, len(body), 7):
            await resp.write(body[i : i + 7])
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        assert await resp.read() == body


async def test_upstream_http_error_before_first_byte_is_openai_shaped(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def html_503(request: web.Request) -> web.StreamResponse:
        return web.Response(status=503, text="<html>overloaded</html>", content_type="text/html")

    fake_upstream.handlers["/v1/chat/completions"] = html_503
    proxy = await start_proxy(make_policy(fake_upstream.url, extra=NO_MAINTENANCE))
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        assert resp.status == 503
        assert resp.headers["Content-Type"].startswith("application/json")
        err = (await resp.json())["error"]
        assert err["type"] == "server_error"
        assert "overloaded" in err["message"]
        assert resp.headers["X-Brownout-Backend"] == "primary"

    vllm_error = {
        "error": {
            "message": "This model's maximum context length is 1024 tokens.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }

    async def ctx_400(request: web.Request) -> web.StreamResponse:
        return web.json_response(vllm_error, status=400)

    fake_upstream.handlers["/v1/chat/completions"] = ctx_400
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        assert resp.status == 400
        assert await resp.json() == vllm_error  # already OpenAI-shaped: passed through


async def test_error_event_before_any_content_becomes_http_error(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(
            b'data: {"error": {"message": "EngineCore encountered an issue.", '
            b'"type": "InternalServerError", "param": null, "code": 500}}\n\n'
        )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url, extra=NO_MAINTENANCE))
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["message"].startswith("EngineCore")
        assert "X-Accel-Buffering" not in resp.headers


async def test_error_after_first_byte_is_in_band_then_done(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(chunk("partial "))
        await resp.write(
            b'data: {"error": {"message": "EngineCore encountered an issue.", '
            b'"type": "InternalServerError", "param": null, "code": 500}}\n\n'
        )
        return resp  # closes without [DONE]

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        assert resp.status == 200
        data = data_of(await read_events(resp))
    assert json.loads(data[0])["choices"][0]["delta"]["content"] == "partial "
    assert json.loads(data[1])["error"]["type"] == "InternalServerError"
    assert data[2:] == [b"[DONE]"]


async def test_abrupt_upstream_disconnect_mid_stream_ends_with_error(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(chunk("partial "))
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()  # RST, no chunked terminator
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    t0 = time.monotonic()
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        data = data_of(await read_events(resp))
    assert time.monotonic() - t0 < 1.0  # finalised promptly, not at a timeout
    err = json.loads(data[1])["error"]
    assert err["code"] in ("upstream_disconnect", "upstream_truncated")
    assert err["type"] == "server_error"
    assert data[-1] == b"[DONE]"


async def test_clean_eof_without_done_or_finish_is_truncation(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(chunk("partial "))
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        data = data_of(await read_events(resp))
    assert json.loads(data[1])["error"]["code"] == "upstream_truncated"
    assert data[-1] == b"[DONE]"


async def test_finished_answer_missing_done_gets_done_appended(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(chunk("all "))
        await resp.write(chunk("", "stop"))
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        data = data_of(await read_events(resp))
    assert len(data) == 3
    assert data[-1] == b"[DONE]"
    assert b"error" not in b"".join(data)


async def test_slow_prefill_gets_heartbeats_then_answer(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await asyncio.sleep(1.0)  # heartbeat_s is 0.3 in the test policy
        await resp.write(chunk("late", "stop"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    t0 = time.monotonic()
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        # Headers went out with the first heartbeat, long before the answer.
        assert time.monotonic() - t0 < 0.8
        assert resp.headers["X-Accel-Buffering"] == "no"
        events = await read_events(resp)
    pings = [e for e in events if e == b": ping\n\n"]
    assert len(pings) >= 2
    assert events[-1] == b"data: [DONE]\n\n"
    assert events.index(pings[0]) == 0


async def test_stall_before_first_byte_times_out(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await asyncio.sleep(10)
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))  # first_byte_s: 2
    t0 = time.monotonic()
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        data = data_of(await read_events(resp))
    assert 1.9 < time.monotonic() - t0 < 3.5
    assert json.loads(data[0])["error"]["code"] == "upstream_timeout"
    assert data[-1] == b"[DONE]"


async def test_stall_before_first_byte_times_out_with_heartbeats_off(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Issue 24: the first-byte deadline is the stream timer's, not a timeout
    scope; with no heartbeat to share it, it still fires on time, and the
    client, who saw nothing yet, gets an HTTP 504."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await asyncio.sleep(10)
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    text = f"""
server:
  heartbeat_s: 0
backends:
  primary:
    url: {fake_upstream.url}
    timeouts: {{connect_s: 1, first_byte_s: 1, idle_s: 1}}
    health: {{interval_s: 0.2, timeout_s: 0.5}}
{NO_MAINTENANCE}"""
    proxy = await start_proxy(parse_policy(text, "test-policy.yaml"))
    t0 = time.monotonic()
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        body = await resp.json()
    assert 0.9 < time.monotonic() - t0 < 2.5
    assert resp.status == 504
    assert body["error"]["code"] == "upstream_timeout"


async def test_stall_mid_stream_hits_idle_timeout(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(chunk("a"))
        await asyncio.sleep(10)
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))  # idle_s: 1
    t0 = time.monotonic()
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as resp:
        events = await read_events(resp)
    elapsed = time.monotonic() - t0
    assert 0.9 < elapsed < 2.5
    data = data_of(events)
    assert json.loads(data[1])["error"]["code"] == "upstream_timeout"
    assert data[-1] == b"[DONE]"
    # Heartbeats kept flowing to the client during the stall.
    assert b": ping\n\n" in events


async def test_client_disconnect_closes_upstream_at_once(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    gone_at: list[float] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            for i in range(1000):
                await resp.write(chunk(f"{i} "))
                await asyncio.sleep(0.02)
        except (ConnectionError, asyncio.CancelledError):
            gone_at.append(time.monotonic())
            raise
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    resp = await proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY)
    await resp.content.readany()
    closed_at = time.monotonic()
    resp.close()  # drop the connection mid-answer
    for _ in range(50):
        if gone_at:
            break
        await asyncio.sleep(0.02)
    assert gone_at, "upstream request still running after the client left"
    assert gone_at[0] - closed_at < 1.0


async def test_non_streaming_is_relayed_byte_for_byte(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    raw = b'{"id":"x",  "object":"chat.completion","choices":[{"message":{"content":"\\u00e9"}}]}'

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=raw, content_type="application/json")

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(make_policy(fake_upstream.url))
    body = {**CHAT_BODY, "stream": False}
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert await resp.read() == raw
        assert resp.headers["X-Brownout-Backend"] == "primary"
    # The request body itself went upstream unchanged when nothing is rewritten.
    assert json.loads(fake_upstream.requests[-1][2]) == body


async def test_model_rewrite(fake_upstream: FakeUpstream, start_proxy: ProxyFactory) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"object": "text_completion", "choices": [{"text": "x", "finish_reason": "stop"}]}
        )

    fake_upstream.handlers["/v1/completions"] = handler
    policy = make_policy(fake_upstream.url)
    from dataclasses import replace

    policy = replace(
        policy,
        backends=replace(
            policy.backends, primary=replace(policy.backends.primary, model="served-name")
        ),
    )
    proxy = await start_proxy(policy)
    body = {"model": "whatever", "prompt": "hello"}
    async with proxy.session.post(proxy.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
    assert json.loads(fake_upstream.requests[-1][2])["model"] == "served-name"


async def test_primary_refusing_connections_fails_over(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "chat.completion", "choices": []})

    fake_upstream.handlers["/v1/chat/completions"] = handler
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await start_proxy(make_policy(dead, fake_upstream.url))
    body = {**CHAT_BODY, "stream": False}
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["X-Brownout-Backend"] == "fallback"

    # Both down: a clear 502, not a hang or a crash.
    proxy2 = await start_proxy(
        make_policy(dead, f"http://127.0.0.1:{free_port()}", extra=NO_MAINTENANCE)
    )
    async with proxy2.session.post(proxy2.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "upstream_unreachable"
