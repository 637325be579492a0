"""The request pipeline end to end: one terminal record per request on every
path, pass-through paths through the same protections, and the defects of
issue 13 that lived at the seams of the old `forward.Flow` (numbers below).

Each test starts the real proxy in front of scripted fakes on real sockets and
checks what a client sees (status, headers, SSE bytes), what the fakes
received, `/metrics`, and the structured log lines.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.openai.sse import SSEParser
from proxy.policy import Policy, parse_policy
from proxy.runtime.keys import STATE
from proxy.sessions.store import session_key
from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    ProxyFactory,
    RunningProxy,
    chunk,
    free_port,
)

CHAT = "/v1/chat/completions"
SSE = {"Content-Type": "text/event-stream"}
DONE = b"data: [DONE]\n\n"
BACKEND = {
    "timeouts": {"connect_s": 1, "first_byte_s": 2, "idle_s": 1},
    "health": {"interval_s": 0.2, "timeout_s": 0.5},
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def policy(
    primary: str,
    fallback: str | None = None,
    *,
    primary_extra: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    maintenance: bool = False,
) -> Policy:
    doc: dict[str, Any] = {
        "server": {"heartbeat_s": 0.3},
        "backends": {"primary": _merge({"url": primary, **BACKEND}, primary_extra or {})},
        "ladder": {"maintenance": {"enabled": maintenance}},
    }
    if fallback is not None:
        doc["backends"]["fallback"] = {"url": fallback, "kind": "transformers", **BACKEND}
    return parse_policy(yaml.safe_dump(_merge(doc, extra or {})), "pipeline-test.yaml")


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


async def metrics(proxy: RunningProxy) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with proxy.session.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def total(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **want: str
) -> float:
    return sum(
        v
        for (n, labels), v in samples.items()
        if n == name and all(dict(labels).get(k) == w for k, w in want.items())
    )


def request_lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "request"]


def events_of(raw: bytes) -> list[bytes]:
    parser = SSEParser()
    return [e.data for e in parser.feed(raw) + parser.flush() if e.data is not None]


async def stream_words(request: web.Request, words: list[str]) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE)
    await resp.prepare(request)
    for w in words:
        await resp.write(chunk(w))
    await resp.write(chunk("", "stop") + DONE)
    return resp


async def fallback_answer(request: web.Request) -> web.StreamResponse:
    """A non-streaming chat answer "from the fallback"."""
    return web.json_response(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "from the fallback"},
                    "finish_reason": "stop",
                }
            ],
        }
    )


async def wait_until(pred: Any, limit_s: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not pred():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- one terminal record


async def test_every_path_ends_with_one_metric_update_and_one_log_line(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Success, upstream error, shed, client disconnect: each request adds 1
    to brownout_requests_total and writes exactly one `request` line."""
    gate = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        what = body["messages"][-1]["content"]
        if what == "fail":
            return web.json_response({"error": {"message": "bad", "code": 400}}, status=400)
        if what == "crash":
            return web.json_response({"error": {"message": "engine", "code": 500}}, status=500)
        if what == "hold":
            resp = web.StreamResponse(headers=SSE)
            await resp.prepare(request)
            await resp.write(chunk("held "))
            await gate.wait()
            await resp.write(chunk("", "stop") + DONE)
            return resp
        return await stream_words(request, ["ok"])

    fake_upstream.handlers[CHAT] = chat
    throttle = {"ladder": {"throttle": {"max_inflight": 1, "queue_size": 0}}}
    proxy = await start_proxy(policy(fake_upstream.url, extra=throttle))

    def body(text: str) -> dict[str, Any]:
        return {**CHAT_BODY, "messages": [{"role": "user", "content": text}]}

    before = total(await metrics(proxy), "brownout_requests_total")
    with structlog.testing.capture_logs() as logs:
        async with proxy.session.post(proxy.url + CHAT, json=body("hi")) as r:
            assert r.status == 200
            await r.read()
        async with proxy.session.post(proxy.url + CHAT, json=body("fail")) as r:
            assert r.status == 400
            await r.read()
        async with proxy.session.post(proxy.url + CHAT, json=body("crash")) as r:
            assert r.status == 500  # no other backend: the upstream's own error
            assert (await r.json())["error"]["message"] == "engine"
        held = await proxy.session.post(proxy.url + CHAT, json=body("hold"))
        await held.content.readany()
        async with proxy.session.post(proxy.url + CHAT, json=body("hi")) as r:
            assert r.status == 429  # shed: the one slot is taken
            await r.read()
        held.close()  # the client leaves mid-answer
        await wait_until(lambda: len(request_lines(logs)) == 5)
        gate.set()
    outcomes = [e["outcome"] for e in request_lines(logs)]
    assert sorted(outcomes) == sorted(
        ["complete", "complete", "error", "shed_queue_full", "client_disconnect"]
    )
    m = await metrics(proxy)
    assert total(m, "brownout_requests_total") - before == 5
    assert total(m, "brownout_client_disconnects_total", backend="primary") == 1


async def test_unexpected_exception_is_an_openai_error_with_one_record(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from proxy.pipeline import attempts

    async def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(attempts, "relay_body", boom)
    fake_upstream.handlers[CHAT] = lambda r: asyncio.sleep(0, web.json_response({"choices": []}))
    proxy = await start_proxy(policy(fake_upstream.url))
    with structlog.testing.capture_logs() as logs:
        async with proxy.session.post(proxy.url + CHAT, json={**CHAT_BODY, "stream": False}) as r:
            assert r.status == 500
            assert r.headers["Content-Type"].startswith("application/json")
            err = (await r.json())["error"]
    assert err["code"] == "internal_error" and err["type"] == "server_error"
    [line] = request_lines(logs)
    assert line["status"] == 500 and line["outcome"] == "internal_error"
    m = await metrics(proxy)
    assert total(m, "brownout_requests_total", status="500") == 1


# --------------------------------------------------------------------------- defect 1


async def test_stream_closed_before_its_first_event_is_retried_on_the_fallback(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Defect 1: 200 + SSE headers, then the connection closes with no event."""

    async def close_at_once(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        assert request.transport is not None
        request.transport.close()
        return resp

    async def fallback(request: web.Request) -> web.StreamResponse:
        return await stream_words(request, ["from ", "fallback"])

    fake_upstream.handlers[CHAT] = close_at_once
    fallback_upstream.handlers[CHAT] = fallback
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    with structlog.testing.capture_logs() as logs:
        async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as r:
            assert r.status == 200
            assert r.headers["X-Brownout-Backend"] == "fallback"
            raw = await r.read()
    texts = [json.loads(d)["choices"][0]["delta"]["content"] for d in events_of(raw)[:-1]]
    assert "".join(texts) == "from fallback"
    assert events_of(raw)[-1] == b"[DONE]"
    [line] = request_lines(logs)
    assert line["backend"] == "fallback" and line["outcome"] == "complete"
    m = await metrics(proxy)
    assert total(m, "brownout_retries_total") == 1
    assert total(m, "brownout_upstream_errors_total", backend="primary") == 1


# --------------------------------------------------------------------------- defect 2


async def test_context_too_long_on_the_estimate_path_is_a_400(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Defect 2: /tokenize answers 500 and the prompt exceeds max_model_len."""

    async def tokenize(request: web.Request) -> web.Response:
        return web.Response(status=500, text="tokenizer broke")

    fake_upstream.handlers["/tokenize"] = tokenize
    fake_upstream.handlers[CHAT] = lambda r: stream_words(r, ["never"])
    pol = policy(fake_upstream.url, primary_extra={"model": "tiny", "max_model_len": 256})
    proxy = await start_proxy(pol)
    body = {**CHAT_BODY, "messages": [{"role": "user", "content": "word " * 2000}]}
    with structlog.testing.capture_logs() as logs:
        async with proxy.session.post(proxy.url + CHAT, json=body) as r:
            assert r.status == 400
            err = (await r.json())["error"]
    assert err["code"] == "context_length_exceeded"
    assert err["param"] == "messages"
    assert [p for p, _, _ in fake_upstream.requests if p == CHAT] == []
    [line] = request_lines(logs)
    assert line["status"] == 400 and line["outcome"] == "rejected"


async def test_an_estimate_just_over_the_window_lets_the_backend_judge(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """/tokenize fails, and only the estimate (chars/3, on the large side) of
    prompt + max_tokens is over the window while the prompt alone fits: the
    request goes to the backend (history dropped), it is not refused with a
    400 the backend would not have given."""

    async def tokenize(request: web.Request) -> web.Response:
        return web.Response(status=500, text="tokenizer broke")

    fake_upstream.handlers["/tokenize"] = tokenize
    fake_upstream.handlers[CHAT] = lambda r: stream_words(r, ["fits"])
    pol = policy(fake_upstream.url, primary_extra={"model": "tiny", "max_model_len": 1024})
    proxy = await start_proxy(pol)
    question = {"role": "user", "content": "word " * 120}  # ~200 estimated tokens
    history = [{"role": "user", "content": "old"}, {"role": "assistant", "content": "turn"}]
    body = {**CHAT_BODY, "max_tokens": 900, "messages": [*history, question]}
    async with proxy.session.post(proxy.url + CHAT, json=body) as r:
        assert r.status == 200
        assert "fits" in await r.text()
    [(_, _, sent)] = [(p, h, b) for p, h, b in fake_upstream.requests if p == CHAT]
    assert json.loads(sent)["messages"] == [question]


# --------------------------------------------------------------------------- defect 3


async def test_passthrough_in_maintenance_is_a_503_and_never_reaches_a_backend(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fake_upstream.handlers["/v1/embeddings"] = lambda r: asyncio.sleep(
        0, web.json_response({"data": []})
    )
    proxy = await start_proxy(policy(fake_upstream.url, maintenance=True))
    proxy.app[STATE].current.force_tier("maintenance")
    seen = len(fake_upstream.requests)
    async with proxy.session.post(
        proxy.url + "/v1/embeddings", json={"model": "tiny", "input": "x"}
    ) as r:
        assert r.status == 503
        assert r.headers["Retry-After"] == "30"
        assert r.headers["X-Brownout-Backend"] == "maintenance"
        err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "service_unavailable"
    assert [p for p, _, _ in fake_upstream.requests[seen:] if p == "/v1/embeddings"] == []


async def test_passthrough_goes_through_admission(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    gate = asyncio.Event()

    async def hold(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        await resp.write(chunk("held "))
        await gate.wait()
        await resp.write(chunk("", "stop") + DONE)
        return resp

    fake_upstream.handlers[CHAT] = hold
    fake_upstream.handlers["/v1/embeddings"] = lambda r: asyncio.sleep(
        0, web.json_response({"data": []})
    )
    throttle = {"ladder": {"throttle": {"max_inflight": 1, "queue_size": 0}}}
    proxy = await start_proxy(policy(fake_upstream.url, extra=throttle))
    held = await proxy.session.post(proxy.url + CHAT, json=CHAT_BODY)
    await held.content.readany()
    async with proxy.session.post(proxy.url + "/v1/embeddings", json={"input": "x"}) as r:
        assert r.status == 429
        assert "Retry-After" in r.headers
        assert (await r.json())["error"]["code"] == "rate_limit_exceeded"
    assert [p for p, _, _ in fake_upstream.requests if p == "/v1/embeddings"] == []
    gate.set()
    await held.read()
    async with proxy.session.post(proxy.url + "/v1/embeddings", json={"input": "x"}) as r:
        assert r.status == 200
        assert await r.json() == {"data": []}


async def test_passthrough_never_follows_a_backend_redirect(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def redirect(request: web.Request) -> web.Response:
        return web.Response(status=307, headers={"Location": fake_upstream.url + "/v1/other"})

    async def other(request: web.Request) -> web.Response:
        return web.json_response({"followed": True})

    # (A trailing slash never reaches a backend: ingress answers it. A backend
    # may still redirect a canonical path.)
    fake_upstream.handlers["/v1/models/old-name"] = redirect
    fake_upstream.handlers["/v1/other"] = other
    proxy = await start_proxy(policy(fake_upstream.url))
    async with proxy.session.get(proxy.url + "/v1/models/old-name", allow_redirects=False) as r:
        assert r.status == 307
        # Relative: the client's next request comes through the proxy again.
        assert r.headers["Location"] == "/v1/other"
    assert [p for p, _, _ in fake_upstream.requests if p == "/v1/other"] == []


async def test_passthrough_failure_before_the_answer_moves_to_the_fallback(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fake_upstream.handlers["/v1/embeddings"] = lambda r: asyncio.sleep(
        0, web.json_response({"error": {"message": "engine died", "code": 500}}, status=500)
    )
    fallback_upstream.handlers["/v1/embeddings"] = lambda r: asyncio.sleep(
        0, web.json_response({"data": [1]})
    )
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    with structlog.testing.capture_logs() as logs:
        async with proxy.session.post(proxy.url + "/v1/embeddings", json={"input": "x"}) as r:
            assert r.status == 200
            assert r.headers["X-Brownout-Backend"] == "fallback"
            assert await r.json() == {"data": [1]}
    [line] = request_lines(logs)
    assert line["endpoint"] == "passthrough"
    m = await metrics(proxy)
    # "engine died": the backend's, definitively (no retry, no probe asked).
    assert total(m, "brownout_upstream_errors_total", backend="primary", kind="engine_dead") == 1
    assert total(m, "brownout_requests_total", endpoint="passthrough", backend="fallback") == 1


async def test_passthrough_guard_stops_chat_chunks_and_leaves_other_formats_alone(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    responses_events = (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"delta":"hi\\u0007"}\n\n'
    )

    async def custom_chat(request: web.Request) -> web.StreamResponse:
        return await stream_words(request, ["fine ", "bad\u0007"])

    async def responses(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        await resp.write(responses_events)
        return resp

    fake_upstream.handlers["/v1/custom/chat"] = custom_chat
    fake_upstream.handlers["/v1/responses"] = responses
    proxy = await start_proxy(policy(fake_upstream.url))
    async with proxy.session.post(proxy.url + "/v1/custom/chat", json={"stream": True}) as r:
        raw = await r.read()
    data = events_of(raw)
    assert json.loads(data[-2])["error"]["code"] == "invalid_output"
    assert data[-1] == b"[DONE]"
    async with proxy.session.post(proxy.url + "/v1/responses", json={"stream": True}) as r:
        assert r.status == 200
        assert await r.read() == responses_events  # byte for byte


# --------------------------------------------------------------------------- defect 8


async def test_an_endless_event_ends_the_stream_in_band(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        await resp.write(chunk("start "))
        for _ in range(64):  # 64 × 4 KiB without a blank line
            await resp.write(b"x" * 4096)
        await asyncio.sleep(10)
        return resp

    fake_upstream.handlers[CHAT] = endless
    extra = {"server": {"max_event_bytes": 65536}}
    proxy = await start_proxy(policy(fake_upstream.url, extra=extra))
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as r:
        assert r.status == 200
        raw = await asyncio.wait_for(r.read(), 5)
    data = events_of(raw)
    assert json.loads(data[0])["choices"][0]["delta"]["content"] == "start "
    assert json.loads(data[-2])["error"]["code"] == "upstream_event_too_large"
    assert data[-1] == b"[DONE]"
    m = await metrics(proxy)
    assert total(m, "brownout_stream_errors_total", reason="event_too_large") == 1


async def test_an_answer_over_the_keep_bound_is_relayed_but_not_saved(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    words = [f"w{i} " for i in range(400)]

    async def long_answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        for w in words:
            await resp.write(chunk(w))
            await asyncio.sleep(0)
        await resp.write(chunk("", "stop") + DONE)
        return resp

    fake_upstream.handlers[CHAT] = long_answer
    proxy = await start_proxy(policy(fake_upstream.url, extra={"server": {"max_kept_bytes": 4096}}))
    async with proxy.session.post(
        proxy.url + CHAT, json=CHAT_BODY, headers={"X-Session-Id": "long-1"}
    ) as r:
        raw = await r.read()
    texts = [json.loads(d)["choices"][0]["delta"]["content"] for d in events_of(raw)[:-1]]
    assert "".join(texts) == "".join(words)
    rt = proxy.app[STATE].current
    key = session_key(rt.policy.sessions.key_prefix, "long-1", None)
    assert await rt.store.load(key) == []


async def test_events_of_several_data_lines_in_a_burst_are_relayed(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """SSE lets an event be several `data:` lines. A burst of such events, each
    a content chunk between two other lines, taught the run scanner an
    envelope with newlines: the C scanner raised ValueError and the client got
    `internal_error` in place of the whole answer."""
    other = b'data: {"choices": [{"index": 0, "x": 1}]}\n'
    head = chunk("")[: chunk("").index(b'"content": "') + len(b'"content": "')]
    tail = b'"}}]}\ndata: {"finish_reason":null}\n\n'
    words = [f"w{i} " for i in range(80)]

    async def two_lines(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        for burst in (words[:40], words[40:]):
            await resp.write(b"".join(other + head + w.encode() + tail for w in burst))
            await asyncio.sleep(0.02)
        await resp.write(DONE)
        return resp

    fake_upstream.handlers[CHAT] = two_lines
    proxy = await start_proxy(policy(fake_upstream.url))
    async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as r:
        assert r.status == 200
        raw = await asyncio.wait_for(r.read(), 5)
    assert b"internal_error" not in raw
    data = events_of(raw)
    assert data[-1] == b"[DONE]"
    texts = [json.loads(d.split(b"\n")[1])["choices"][0]["delta"]["content"] for d in data[:-1]]
    assert "".join(texts) == "".join(words)


# --------------------------------------------------------------------------- defect 9


async def test_trimming_with_tokenize_costs_a_bounded_few_calls(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    calls = 0

    async def tokenize(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        body = json.loads(await request.read())
        n = sum(len(str(m.get("content", ""))) // 4 + 4 for m in body["messages"])
        return web.json_response({"count": n, "max_model_len": 4096})

    seen: list[int] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(len(json.loads(await request.read())["messages"]))
        return await stream_words(request, ["ok"])

    fake_upstream.handlers["/tokenize"] = tokenize
    fake_upstream.handlers[CHAT] = chat
    pol = policy(fake_upstream.url, primary_extra={"model": "tiny", "max_model_len": 4096})
    proxy = await start_proxy(pol)
    history = []
    for i in range(500):
        history += [
            {"role": "user", "content": f"question {i} " * 8},
            {"role": "assistant", "content": f"answer {i} " * 8},
        ]
    body = {**CHAT_BODY, "messages": [*history, {"role": "user", "content": "now?"}]}
    async with proxy.session.post(proxy.url + CHAT, json=body) as r:
        assert r.status == 200
        await r.read()
    assert 0 < calls <= 24  # 1,001 messages; one call each before
    assert seen and seen[0] < len(body["messages"])  # trimmed


async def test_the_first_byte_deadline_covers_trimming(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def slow_tokenize(request: web.Request) -> web.Response:
        await asyncio.sleep(0.3)
        body = json.loads(await request.read())
        return web.json_response({"count": 50 * len(body["messages"])})

    fake_upstream.handlers["/tokenize"] = slow_tokenize
    fake_upstream.handlers[CHAT] = lambda r: stream_words(r, ["late"])
    pol = policy(
        fake_upstream.url,
        primary_extra={"model": "tiny", "max_model_len": 2048, "timeouts": {"first_byte_s": 0.5}},
    )
    proxy = await start_proxy(pol)
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "x" * 200} for i in range(41)
    ]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with proxy.session.post(proxy.url + CHAT, json={**CHAT_BODY, "messages": messages}) as r:
        assert r.status == 504
        assert (await r.json())["error"]["code"] == "upstream_timeout"
    assert loop.time() - t0 < 1.5
    assert [p for p, _, _ in fake_upstream.requests if p == CHAT] == []


# --------------------------------------------------------------------------- defect 11


async def test_a_client_leaving_before_the_first_byte_is_counted_and_logged(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    arrived = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        arrived.set()
        await asyncio.sleep(5)
        return await stream_words(request, ["late"])

    fake_upstream.handlers[CHAT] = slow
    proxy = await start_proxy(policy(fake_upstream.url, extra={"server": {"heartbeat_s": 0}}))
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(proxy.session.post(proxy.url + CHAT, json=CHAT_BODY))
        await arrived.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: bool(request_lines(logs)))
    [line] = request_lines(logs)
    assert line["outcome"] == "client_disconnect"
    assert line["status"] == 499 and line["backend"] == "primary"
    m = await metrics(proxy)
    assert total(m, "brownout_client_disconnects_total", backend="primary") == 1


# --------------------------------------------------------------------------- defect 12


def n2_chunk(index: int, content: str, finish: str | None = None) -> bytes:
    obj = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": index, "delta": {"content": content}, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def test_n2_stream_saves_choice_0_only(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def two_choices(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        for a, b in (("The ", "Un "), ("cat ", "chien "), ("sat.", "aboie.")):
            await resp.write(n2_chunk(0, a) + n2_chunk(1, b))
        await resp.write(n2_chunk(0, "", "stop") + n2_chunk(1, "", "stop") + DONE)
        return resp

    fake_upstream.handlers[CHAT] = two_choices
    proxy = await start_proxy(policy(fake_upstream.url))
    async with proxy.session.post(
        proxy.url + CHAT, json={**CHAT_BODY, "n": 2}, headers={"X-Session-Id": "n2"}
    ) as r:
        assert r.status == 200
        await r.read()
    rt = proxy.app[STATE].current
    stored = await rt.store.load(session_key(rt.policy.sessions.key_prefix, "n2", None))
    assert stored[-1] == {"role": "assistant", "content": "The cat sat."}


async def test_n2_stream_is_not_rescued(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        await resp.write(n2_chunk(0, "The ") + n2_chunk(1, "Un "))
        assert request.transport is not None
        request.transport.close()
        return resp

    fake_upstream.handlers[CHAT] = cut
    fallback_upstream.handlers[CHAT] = lambda r: stream_words(r, ["rescued?"])
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    async with proxy.session.post(proxy.url + CHAT, json={**CHAT_BODY, "n": 2}) as r:
        raw = await r.read()
    data = events_of(raw)
    assert json.loads(data[-2])["error"]["code"] == "upstream_disconnect"
    assert data[-1] == b"[DONE]"
    assert [p for p, _, _ in fallback_upstream.requests if p == CHAT] == []


# --------------------------------------------------------------------------- defect 13


async def test_dropped_malformed_events_are_aggregated_per_request(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def junk(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE)
        await resp.prepare(request)
        await resp.write(chunk("ok "))
        for _ in range(20):
            await resp.write(b"data: {not json\n\n" * 50)
        await resp.write(chunk("", "stop") + DONE)
        return resp

    fake_upstream.handlers[CHAT] = junk
    proxy = await start_proxy(policy(fake_upstream.url))
    with structlog.testing.capture_logs() as logs:
        async with proxy.session.post(proxy.url + CHAT, json=CHAT_BODY) as r:
            raw = await r.read()
    assert b"not json" not in raw
    mine = [e for e in logs if e.get("request_id") == r.headers["X-Request-Id"]]
    assert [e["event"] for e in mine] == ["request"]
    [note] = mine[0]["guard_notes"]
    assert note["rule"] == "malformed" and note["count"] == 1000
    m = await metrics(proxy)
    assert total(m, "brownout_guard_notes_total", rule="malformed") == 1000


async def test_health_probes_never_follow_a_redirect(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def moved(request: web.Request) -> web.Response:
        return web.Response(status=307, headers={"Location": "/elsewhere"})

    async def elsewhere(request: web.Request) -> web.Response:
        return web.Response(status=200)

    fake_upstream.handlers["/health"] = moved
    fake_upstream.handlers["/elsewhere"] = elsewhere
    proxy = await start_proxy(policy(fake_upstream.url))
    health = proxy.app[STATE].current.upstreams["primary"].health
    await wait_until(lambda: health.last_probe_at is not None)
    assert health.healthy is False
    assert health.last_error == "health returned HTTP 307"
    assert [p for p, _, _ in fake_upstream.requests if p == "/elsewhere"] == []


async def test_a_200_carrying_an_error_object_is_a_failure_not_an_answer(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """A non-streaming 200 whose body is `{"error": ...}` (no choices) counts
    against the primary's breaker and moves to the fallback — it must not
    close a half-open breaker as a 'successful trial'."""

    async def error_200(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "boom", "type": "server_error"}})

    fake_upstream.handlers[CHAT] = error_200
    fallback_upstream.handlers[CHAT] = fallback_answer
    extra = {"ladder": {"failover": {"retry_max": 0}}}
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=extra))
    async with proxy.session.post(proxy.url + CHAT, json={**CHAT_BODY, "stream": False}) as r:
        assert r.status == 200
        assert r.headers["X-Brownout-Backend"] == "fallback"
        assert (await r.json())["choices"][0]["message"]["content"] == "from the fallback"
    m = await metrics(proxy)
    assert total(m, "brownout_upstream_errors_total", backend="primary") == 1


async def test_an_event_stream_for_a_json_request_is_a_failure_not_a_502(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """A backend that answers `stream: false` with `text/event-stream` is
    broken: nothing reached the client, so the fallback answers (before, the
    client got 502 invalid_output and the primary's breaker saw nothing)."""

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("Hello") + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    fake_upstream.handlers[CHAT] = sse
    fallback_upstream.handlers[CHAT] = fallback_answer
    extra = {"ladder": {"failover": {"retry_max": 0}}}
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=extra))
    async with proxy.session.post(proxy.url + CHAT, json={**CHAT_BODY, "stream": False}) as r:
        assert r.status == 200
        assert r.headers["X-Brownout-Backend"] == "fallback"
        assert (await r.json())["choices"][0]["message"]["content"] == "from the fallback"
    m = await metrics(proxy)
    assert total(m, "brownout_upstream_errors_total", backend="primary") == 1


async def test_an_overloaded_503_with_retry_after_never_opens_the_breaker(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """The fallback server says "over capacity" with 503 + Retry-After. Counted
    as a fault, a burst opened a healthy fallback's breaker and sent users to
    maintenance (chaos drill 6). Load is not a broken backend: the breaker
    stays closed and the client gets the 503; a 503 without Retry-After still
    counts."""

    async def busy(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "over capacity", "type": "server_error", "code": "overloaded"}},
            status=503,
            headers={"Retry-After": "1"},
        )

    async def broken(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "boom"}}, status=503)

    fake_upstream.handlers[CHAT] = busy
    extra = {"ladder": {"failover": {"retry_max": 0}, "breaker": {"fail_max": 2}}}
    proxy = await start_proxy(policy(fake_upstream.url, None, extra=extra))
    up = proxy.app[STATE].current.upstreams["primary"]
    for _ in range(4):
        async with proxy.session.post(proxy.url + CHAT, json={**CHAT_BODY, "stream": False}) as r:
            assert r.status == 503
            await r.read()
    assert up.breaker.state == "closed"
    fake_upstream.handlers[CHAT] = broken
    for _ in range(2):
        async with proxy.session.post(proxy.url + CHAT, json={**CHAT_BODY, "stream": False}) as r:
            await r.read()
    # The second 503 sends the recovery probe (503 too), which opens it.
    await wait_until(lambda: up.breaker.state == "open")
