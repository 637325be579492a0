"""The degradation ladder end to end: real sockets, two fault-injecting fakes.

Each test starts the real proxy in front of a scriptable primary (vLLM-like)
and fallback (Transformers-like) and checks what a client sees (status,
`X-Brownout-*` headers, bytes and SSE events, the official `openai` client's
behaviour), what each fake received, and what `/brownout/status` and
`/metrics` report. Timings are shrunk in the policy so that detection,
dwell, healthy windows and ramp steps take fractions of a second; waiting is
always a poll with a deadline, never a fixed long sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import yaml
from aiohttp import web
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from proxy.openai.sse import SSEParser
from proxy.policy import Policy, parse_policy
from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    ProxyFactory,
    RunningProxy,
    chunk,
    free_port,
)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
ROLE_CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
)
DONE = b"data: [DONE]\n\n"
# What vLLM sends in a stream when its engine dies (after the 200 went out).
ENGINE_DEAD_EVENT = (
    b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace '
    b'(above) for the root cause.", "type": "InternalServerError", "param": null, '
    b'"code": 500}}\n\n'
)
VLLM_503 = {
    "error": {
        "message": "The engine is overloaded",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
}
VLLM_500 = {
    "error": {
        "message": "EngineCore encountered an issue.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
PRIMARY_TEXT = ["from ", "the ", "primary"]
FALLBACK_TEXT = ["from ", "the ", "fallback"]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --------------------------------------------------------------------------- fakes


@dataclass
class Fake(FakeUpstream):
    """A `FakeUpstream` that can be stopped (connections refused) and started
    again on the same port, with a scriptable `/health` status."""

    runner: web.AppRunner | None = None
    health_status: int = 200

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        # handler_cancellation: a stalled handler dies with the proxy's connection.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.runner = runner

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=self.health_status)

    def chat_bodies(self) -> list[dict[str, Any]]:
        return [json.loads(b) for p, _, b in self.requests if p == "/v1/chat/completions"]


FakeFactory = Callable[[], Awaitable[Fake]]
# What Brownout adds to every stream for its token counters (issue 23).
ASKED = {"stream_options": {"include_usage": True}}


@pytest.fixture
async def fakes() -> AsyncIterator[FakeFactory]:
    """Any number of fake upstreams (the conftest fixture gives only one)."""
    made: list[Fake] = []

    async def factory() -> Fake:
        fake = Fake(free_port())
        fake.handlers["/health"] = fake._health
        await fake.start()
        made.append(fake)
        return fake

    yield factory
    for fake in made:
        await fake.stop()


def sse_words(words: list[str]) -> bytes:
    return ROLE_CHUNK + b"".join(chunk(w) for w in words) + chunk("", "stop") + DONE


def answering(words: list[str]) -> Handler:
    """A healthy backend: the words as a stream, or as one chat.completion."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("stream"):
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            await resp.write(sse_words(words))
            return resp
        return web.json_response(
            {
                "id": "chatcmpl-2",
                "object": "chat.completion",
                "created": 1,
                "model": "tiny",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(words)},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    return handler


def failing(status: int, body: dict[str, Any]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=status)

    return handler


def cut_after(prefix: bytes) -> Handler:
    """A stream that sends `prefix` and then drops the TCP connection."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(prefix)
        await asyncio.sleep(0.05)  # let the proxy relay the bytes first
        assert request.transport is not None
        request.transport.abort()  # no chunked terminator: a lost connection
        return resp

    return handler


def streaming(raw: bytes) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(raw)
        return resp

    return handler


# --------------------------------------------------------------------------- policy


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
    return base


def ladder_policy(primary: str, fallback: str | None, *extras: str) -> Policy:
    """A policy with every ladder timing shrunk; each `extras` YAML is merged in."""

    def backend(url: str, kind: str) -> dict[str, Any]:
        return {
            "url": url,
            "kind": kind,
            "timeouts": {"connect_s": 1, "first_byte_s": 2, "idle_s": 1},
            "health": {"interval_s": 0.05, "timeout_s": 0.5},
        }

    doc: dict[str, Any] = {
        # No heartbeats: a ping would commit the response before a retry
        # could happen.
        "server": {"heartbeat_s": 0},
        "backends": {"primary": backend(primary, "vllm")},
        "ladder": {
            # These drills are about failover: a transient failure goes to the
            # other backend at once (same-backend retries: test_retry_flow.py).
            "failover": {"retry_max": 0},
            "recovery": {
                "window_s": 0.05,
                "min_dwell_s": 0.3,
                "healthy_windows": 2,
                "ramp": [0.25, 0.5, 1.0],
                "ramp_step_s": 0.2,
            },
            "breaker": {
                "fail_max": 3,
                "reset_timeout_s": 0.3,
                "failure_rate": 0.3,
                "min_calls": 10,
                "window_s": 10,
            },
        },
    }
    if fallback is not None:
        doc["backends"]["fallback"] = backend(fallback, "transformers")
    for extra in extras:
        _merge(doc, yaml.safe_load(extra))
    return parse_policy(yaml.safe_dump(doc), "ladder-test.yaml")


def refused_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


# --------------------------------------------------------------------------- client side


async def get_status(proxy: RunningProxy) -> dict[str, Any]:
    async with proxy.session.get(proxy.url + "/brownout/status") as resp:
        assert resp.status == 200
        data: dict[str, Any] = await resp.json()
        return data


async def wait_status(
    proxy: RunningProxy,
    pred: Callable[[dict[str, Any]], bool],
    what: str,
    within: float = 4.0,
) -> dict[str, Any]:
    """Poll /brownout/status until `pred` holds (or fail with the last one)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        st = await get_status(proxy)
        if pred(st):
            return st
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last status: {json.dumps(st)}")
        await asyncio.sleep(0.02)


async def wait_tier(proxy: RunningProxy, tier: str, within: float = 4.0) -> dict[str, Any]:
    return await wait_status(proxy, lambda s: s["tier"] == tier, f"tier {tier}", within)


def edges(st: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(t["from"], t["to"], t["reason"]) for t in st["history"]]


async def metric(proxy: RunningProxy, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of /metrics (0 when the labelled child does not exist yet)."""
    async with proxy.session.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    want = labels or {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in want.items()):
                return float(s.value)
    return 0.0


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    raw: bytes

    @property
    def backend(self) -> str:
        return self.headers["X-Brownout-Backend"]

    @property
    def tier(self) -> str:
        return self.headers["X-Brownout-Tier"]

    def events(self) -> list[bytes]:
        """`data` of every event (comments excluded)."""
        return [e.data for e in SSEParser().feed(self.raw) if e.data is not None]

    def text(self) -> str:
        """The answer text, from a stream or a chat.completion."""
        if self.headers.get("Content-Type", "").startswith("text/event-stream"):
            out = []
            for d in self.events():
                if d == b"[DONE]":
                    continue
                obj = json.loads(d)
                assert "error" not in obj, obj
                for c in obj["choices"]:
                    out.append(c["delta"].get("content") or "")
            return "".join(out)
        content: str = json.loads(self.raw)["choices"][0]["message"]["content"]
        return content


async def ask(proxy: RunningProxy, stream: bool = True, **extra: Any) -> Reply:
    body = {**CHAT_BODY, "stream": stream, **extra}
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=body) as resp:
        raw = await resp.read()
        return Reply(resp.status, dict(resp.headers), raw)


def oai(proxy: RunningProxy, max_retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=proxy.url + "/v1", api_key="sk-test", max_retries=max_retries, timeout=10
    )


async def oai_stream(
    client: openai.AsyncOpenAI, pieces: list[str], **extra: Any
) -> tuple[dict[str, str], str | None]:
    """Stream a chat through the openai client, collecting content into `pieces`
    (so a caller still sees them when the stream raises); returns the
    response headers and the last finish_reason."""
    raw = await client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=MESSAGES,
        stream=True,
        **extra,
    )
    headers = dict(raw.headers)
    finish: str | None = None
    stream = raw.parse()
    async for c in stream:
        for choice in c.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    return headers, finish


# =========================================================================== 1


async def test_refused_primary_fails_over_to_fallback(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    fallback = await fakes()
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    proxy = await start_proxy(ladder_policy(refused_url(), fallback.url))

    # Whether or not the ladder has moved yet, the client is answered.
    first = await ask(proxy)
    assert first.status == 200
    assert first.backend == "fallback"
    assert first.text() == "from the fallback"

    st = await wait_tier(proxy, "failover")
    assert edges(st) == [("normal", "failover", "primary_down")]
    assert "connection failed" in st["history"][0]["detail"]
    assert st["backends"]["primary"]["healthy"] is False
    assert st["backends"]["primary"]["down"] is True
    assert st["backends"]["fallback"]["healthy"] is True

    r = await ask(proxy)
    assert r.status == 200
    assert (r.backend, r.tier) == ("fallback", "failover")
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert r.events()[-1] == b"[DONE]"
    assert r.text() == "from the fallback"
    r = await ask(proxy, stream=False)
    assert (r.status, r.backend, r.text()) == (200, "fallback", "from the fallback")
    assert len(fallback.chat_bodies()) == 3
    labels = {"from": "normal", "to": "failover", "reason": "primary_down"}
    assert await metric(proxy, "brownout_tier_transitions_total", labels) == 1


# =========================================================================== 2


async def test_503_storm_opens_breaker_and_every_request_is_answered(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    primary.handlers["/v1/chat/completions"] = failing(503, VLLM_503)  # recovery probes too
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url))

    for i in range(1, 3):
        r = await ask(proxy, stream=False)
        assert (r.status, r.backend, r.text()) == (200, "fallback", "from the fallback")
        st = await get_status(proxy)
        assert st["tier"] == "normal"
        assert st["backends"]["primary"]["breaker"] == "closed"
        assert st["backends"]["primary"]["breaker_detail"]["consecutive_failures"] == i

    # fail_max = 3: the third 503 opens the breaker; the request is still answered.
    r = await ask(proxy, stream=False)
    assert (r.status, r.backend, r.text()) == (200, "fallback", "from the fallback")
    st = await wait_tier(proxy, "failover", within=1.0)
    assert edges(st) == [("normal", "failover", "primary_down")]
    assert "breaker open" in st["history"][0]["detail"]
    assert st["backends"]["primary"]["breaker"] in ("open", "half-open")
    assert st["backends"]["primary"]["healthy"] is True  # /health never failed

    for stream in (True, False):
        r = await ask(proxy, stream=stream)
        assert (r.status, r.backend, r.tier) == (200, "fallback", "failover")
        assert r.text() == "from the fallback"

    def probes() -> list[dict[str, Any]]:
        return [b for b in primary.chat_bodies() if b["messages"][0]["content"] == "ping"]

    # Nothing but recovery probes after the breaker opened.
    assert len(primary.chat_bodies()) - len(probes()) == 3
    assert len(fallback.chat_bodies()) == 5
    assert await metric(proxy, "brownout_retries_total", {"from": "primary", "to": "fallback"}) == 3
    errors = {"backend": "primary", "kind": "http_503"}
    assert await metric(proxy, "brownout_upstream_errors_total", errors) == 3
    opened = {"backend": "primary", "from": "closed", "to": "open"}
    assert await metric(proxy, "brownout_breaker_transitions_total", opened) == 1

    # After reset_timeout_s a recovery probe (a 1-token chat) tests the
    # primary; while it fails, the breaker re-opens and the tier holds.
    await wait_status(proxy, lambda s: len(probes()) >= 1, "a recovery probe")
    assert probes()[0]["max_tokens"] == 1
    st = await wait_status(
        proxy, lambda s: s["backends"]["primary"]["breaker"] == "open", "breaker re-opened"
    )
    assert st["tier"] == "failover"

    # The storm ends: the next probe closes the breaker, the ladder comes back.
    primary.handlers["/v1/chat/completions"] = answering(PRIMARY_TEXT)
    st = await wait_status(
        proxy, lambda s: s["tier"] == "normal" and s["ladder"]["ramp"] is None, "recovery"
    )
    assert st["backends"]["primary"]["breaker"] == "closed"
    assert edges(st) == [
        ("normal", "failover", "primary_down"),
        ("failover", "throttle", "recovered"),
        ("throttle", "normal", "recovered"),
    ]
    r = await ask(proxy)
    assert (r.status, r.backend, r.tier, r.text()) == (200, "primary", "normal", "from the primary")


# =========================================================================== 3


async def test_one_5xx_is_retried_on_fallback_and_tier_stays_normal(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    healthy = answering(PRIMARY_TEXT)
    calls = 0

    async def once_500(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:
            return web.json_response(VLLM_500, status=500)
        return await healthy(request)

    primary.handlers["/v1/chat/completions"] = once_500
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url))

    r = await ask(proxy)
    assert r.status == 200
    assert (r.backend, r.tier) == ("fallback", "normal")
    assert r.text() == "from the fallback"
    assert r.events()[-1] == b"[DONE]"
    # The fallback got the client's request as sent (and Brownout's question
    # for the stream's token usage, issue 23).
    assert fallback.chat_bodies() == [{**CHAT_BODY, **ASKED}]

    r = await ask(proxy)
    assert (r.status, r.backend, r.tier) == (200, "primary", "normal")
    assert r.text() == "from the primary"

    st = await get_status(proxy)
    assert st["tier"] == "normal"
    assert st["history"] == []
    assert st["backends"]["primary"]["breaker"] == "closed"
    assert st["backends"]["primary"]["breaker_detail"]["consecutive_failures"] == 0
    assert len(primary.chat_bodies()) == 2
    assert len(fallback.chat_bodies()) == 1
    assert await metric(proxy, "brownout_retries_total", {"from": "primary", "to": "fallback"}) == 1


# =========================================================================== 4


@pytest.mark.parametrize("headers_first", [False, True], ids=["silent", "headers-then-silent"])
async def test_stall_before_first_byte_is_retried_on_fallback(
    fakes: FakeFactory, start_proxy: ProxyFactory, headers_first: bool
) -> None:
    primary, fallback = await fakes(), await fakes()

    async def stall(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        if headers_first:
            await resp.prepare(request)
        await asyncio.sleep(5)  # cancelled when the proxy gives up on it
        return resp

    primary.handlers["/v1/chat/completions"] = stall
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    extra = "backends: {primary: {timeouts: {first_byte_s: 0.3}}}"
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url, extra))

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    r = await ask(proxy)
    elapsed = loop.time() - t0
    assert r.status == 200
    assert (r.backend, r.tier) == ("fallback", "normal")
    assert r.text() == "from the fallback"
    assert r.events()[-1] == b"[DONE]"
    assert 0.3 <= elapsed < 2.0, elapsed
    assert len(primary.chat_bodies()) == 1
    assert fallback.chat_bodies() == [{**CHAT_BODY, **ASKED}]
    timeouts = {"backend": "primary", "kind": "first_byte_timeout"}
    assert await metric(proxy, "brownout_upstream_errors_total", timeouts) == 1
    assert await metric(proxy, "brownout_retries_total", {"from": "primary", "to": "fallback"}) == 1


# =========================================================================== 5


async def test_stream_cut_mid_answer_is_rescued_on_fallback(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    primary.handlers["/v1/chat/completions"] = cut_after(
        ROLE_CHUNK + chunk("The ") + chunk("quick ") + chunk("brown")
    )
    fallback.handlers["/v1/chat/completions"] = streaming(
        ROLE_CHUNK + chunk(" fox ") + chunk("jumps.") + chunk("", "stop") + DONE
    )
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url))

    pieces: list[str] = []
    async with oai(proxy) as client:
        headers, finish = await oai_stream(client, pieces, max_tokens=20)
    # One uninterrupted answer: the primary's three chunks, then the continuation.
    assert pieces == ["The ", "quick ", "brown", " fox ", "jumps."]
    assert finish == "stop"
    assert headers["x-brownout-backend"] == "primary"  # the stream started there
    assert headers["x-brownout-tier"] == "normal"

    sent = fallback.chat_bodies()
    assert len(sent) == 1
    cont = sent[0]
    assert cont["messages"] == [
        *MESSAGES,
        {"role": "assistant", "content": "The quick brown"},
    ]
    assert cont["continue_final_message"] is True
    assert cont["add_generation_prompt"] is False
    assert cont["max_tokens"] == 17  # 20 minus the 3 chunks already produced
    assert cont["stream"] is True
    assert cont["model"] == "tiny"
    assert await metric(proxy, "brownout_stream_rescues_total", {"outcome": "rescued"}) == 1

    # The same on the wire: an SSE comment marks the seam, no error anywhere.
    r = await ask(proxy, max_tokens=20)
    assert r.status == 200
    assert r.raw.startswith(ROLE_CHUNK + chunk("The ") + chunk("quick ") + chunk("brown"))
    assert b"\n: brownout-rescue " in r.raw
    assert r.raw.index(b": brownout-rescue") < r.raw.index(b"fox")
    assert r.raw.endswith(chunk("", "stop") + DONE)
    assert b'"error"' not in r.raw
    assert r.text() == "The quick brown fox jumps."
    assert await metric(proxy, "brownout_stream_rescues_total", {"outcome": "rescued"}) == 2
    assert await metric(proxy, "brownout_stream_rescues_total", {"outcome": "failed"}) == 0
    lost = {"backend": "primary", "kind": "upstream_disconnect"}
    assert await metric(proxy, "brownout_upstream_errors_total", lost) == 2


# =========================================================================== 6


async def test_engine_error_event_mid_stream_is_rescued(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    primary.handlers["/v1/chat/completions"] = streaming(
        ROLE_CHUNK + chunk("Paris ") + chunk("is ") + ENGINE_DEAD_EVENT + DONE
    )
    fallback.handlers["/v1/chat/completions"] = streaming(
        chunk("the capital.") + chunk("", "stop") + DONE
    )
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url))

    pieces: list[str] = []
    async with oai(proxy) as client:
        headers, finish = await oai_stream(client, pieces, max_tokens=10)
    assert pieces == ["Paris ", "is ", "the capital."]
    assert finish == "stop"
    assert headers["x-brownout-backend"] == "primary"

    (cont,) = fallback.chat_bodies()
    assert cont["messages"][-1] == {"role": "assistant", "content": "Paris is "}
    assert cont["messages"][:-1] == MESSAGES
    assert cont["continue_final_message"] is True
    assert cont["add_generation_prompt"] is False
    assert cont["max_tokens"] == 8
    assert await metric(proxy, "brownout_stream_rescues_total", {"outcome": "rescued"}) == 1
    # vLLM's engine-death event: the backend's, definitively (no probe asked).
    engine = {"backend": "primary", "kind": "engine_dead"}
    assert await metric(proxy, "brownout_upstream_errors_total", engine) == 1
    charged = {"backend": "primary", "attribution": "backend", "fault": "engine_dead"}
    assert await metric(proxy, "brownout_failures_total", charged) == 1


async def test_rescue_that_fails_too_ends_with_an_explicit_error(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    primary.handlers["/v1/chat/completions"] = streaming(
        ROLE_CHUNK + chunk("Paris ") + chunk("is ") + ENGINE_DEAD_EVENT + DONE
    )
    fallback.handlers["/v1/chat/completions"] = cut_after(chunk("the "))
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url))

    pieces: list[str] = []
    async with oai(proxy) as client:
        with pytest.raises(openai.APIError) as info:
            await oai_stream(client, pieces, max_tokens=10)
    # An in-band error event (plain APIError), not a dropped connection
    # (APIConnectionError) and not a silently shortened "success".
    assert type(info.value) is openai.APIError
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == "upstream_disconnect"
    assert pieces == ["Paris ", "is ", "the "]
    assert len(fallback.chat_bodies()) == 1
    assert await metric(proxy, "brownout_stream_rescues_total", {"outcome": "failed"}) == 1
    assert await metric(proxy, "brownout_stream_rescues_total", {"outcome": "rescued"}) == 0


# =========================================================================== 7


async def test_cut_stream_without_rescue_ends_with_error_event(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    primary.handlers["/v1/chat/completions"] = cut_after(
        ROLE_CHUNK + chunk("The ") + chunk("quick ") + chunk("brown")
    )
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    extra = "ladder: {failover: {rescue_streams: false}}"
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url, extra))

    pieces: list[str] = []
    async with oai(proxy) as client:
        with pytest.raises(openai.APIError) as info:
            await oai_stream(client, pieces)
    assert type(info.value) is openai.APIError
    assert isinstance(info.value.body, dict)
    assert info.value.body["code"] == "upstream_disconnect"
    assert pieces == ["The ", "quick ", "brown"]

    r = await ask(proxy)
    assert r.status == 200
    assert b"brownout-rescue" not in r.raw
    data = r.events()
    assert data[-1] == b"[DONE]"
    err = json.loads(data[-2])["error"]
    assert err["code"] == "upstream_disconnect"
    assert err["type"] == "server_error"
    sent = ROLE_CHUNK + chunk("The ") + chunk("quick ") + chunk("brown")
    assert data[:-2] == [e.data for e in SSEParser().feed(sent)]
    assert fallback.chat_bodies() == []
    assert await metric(proxy, "brownout_stream_rescues_total", {"outcome": "rescued"}) == 0


# =========================================================================== 8


async def test_context_length_400_is_propagated_without_failover(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    body = json.dumps(
        {
            "error": {
                "message": "This model's maximum context length is 2048 tokens. However, you "
                "requested 4107 tokens (4007 in the messages, 100 in the completion).",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        }
    ).encode()

    async def bad_request(request: web.Request) -> web.StreamResponse:
        return web.Response(status=400, body=body, content_type="application/json")

    primary.handlers["/v1/chat/completions"] = bad_request
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url))

    for stream in (False, True):
        r = await ask(proxy, stream=stream)
        assert r.status == 400
        assert r.raw == body
        assert r.headers["Content-Type"].startswith("application/json")
        assert (r.backend, r.tier) == ("primary", "normal")
    async with oai(proxy, max_retries=2) as client:
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await client.chat.completions.create(model="tiny", messages=MESSAGES)

    assert len(primary.chat_bodies()) == 3  # and the openai client did not retry
    assert fallback.chat_bodies() == []
    st = await get_status(proxy)
    assert st["tier"] == "normal"
    assert st["history"] == []
    assert st["backends"]["primary"]["breaker"] == "closed"
    assert st["backends"]["primary"]["breaker_detail"]["consecutive_failures"] == 0
    assert st["backends"]["primary"]["breaker_detail"]["failure_rate"] == 0
    assert await metric(proxy, "brownout_retries_total", {"from": "primary", "to": "fallback"}) == 0


# =========================================================================== 9


async def test_flapping_primary_recovers_through_the_ramp(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    primary.handlers["/v1/chat/completions"] = answering(PRIMARY_TEXT)
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    # A longer dwell than the default test timing: the flap below must fit in it.
    extra = "ladder: {recovery: {min_dwell_s: 0.5}}"
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url, extra))
    await wait_status(proxy, lambda s: s["backends"]["primary"]["healthy"] is True, "probe")
    r = await ask(proxy)
    assert (r.backend, r.tier) == ("primary", "normal")

    # The engine dies: vLLM's /health says 503.
    primary.health_status = 503
    st = await wait_tier(proxy, "failover")
    assert edges(st) == [("normal", "failover", "primary_down")]
    assert "HTTP 503" in st["history"][0]["detail"]
    r = await ask(proxy)
    assert (r.status, r.backend, r.tier) == (200, "fallback", "failover")

    # A flap inside the dwell: healthy for a moment, then the process is gone
    # (connections refused). The tier must not move.
    primary.health_status = 200
    await asyncio.sleep(0.12)
    await primary.stop()
    await wait_status(
        proxy,
        lambda s: "connection failed" in (s["backends"]["primary"]["last_error"] or ""),
        "primary refusing",
    )
    await asyncio.sleep(0.5)  # past the dwell, still down
    for stream in (True, False):
        r = await ask(proxy, stream=stream)
        assert (r.status, r.backend, r.tier) == (200, "fallback", "failover")
        assert r.text() == "from the fallback"
    st = await get_status(proxy)
    assert st["tier"] == "failover"
    assert len(st["history"]) == 1
    served_by_primary = len(primary.chat_bodies())

    # Back for good: traffic returns through the ramp.
    await primary.start()
    await wait_status(proxy, lambda s: s["ladder"]["ramp"] is not None, "ramp start")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 6
    per_step: dict[float, list[str]] = {}
    while True:
        before = (await get_status(proxy))["ladder"]
        if before["ramp"] is None and before["tier"] == "normal":
            break
        assert loop.time() < deadline, f"ramp never finished: {before}"
        batch = [await ask(proxy) for _ in range(4)]
        after = (await get_status(proxy))["ladder"]
        assert all(r.status == 200 for r in batch)
        for r in batch:
            assert r.text() == f"from the {r.backend}"
        ramp = before["ramp"]
        if ramp is None or after["ramp"] is None or after["ramp"]["step"] != ramp["step"]:
            continue  # the batch straddled a step boundary
        share = float(ramp["share"])
        assert ramp["target"] == "primary"
        to_primary = sum(r.backend == "primary" for r in batch)
        # The deterministic accumulator: never more than the step's share.
        assert to_primary <= math.ceil(share * len(batch)), (share, [r.backend for r in batch])
        per_step.setdefault(share, []).extend(r.backend for r in batch)
    # Both partial shares were seen, and each split traffic as promised.
    assert set(per_step) >= {0.25, 0.5}, per_step
    for share, backends in per_step.items():
        n = len(backends)
        assert 1 <= backends.count("primary") <= math.ceil(share * n), (share, backends)

    st = await get_status(proxy)
    assert edges(st) == [
        ("normal", "failover", "primary_down"),
        ("failover", "throttle", "recovered"),
        ("throttle", "normal", "recovered"),
    ]
    before_final = len(primary.chat_bodies())
    for _ in range(4):
        r = await ask(proxy)
        assert (r.status, r.backend, r.tier) == (200, "primary", "normal")
    assert len(primary.chat_bodies()) == before_final + 4
    assert served_by_primary == 1  # nothing reached it while it was down


async def test_error_during_ramp_rolls_back_to_failover(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    primary.handlers["/v1/chat/completions"] = failing(500, VLLM_500)
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    primary.health_status = 503
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url))
    await wait_tier(proxy, "failover")

    # /health recovers, but the engine still fails real requests.
    primary.health_status = 200
    st = await wait_status(proxy, lambda s: s["ladder"]["ramp"] is not None, "ramp start")
    assert st["ladder"]["ramp"]["target"] == "primary"
    assert st["ladder"]["ramp"]["share"] == 0.25
    hit: Reply | None = None
    for _ in range(8):
        r = await ask(proxy)
        assert r.status == 200
        assert r.text() == "from the fallback"
        if primary.chat_bodies():
            hit = r
            break
    assert hit is not None, "the ramp never sent a request to the primary"
    # That request was retried on the fallback and the ladder rolled back at once.
    assert (hit.backend, hit.tier) == ("fallback", "failover")
    st = await get_status(proxy)
    assert edges(st)[:3] == [
        ("normal", "failover", "primary_down"),
        ("failover", "throttle", "recovered"),
        ("throttle", "failover", "ramp_rollback"),
    ]
    assert len(primary.chat_bodies()) == 1
    labels = {"from": "throttle", "to": "failover", "reason": "ramp_rollback"}
    assert await metric(proxy, "brownout_tier_transitions_total", labels) == 1


# =========================================================================== 10

FAQ = """
ladder:
  maintenance:
    notice: "Brownout is down for maintenance. Back soon."
    retry_after_s: 7
faq:
  entries:
    - question: "How do I reset my password?"
      answer: "Open Settings, then Security, then Reset password."
      keywords: [password, reset]
    - question: "What are your opening hours?"
      answer: "We are open 9 to 5."
      keywords: [hours, open]
"""
PASSWORD_ANSWER = "Open Settings, then Security, then Reset password."
NOTICE = "Brownout is down for maintenance. Back soon."


async def test_both_backends_down_gives_maintenance_answers(
    start_proxy: ProxyFactory,
) -> None:
    proxy = await start_proxy(ladder_policy(refused_url(), refused_url(), FAQ))
    st = await wait_tier(proxy, "maintenance")
    assert edges(st) == [("normal", "maintenance", "fallback_down")]

    def user(q: str) -> Any:
        return [{"role": "user", "content": q}]

    async with oai(proxy) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=user("how can I reset my password?")
        )
        assert raw.http_response.status_code == 200
        assert raw.headers["x-brownout-backend"] == "maintenance"
        assert raw.headers["x-brownout-tier"] == "maintenance"
        assert raw.headers["retry-after"] == "7"
        done = raw.parse()
        assert done.object == "chat.completion"
        assert done.choices[0].message.role == "assistant"
        assert done.choices[0].message.content == PASSWORD_ANSWER
        assert done.choices[0].finish_reason == "stop"

        other = await client.chat.completions.create(
            model="tiny", messages=user("Tell me a joke about cats")
        )
        assert other.choices[0].message.content == NOTICE

        sraw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=user("I forgot my password, reset it"), stream=True
        )
        assert sraw.headers["x-brownout-backend"] == "maintenance"
        assert sraw.headers["retry-after"] == "7"
        assert sraw.headers["content-type"].startswith("text/event-stream")
        chunks = [c async for c in sraw.parse()]
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(chunks) > 3  # role, several content pieces, finish
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        PASSWORD_ANSWER
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    r = await ask(proxy, messages=[{"role": "user", "content": "opening hours?"}])
    assert (r.status, r.backend) == (200, "maintenance")
    assert r.events()[-1] == b"[DONE]"
    assert r.text() == "We are open 9 to 5."
    assert await metric(proxy, "brownout_maintenance_answers_total", {"kind": "faq"}) == 3
    assert await metric(proxy, "brownout_maintenance_answers_total", {"kind": "notice"}) == 1


async def test_maintenance_status_503_tells_clients_not_to_retry(
    start_proxy: ProxyFactory,
) -> None:
    extra = "ladder: {maintenance: {status_code: 503}}"
    proxy = await start_proxy(ladder_policy(refused_url(), refused_url(), FAQ, extra))
    await wait_tier(proxy, "maintenance")

    r = await ask(proxy, stream=False, messages=[{"role": "user", "content": "what's up?"}])
    assert r.status == 503
    assert r.headers["x-should-retry"] == "false"
    assert r.headers["Retry-After"] == "7"
    assert r.backend == "maintenance"
    assert r.text() == NOTICE

    # The openai client (with its default retries) sees the 503 and does not retry.
    async with oai(proxy, max_retries=2) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "hello"}],
            )
    assert info.value.status_code == 503
    assert await metric(proxy, "brownout_maintenance_answers_total", {"kind": "notice"}) == 2


# =========================================================================== 11


async def post_tier(
    proxy: RunningProxy, body: object, token: str | None
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with proxy.session.post(proxy.url + "/brownout/tier", json=body, headers=headers) as resp:
        data: dict[str, Any] = await resp.json()
        return resp.status, data


async def test_admin_tier_needs_a_configured_token(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    primary.handlers["/v1/chat/completions"] = answering(PRIMARY_TEXT)
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url))

    for token in (None, "", "anything"):
        status, body = await post_tier(proxy, {"tier": "maintenance"}, token)
        assert status == 403, (token, body)
        assert body["error"]["code"] == "admin_disabled"
    st = await get_status(proxy)
    assert (st["tier"], st["ladder"]["forced"], st["history"]) == ("normal", None, [])
    r = await ask(proxy)
    assert (r.backend, r.tier) == ("primary", "normal")


async def test_admin_tier_force_and_release(fakes: FakeFactory, start_proxy: ProxyFactory) -> None:
    primary, fallback = await fakes(), await fakes()
    primary.handlers["/v1/chat/completions"] = answering(PRIMARY_TEXT)
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    extra = 'server: {admin_token: "s3cret-token"}'
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url, extra, FAQ))
    await wait_status(
        proxy,
        lambda s: all(b["healthy"] for b in s["backends"].values()),
        "both backends probed healthy",
    )

    for token in (None, "", "wrong", "s3cret-token-but-longer"):
        status, body = await post_tier(proxy, {"tier": "maintenance"}, token)
        assert status == 401, (token, body)
        assert body["error"]["code"] == "unauthorized"
    st = await get_status(proxy)
    assert (st["tier"], st["ladder"]["forced"], st["history"]) == ("normal", None, [])

    status, body = await post_tier(proxy, {"tier": "maintenance"}, "s3cret-token")
    assert status == 200
    assert (body["tier"], body["ladder"]["forced"]) == ("maintenance", "maintenance")
    assert edges(body) == [("normal", "maintenance", "forced")]

    for stream in (True, False):
        r = await ask(proxy, stream=stream)
        assert (r.status, r.backend, r.tier) == (200, "maintenance", "maintenance")
        assert r.headers["Retry-After"] == "7"
        assert r.text() == NOTICE
    # A force holds past the dwell although every signal is healthy.
    await asyncio.sleep(0.5)
    st = await get_status(proxy)
    assert st["tier"] == "maintenance"
    assert len(st["history"]) == 1
    assert primary.chat_bodies() == []
    assert fallback.chat_bodies() == []

    status, body = await post_tier(proxy, {"tier": None}, "s3cret-token")
    assert status == 200
    assert body["ladder"]["forced"] is None
    # Released with both backends healthy: straight back to normal (issue 14
    # item 2; main walked failover → throttle with a ramp each, mostly
    # maintenance answers), the primary taking its traffic back through the
    # ramp while the rest goes to the fallback — never to maintenance.
    assert body["tier"] == "normal"
    assert edges(body) == [
        ("normal", "maintenance", "forced"),
        ("maintenance", "normal", "released"),
    ]
    assert body["ladder"]["ramp"]["target"] == "primary"
    assert body["ladder"]["ramp"]["rest"] == "fallback"
    replies: list[Reply] = []
    while (await get_status(proxy))["ladder"]["ramp"] is not None:
        replies.append(await ask(proxy))
        assert len(replies) < 400, "the ramp never finished"
    assert all(r.status == 200 and r.tier == "normal" for r in replies)
    assert {r.backend for r in replies} <= {"primary", "fallback"}
    assert any(r.backend == "primary" for r in replies)
    st = await get_status(proxy)
    assert (st["tier"], len(st["history"])) == ("normal", 2)
    r = await ask(proxy)
    assert (r.status, r.backend, r.tier) == (200, "primary", "normal")


# =========================================================================== 12


async def test_failure_rate_window_trips_breaker_without_consecutive_failures(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    healthy = answering(PRIMARY_TEXT)
    calls = 0

    async def flaky(request: web.Request) -> web.StreamResponse:
        # ok, FAIL, ok, FAIL, ok, ok, FAIL, ok, FAIL, ok, ...: 40 %, never 2 in a row.
        nonlocal calls
        i = calls
        calls += 1
        if i % 5 in (1, 3):
            return web.json_response(VLLM_503, status=503)
        return await healthy(request)

    primary.handlers["/v1/chat/completions"] = flaky
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    # The rate window's counting alone: a corroboration probe would take a
    # slot of the script (and pass); corroboration: test_attribution_flow.py.
    no_probe = "ladder: {breaker: {corroborate: false}}"
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url, no_probe))

    # failure_rate 0.3 over at least min_calls = 10 outcomes: the 5th failure,
    # on the 12th request (5/12 = 42 %), is the first one to count.
    for i in range(11):
        r = await ask(proxy, stream=False)
        want = "fallback" if i % 5 in (1, 3) else "primary"
        assert (r.status, r.backend, r.tier) == (200, want, "normal"), i
        b = (await get_status(proxy))["backends"]["primary"]
        assert b["breaker"] == "closed", (i, b)
        assert b["breaker_detail"]["consecutive_failures"] <= 1

    r = await ask(proxy, stream=False)
    assert (r.status, r.backend) == (200, "fallback")  # the 12th: failed, retried
    st = await wait_tier(proxy, "failover", within=1.0)
    assert st["backends"]["primary"]["breaker"] in ("open", "half-open")
    assert edges(st) == [("normal", "failover", "primary_down")]
    r = await ask(proxy, stream=False)
    assert (r.status, r.backend, r.tier) == (200, "fallback", "failover")
    assert len(primary.chat_bodies()) == 12
    opened = {"backend": "primary", "from": "closed", "to": "open"}
    assert await metric(proxy, "brownout_breaker_transitions_total", opened) == 1
    errors = {"backend": "primary", "kind": "http_503"}
    assert await metric(proxy, "brownout_upstream_errors_total", errors) == 5


async def test_a_backend_that_does_not_accept_in_time_is_a_connect_timeout(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    """A primary whose listen backlog is full (it never accepts) makes aiohttp's
    connect timeout fire; that is counted as `connect_timeout` (it was reported
    as a first-byte timeout) and the fallback answers."""
    fallback = await fakes()
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):  # fill the accept queue: further SYNs are dropped
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            fillers.append(s)
        await asyncio.sleep(0.1)
        extra = "backends: {primary: {timeouts: {connect_s: 0.3}, health: {interval_s: 60}}}"
        proxy = await start_proxy(ladder_policy(f"http://127.0.0.1:{port}", fallback.url, extra))
        r = await ask(proxy)
        assert r.status == 200
        assert r.backend == "fallback"
        assert r.text() == "from the fallback"
        kinds = {"backend": "primary", "kind": "connect_timeout"}
        assert await metric(proxy, "brownout_upstream_errors_total", kinds) == 1
        first_byte = {"backend": "primary", "kind": "first_byte_timeout"}
        assert await metric(proxy, "brownout_upstream_errors_total", first_byte) == 0
    finally:
        for s in fillers:
            s.close()
        listener.close()
