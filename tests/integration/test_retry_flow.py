"""Issue 14, items 4, 5 and 8 on real sockets (scripted fakes, the real proxy).

4: a transient failure before the first byte is retried on the same backend
   (within its budget, after a backoff or the backend's Retry-After); a timeout
   or a missing first token fails over at once.
5: a client-fault 4xx is passed on as is; context_length_exceeded goes to a
   larger window, else the 400 — never the same request to the same backend.
8: a field the chosen backend does not honour is refused by name (or dropped
   and named in X-Brownout-Dropped), never silently lost.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from proxy.runtime.keys import STATE
from tests.integration.conftest import FakeUpstream, ProxyFactory, free_port
from tests.integration.test_pipeline import (
    CHAT,
    events_of,
    metrics,
    policy,
    stream_words,
    total,
    wait_until,
)

VLLM_500 = {"error": {"message": "EngineCore encountered an issue.", "type": "server_error"}}
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
]


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


def chat_calls(fake: FakeUpstream) -> list[dict[str, Any]]:
    return [json.loads(b) for p, _, b in fake.requests if p == CHAT]


# What Brownout adds to every stream for its token counters (issue 23).
ASKED = {"stream_options": {"include_usage": True}}


async def answer(request: web.Request, who: str) -> web.StreamResponse:
    return await stream_words(request, ["from ", who])


def text_of(raw: bytes) -> str:
    out = []
    for d in events_of(raw):
        if d == b"[DONE]":
            continue
        out.append(json.loads(d)["choices"][0]["delta"].get("content") or "")
    return "".join(out)


def failing_once(
    fail: Any, who: str = "primary", pred: Any = lambda body: True
) -> tuple[Any, list[int]]:
    """A handler that answers `fail(request)` the first time it sees a body
    matching `pred`, then streams normally; `seen[0]` counts its calls."""
    seen = [0]
    failed: set[str] = set()

    async def handler(request: web.Request) -> web.StreamResponse:
        seen[0] += 1
        body = await request.json()
        key = json.dumps(body["messages"])
        if pred(body) and key not in failed:
            failed.add(key)
            out: web.StreamResponse = await fail(request)
            return out
        return await answer(request, who)

    return handler, seen


async def http_500(request: web.Request) -> web.StreamResponse:
    # A transient 500 (vLLM's engine-death error is never retried on the same backend).
    return web.json_response(
        {"error": {"message": "internal error", "type": "server_error"}}, status=500
    )


async def reset(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.close()  # no status line: the proxy's request fails (reset)
    return web.Response()


def too_many(retry_after: str) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "slow down", "type": "rate_limit_error"}},
            status=429,
            headers={"Retry-After": retry_after},
        )

    return handler


# ---------------------------------------------------------------------------- item 4


@pytest.mark.parametrize(
    ("fail", "reason"),
    [(http_500, "http_500"), (reset, "reset"), (too_many("0"), "http_429")],
    ids=["500", "reset", "429-retry-after-0"],
)
async def test_one_transient_failure_is_retried_on_the_primary(
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    fail: Any,
    reason: str,
) -> None:
    """On main a single 500 (or a reset, or a 429) went straight to the
    fallback although the primary answers a moment later."""
    handler, seen = failing_once(fail)
    fake_upstream.handlers[CHAT] = handler
    fallback_upstream.handlers[CHAT] = lambda r: answer(r, "fallback")
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        assert r.status == 200
        assert r.headers["X-Brownout-Backend"] == "primary"
        assert text_of(await r.read()) == "from primary"
    assert seen[0] == 2
    assert chat_calls(fallback_upstream) == []
    m = await metrics(proxy)
    assert total(m, "brownout_retries_total", **{"from": "primary", "to": "primary"}) == 1
    assert total(m, "brownout_retries_total", reason=reason) == 1
    assert total(m, "brownout_retries_total", to="fallback") == 0


async def test_a_long_retry_after_fails_over_at_once(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fake_upstream.handlers[CHAT] = too_many("30")  # longer than the request can wait
    fallback_upstream.handlers[CHAT] = lambda r: answer(r, "fallback")
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        assert r.headers["X-Brownout-Backend"] == "fallback"
        assert text_of(await r.read()) == "from fallback"
    assert loop.time() - t0 < 1.0
    assert len(chat_calls(fake_upstream)) == 1
    m = await metrics(proxy)
    labels = {"from": "primary", "to": "fallback", "reason": "http_429"}
    assert total(m, "brownout_retries_total", **labels) == 1


@pytest.mark.parametrize("headers_first", [False, True], ids=["silent", "headers-then-silent"])
async def test_a_silent_primary_is_never_retried(
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    headers_first: bool,
) -> None:
    gate = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if headers_first:
            await resp.prepare(request)
        await gate.wait()
        return resp

    fake_upstream.handlers[CHAT] = stall
    fallback_upstream.handlers[CHAT] = lambda r: answer(r, "fallback")
    fast = {"timeouts": {"first_byte_s": 0.3}}
    proxy = await start_proxy(
        policy(
            fake_upstream.url,
            fallback_upstream.url,
            primary_extra=fast,
            extra={"server": {"heartbeat_s": 0}},
        )
    )
    try:
        async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
            assert r.headers["X-Brownout-Backend"] == "fallback"
            assert text_of(await r.read()) == "from fallback"
    finally:
        gate.set()
    assert len(chat_calls(fake_upstream)) == 1
    m = await metrics(proxy)
    assert total(m, "brownout_retries_total", to="primary") == 0
    assert total(m, "brownout_retries_total", reason="first_byte_timeout") == 1


@pytest.mark.parametrize("budget", [True, False], ids=["default-budget", "unbounded"])
async def test_the_retry_budget_bounds_retries_in_a_burst(
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    budget: bool,
) -> None:
    """A primary failing half the requests once each: retries stay within
    ratio × requests + floor; the rest fail over (issue 14's burst figure)."""
    n = 100
    handler, seen = failing_once(
        http_500, pred=lambda body: int(body["messages"][0]["content"][1:]) % 2 == 0
    )
    fake_upstream.handlers[CHAT] = handler
    fallback_upstream.handlers[CHAT] = lambda r: answer(r, "fallback")
    # Breaker off: this measures the budget alone.
    pol = policy(
        fake_upstream.url,
        fallback_upstream.url,
        extra={
            "ladder": {
                "breaker": {"fail_max": 1000, "failure_rate": 0},
                "failover": {} if budget else {"retry_budget_ratio": 1, "retry_budget_min": n},
            }
        },
    )
    proxy = await start_proxy(pol)

    async def one(i: int) -> str:
        body = {**BODY, "messages": [{"role": "user", "content": f"q{i}"}]}
        async with proxy.session.post(proxy.url + CHAT, json=body) as r:
            assert r.status == 200
            await r.read()
            return r.headers["X-Brownout-Backend"]

    backends = await asyncio.gather(*(one(i) for i in range(n)))
    m = await metrics(proxy)
    retried = total(m, "brownout_retries_total", **{"from": "primary", "to": "primary"})
    failed_over = total(m, "brownout_retries_total", to="fallback")
    fp = pol.ladder.failover
    if budget:
        assert 0 < retried <= fp.retry_budget_ratio * n + fp.retry_budget_min
    else:
        assert retried == n // 2  # every failing request retried: 1.5× the load
    assert retried + failed_over == n // 2
    assert backends.count("fallback") == failed_over
    assert seen[0] == n + retried  # the primary's load: one attempt each, plus the retries
    exhausted = total(m, "brownout_retry_budget_exhausted_total", backend="primary")
    assert exhausted == failed_over
    print(
        f"\nburst of {n} ({'default budget' if budget else 'no budget'}), 50 % failing "
        f"once: {retried:.0f} retried on the primary, "
        f"{failed_over:.0f} failed over; primary answered {backends.count('primary')}/{n}; "
        f"primary load {seen[0] / n:.2f}× requests"
    )


async def test_requests_shed_by_admission_buy_no_retries(
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
) -> None:
    """A 429 from admission never reached the backend: it is not one of the
    backend's requests in its retry budget. On main each shed counted, so a
    burst of sheddable 429s bought the next failing request a retry that
    `ratio × requests + floor` (here 0.2 × 1 + 0) does not allow."""
    handler, seen = failing_once(http_500, pred=lambda body: body["messages"][0]["content"] == "x")
    fake_upstream.handlers[CHAT] = handler
    fallback_upstream.handlers[CHAT] = lambda r: answer(r, "fallback")
    pol = policy(
        fake_upstream.url,
        fallback_upstream.url,
        extra={
            "server": {"admin_token": "t0ken"},
            "ladder": {
                "breaker": {"fail_max": 1000, "failure_rate": 0},
                "failover": {"retry_budget_ratio": 0.2, "retry_budget_min": 0},
            },
        },
    )
    proxy = await start_proxy(pol)
    admin = {"Authorization": "Bearer t0ken"}
    async with proxy.session.post(
        proxy.url + "/brownout/tier", json={"tier": "throttle"}, headers=admin
    ) as r:
        assert r.status == 200
    await wait_until(lambda: proxy.app[STATE].current.admission.shed_sheddable)  # next window
    for _ in range(10):
        async with proxy.session.post(
            proxy.url + CHAT, json=BODY, headers={"X-Priority": "sheddable"}
        ) as r:
            assert r.status == 429 and r.headers["X-Brownout-Backend"] == "primary"
            assert (await r.json())["error"]["type"] == "rate_limit_error"
    assert seen[0] == 0  # shed before any backend call
    async with proxy.session.post(
        proxy.url + "/brownout/tier", json={"tier": None}, headers=admin
    ) as r:
        assert r.status == 200

    body = {**BODY, "messages": [{"role": "user", "content": "x"}]}
    async with proxy.session.post(proxy.url + CHAT, json=body) as r:
        assert r.status == 200
        assert r.headers["X-Brownout-Backend"] == "fallback"
        assert text_of(await r.read()) == "from fallback"
    assert seen[0] == 1  # no retry on the primary
    m = await metrics(proxy)
    assert total(m, "brownout_retries_total", **{"from": "primary", "to": "primary"}) == 0
    assert total(m, "brownout_retry_budget_exhausted_total", backend="primary") == 1


# ---------------------------------------------------------------------------- item 5


async def test_content_policy_400_is_passed_on_without_retry_or_failover(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    error = {
        "error": {
            "message": "Your request was rejected by the safety system.",
            "type": "invalid_request_error",
            "param": None,
            "code": "content_policy_violation",
        }
    }

    async def refuse(request: web.Request) -> web.StreamResponse:
        return web.json_response(error, status=400)

    fake_upstream.handlers[CHAT] = refuse
    fallback_upstream.handlers[CHAT] = lambda r: answer(r, "fallback")
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url))
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        assert r.status == 400
        assert r.headers["X-Brownout-Backend"] == "primary"
        assert await r.json() == error
    assert len(chat_calls(fake_upstream)) == 1
    assert chat_calls(fallback_upstream) == []
    m = await metrics(proxy)
    assert total(m, "brownout_retries_total") == 0
    assert total(m, "brownout_upstream_errors_total") == 0


VLLM_CONTEXT = {
    "object": "error",
    "message": "This model's maximum context length is 1024 tokens. However, you requested "
    "2100 tokens (2000 in the messages, 100 in the completion). Please reduce the length.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}


async def too_long(request: web.Request) -> web.StreamResponse:
    return web.json_response(VLLM_CONTEXT, status=400)


@pytest.mark.parametrize(("fallback_len", "routed"), [(8192, True), (1024, False)])
async def test_context_too_long_goes_to_a_larger_window_only(
    fake_upstream: FakeUpstream,
    fallback_upstream: FakeUpstream,
    start_proxy: ProxyFactory,
    fallback_len: int,
    routed: bool,
) -> None:
    fake_upstream.handlers[CHAT] = too_long
    fallback_upstream.handlers[CHAT] = lambda r: answer(r, "fallback")
    pol = policy(
        fake_upstream.url,
        fallback_upstream.url,
        primary_extra={"max_model_len": 1024},
        extra={"backends": {"fallback": {"max_model_len": fallback_len}}},
    )
    proxy = await start_proxy(pol)
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        raw = await r.read()
        if routed:
            assert r.status == 200
            assert r.headers["X-Brownout-Backend"] == "fallback"
            assert text_of(raw) == "from fallback"
        else:
            assert r.status == 400
            assert b"maximum context length is 1024" in raw
    # Never the same request to the same backend again.
    assert len(chat_calls(fake_upstream)) == 1
    assert len(chat_calls(fallback_upstream)) == (1 if routed else 0)
    m = await metrics(proxy)
    assert total(m, "brownout_upstream_errors_total") == 0
    assert total(m, "brownout_retries_total", reason="context_length") == (1 if routed else 0)


# ---------------------------------------------------------------------------- item 8


def failover_policy(fallback: str, unsupported: str = "reject") -> Any:
    # The primary refuses connections: every request goes to the fallback.
    return policy(
        f"http://127.0.0.1:{free_port()}",
        fallback,
        extra={"ladder": {"failover": {"unsupported_fields": unsupported}}},
    )


TOOL_BODY = {
    **BODY,
    "tools": TOOLS,
    "tool_choice": "auto",
    "logprobs": True,
    "response_format": {"type": "json_object"},
}


async def test_fields_the_fallback_does_not_honour_are_refused_by_name(
    fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """On main the fallback got the request without them and the client a 200
    of plain text."""
    fallback_upstream.handlers[CHAT] = lambda r: answer(r, "fallback")
    proxy = await start_proxy(failover_policy(fallback_upstream.url))
    async with proxy.session.post(proxy.url + CHAT, json=TOOL_BODY) as r:
        assert r.status == 503
        assert r.headers["X-Brownout-Backend"] == "fallback"
        err = (await r.json())["error"]
    assert err["code"] == "unsupported_fields"
    assert err["param"] == "tools"
    for name in ("tools", "tool_choice", "logprobs", "response_format"):
        assert name in err["message"]
    assert chat_calls(fallback_upstream) == []


async def test_a_maintenance_trial_that_cannot_take_the_fields_gives_the_maintenance_answer(
    fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """In maintenance, with no recovery probe, a real request is a backend's
    half-open trial. On main a trial on a fallback that does not honour the
    request's tools answered 503 `unsupported_fields` — while the same
    request a moment earlier (no trial due) got the maintenance answer. The
    tier's answer does not depend on whether a trial was due: the maintenance
    answer, and the next request that the fallback can take is the trial."""
    state = {"failing": True}

    async def chat(request: web.Request) -> web.StreamResponse:
        if state["failing"]:
            return await http_500(request)
        return await answer(request, "fallback")

    fallback_upstream.handlers[CHAT] = chat
    pol = policy(
        f"http://127.0.0.1:{free_port()}",  # the primary refuses connections
        fallback_upstream.url,
        maintenance=True,
        extra={
            "ladder": {
                "failover": {"recovery_probe": False, "retry_max": 0},
                "breaker": {"fail_max": 2, "reset_timeout_s": 0.2},
                "maintenance": {"notice": "down for maintenance"},
            }
        },
    )
    proxy = await start_proxy(pol)
    rt = proxy.app[STATE].current
    await wait_until(lambda: rt.upstreams["primary"].down)
    for _ in range(2):
        async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
            await r.read()
    await wait_until(lambda: rt.tier == "maintenance")
    fb = rt.upstreams["fallback"]
    await wait_until(lambda: fb.trial_due(rt.clock()))
    async with proxy.session.post(proxy.url + CHAT, json=TOOL_BODY) as r:
        raw = await r.read()
        assert r.status == 200, raw
        assert r.headers["X-Brownout-Backend"] == "maintenance"
        assert "Retry-After" in r.headers
        assert text_of(raw) == "down for maintenance"
    assert fb.trial_due(rt.clock())  # no outcome: the trial slot is free again
    state["failing"] = False
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        assert r.status == 200
        assert r.headers["X-Brownout-Backend"] == "fallback"
        assert text_of(await r.read()) == "from fallback"


async def test_drop_policy_names_what_it_dropped(
    fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    fallback_upstream.handlers[CHAT] = lambda r: answer(r, "fallback")
    proxy = await start_proxy(failover_policy(fallback_upstream.url, "drop"))
    async with proxy.session.post(proxy.url + CHAT, json=TOOL_BODY) as r:
        assert r.status == 200
        assert r.headers["X-Brownout-Dropped"] == "tools,tool_choice,logprobs,response_format"
        assert text_of(await r.read()) == "from fallback"
    [sent] = chat_calls(fallback_upstream)
    assert sent == {**BODY, **ASKED}


async def test_advertised_capabilities_are_honoured(
    fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    from proxy.fallback.api.fields import advertise
    from proxy.fallback.engines.interface import Capabilities

    caps = advertise(Capabilities("batched", True, True, 5, True, True, True), grammar=True)

    async def models(request: web.Request) -> web.StreamResponse:
        card = {"id": "tiny", "object": "model", "max_model_len": 4096, "capabilities": caps}
        return web.json_response({"object": "list", "data": [card]})

    fallback_upstream.handlers["/v1/models"] = models
    fallback_upstream.handlers[CHAT] = lambda r: answer(r, "fallback")
    proxy = await start_proxy(failover_policy(fallback_upstream.url))
    fb = proxy.app[STATE].current.upstreams["fallback"]
    await wait_until(lambda: "tools" in (fb.caps.chat if fb.caps else ()))
    multimodal = {
        **TOOL_BODY,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi"},
                    {"type": "image_url", "image_url": {"url": "data:,"}},
                ],
            }
        ],
    }
    async with proxy.session.post(proxy.url + CHAT, json=TOOL_BODY) as r:
        assert r.status == 200
        assert "X-Brownout-Dropped" not in r.headers
        await r.read()
    assert chat_calls(fallback_upstream) == [{**TOOL_BODY, **ASKED}]  # as the client sent it
    async with proxy.session.post(proxy.url + CHAT, json=multimodal) as r:
        assert r.status == 503
        err = (await r.json())["error"]
        assert err["param"] == "messages[].content[type=image_url]"
    assert len(chat_calls(fallback_upstream)) == 1


async def test_capabilities_are_read_again_when_the_fallback_recovers(
    fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """A fallback replaced while it was down (now serving tools) is re-read."""
    from proxy.fallback.api.fields import advertise
    from proxy.fallback.engines.interface import Capabilities

    state = {"health": 200, "caps": False}

    async def health(request: web.Request) -> web.StreamResponse:
        return web.Response(status=state["health"])

    async def models(request: web.Request) -> web.StreamResponse:
        card: dict[str, Any] = {"id": "tiny", "object": "model", "max_model_len": 4096}
        if state["caps"]:
            full = Capabilities("batched", True, True, 5, True, True, True)
            card["capabilities"] = advertise(full, grammar=True)
        return web.json_response({"object": "list", "data": [card]})

    fallback_upstream.handlers["/health"] = health
    fallback_upstream.handlers["/v1/models"] = models
    fallback_upstream.handlers[CHAT] = lambda r: answer(r, "fallback")
    proxy = await start_proxy(failover_policy(fallback_upstream.url))
    fb = proxy.app[STATE].current.upstreams["fallback"]
    await wait_until(lambda: fb.health.healthy is True)
    async with proxy.session.post(proxy.url + CHAT, json=TOOL_BODY) as r:
        assert r.status == 503  # plain chat only: nothing advertised
    state["health"] = 503
    await wait_until(lambda: fb.health.healthy is False)
    state.update(health=200, caps=True)
    await wait_until(lambda: fb.caps is not None and "tools" in fb.caps.chat)
    async with proxy.session.post(proxy.url + CHAT, json=TOOL_BODY) as r:
        assert r.status == 200
        await r.read()
    assert chat_calls(fallback_upstream) == [{**TOOL_BODY, **ASKED}]


async def test_a_window_refusal_does_not_mask_the_larger_backends_own_failure(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Too long for the primary, sent on to the fallback's larger window,
    where it fails with a 5xx: the client hears the fallback's failure, not
    the primary's context-length 400 (chaos drill 8 answered a poison
    parameter with "only -60 tokens fit in the context window")."""

    async def boom(request: web.Request) -> web.StreamResponse:
        msg = "probability tensor contains either inf, nan or element < 0"
        return web.json_response({"error": {"message": msg, "code": 500}}, status=500)

    fake_upstream.handlers[CHAT] = too_long
    fallback_upstream.handlers[CHAT] = boom
    pol = policy(
        fake_upstream.url,
        fallback_upstream.url,
        primary_extra={"max_model_len": 1024},
        extra={
            "backends": {"fallback": {"max_model_len": 8192}},
            "ladder": {"failover": {"retry_max": 0}},
        },
    )
    proxy = await start_proxy(pol)
    async with proxy.session.post(proxy.url + CHAT, json=BODY) as r:
        raw = await r.read()
        assert r.status >= 500, raw
        assert r.headers["X-Brownout-Backend"] == "fallback"
        assert b"maximum context length" not in raw
        assert "inf, nan" in json.loads(raw)["error"]["message"], raw
