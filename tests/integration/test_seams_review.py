"""Defects found at the seams of the merged pipeline, retry loop, breakers
and ladder (review of main at fd452ac), each reproduced on real sockets: the
real proxy in front of scripted fakes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import structlog
import yaml
from aiohttp import web

from proxy.policy import load_policy
from proxy.runtime.keys import STATE
from tests.integration.conftest import FakeUpstream, ProxyFactory, chunk, free_port
from tests.integration.test_pipeline import (
    CHAT,
    metrics,
    policy,
    stream_words,
    total,
    wait_until,
)
from tests.integration.test_retry_flow import TOOL_BODY, failing_once, http_500
from tests.integration.test_retry_flow import fallback_upstream as fallback_upstream

VLLM_500 = {"error": {"message": "EngineCore encountered an issue.", "type": "server_error"}}
# A transient 500 (worth a retry: an engine-death error is not retried).
HTTP_500 = {"error": {"message": "internal error", "type": "server_error"}}
PLAIN = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_retry_the_breaker_refuses_still_passes_on_the_backends_error(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """On main the 500 opened the primary's breaker (fail_max 1), the loop
    counted a retry, the retry's allow() said no, and the backend's error was
    lost: the client got 502 "no backend could be reached"."""

    async def http_500(request: web.Request) -> web.StreamResponse:
        return web.json_response(VLLM_500, status=500)

    fake_upstream.handlers[CHAT] = http_500
    proxy = await start_proxy(
        policy(fake_upstream.url, extra={"ladder": {"breaker": {"fail_max": 1}}})
    )
    async with proxy.session.post(proxy.url + CHAT, json=PLAIN) as r:
        body = await r.json()
        assert r.status == 500, body
        assert body["error"]["message"] == "EngineCore encountered an issue."
    assert len([p for p, _, _ in fake_upstream.requests if p == CHAT]) == 1
    m = await metrics(proxy)
    assert total(m, "brownout_retries_total") == 0  # no retry happened
    assert total(m, "brownout_requests_total", status="500") == 1


async def test_a_reload_keeps_what_was_learnt_of_the_same_fallback(
    fallback_upstream: FakeUpstream, start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    """A reload that changes another setting of the fallback (here its idle
    timeout) builds a new Upstream, and discovery does not run again while the
    server stays healthy. On main that new Upstream forgot the capabilities
    the fallback advertises (tool requests in failover: 503
    unsupported_fields instead of its answer) and the retries already spent
    in the window (the budget started over)."""
    from proxy.fallback.api.fields import advertise
    from proxy.fallback.engines.interface import Capabilities

    caps = advertise(Capabilities("batched", True, True, 5, True, True, True), grammar=True)

    async def models(request: web.Request) -> web.StreamResponse:
        card = {"id": "tiny", "object": "model", "max_model_len": 4096, "capabilities": caps}
        return web.json_response({"object": "list", "data": [card]})

    handler, seen = failing_once(http_500, "fallback")
    fallback_upstream.handlers["/v1/models"] = models
    fallback_upstream.handlers[CHAT] = handler
    path = tmp_path / "policy.yaml"

    def write(idle_s: float) -> None:
        path.write_text(
            yaml.safe_dump(
                {
                    "server": {"heartbeat_s": 0.3},
                    "backends": {
                        "primary": {"url": f"http://127.0.0.1:{free_port()}"},  # refused
                        "fallback": {
                            "url": fallback_upstream.url,
                            "kind": "transformers",
                            "timeouts": {"idle_s": idle_s},
                            "health": {"interval_s": 0.2},
                        },
                    },
                    "ladder": {"maintenance": {"enabled": False}},
                }
            )
        )

    write(1.0)
    proxy = await start_proxy(load_policy(str(path)))
    state = proxy.app[STATE]
    fb = state.current.upstreams["fallback"]
    await wait_until(lambda: fb.caps is not None and "tools" in fb.caps.chat)
    async with proxy.session.post(proxy.url + CHAT, json=TOOL_BODY) as r:
        assert r.status == 200  # after one retry on the fallback
        await r.read()
    assert seen[0] == 2
    write(2.0)
    result = await state.reload("test")
    assert result.get("ok", True) is not False, result
    assert state.current.upstreams["fallback"] is not fb
    async with proxy.session.get(proxy.url + "/brownout/status") as r:
        st = (await r.json())["backends"]["fallback"]
    assert st["capabilities"] == "advertised"
    assert st["retries_in_window"] == 1
    async with proxy.session.post(proxy.url + CHAT, json=TOOL_BODY) as r:
        assert r.status == 200, await r.text()
        assert "X-Brownout-Dropped" not in r.headers
        await r.read()


async def test_a_retry_gets_what_is_left_of_the_first_byte_deadline(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """A slow 500 (1.2 s of a 2 s first-byte deadline), then a retry that
    stalls. On main the retry got a fresh 2 s deadline, so the client waited
    about 3.2 s on the primary alone before the fallback's answer: the
    request's first-byte deadline is one deadline, retries included."""
    gate = asyncio.Event()
    calls = [0]

    async def slow_500_then_stall(request: web.Request) -> web.StreamResponse:
        calls[0] += 1
        if calls[0] == 1:
            await asyncio.sleep(1.2)  # the scripted backend's delay, not a wait for a condition
            return web.json_response(HTTP_500, status=500)
        await gate.wait()
        return web.Response()

    async def fallback(request: web.Request) -> web.StreamResponse:
        return await stream_words(request, ["from ", "fallback"])

    fake_upstream.handlers[CHAT] = slow_500_then_stall
    fallback_upstream.handlers[CHAT] = fallback
    proxy = await start_proxy(
        policy(fake_upstream.url, fallback_upstream.url, extra={"server": {"heartbeat_s": 0}})
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        async with proxy.session.post(proxy.url + CHAT, json={**PLAIN, "stream": True}) as r:
            assert r.status == 200
            assert r.headers["X-Brownout-Backend"] == "fallback"
            await r.read()
    finally:
        gate.set()
    assert calls[0] == 2  # the retry did happen
    assert loop.time() - t0 < 2.7


async def test_a_retry_shed_by_admission_fails_over_instead_of_answering_429(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Throttle with one slot: request A gets it, the primary answers 500,
    and while A backs off before its retry, request B takes the slot. On main
    A's retry was shed and A got a 429, though its first attempt had been
    admitted and the fallback could answer (before retries existed it would
    have failed over)."""
    gate = asyncio.Event()
    a_failed = asyncio.Event()
    calls: list[str] = []

    async def primary(request: web.Request) -> web.StreamResponse:
        who = (await request.json())["messages"][0]["content"]
        calls.append(who)
        if who == "A":
            a_failed.set()
            return web.json_response(HTTP_500, status=500)
        await gate.wait()  # B holds the only slot
        return await stream_words(request, ["from ", "primary"])

    async def fallback(request: web.Request) -> web.StreamResponse:
        return await stream_words(request, ["from ", "fallback"])

    fake_upstream.handlers[CHAT] = primary
    fallback_upstream.handlers[CHAT] = fallback
    extra = {
        "ladder": {
            "throttle": {"max_inflight": 1, "queue_size": 0},
            # A backoff of 0.5–1 s: B is admitted while A waits.
            "failover": {"retry_backoff_s": 1.0, "retry_backoff_max_s": 1.0},
        },
    }
    proxy = await start_proxy(policy(fake_upstream.url, fallback_upstream.url, extra=extra))
    admission = proxy.app[STATE].current.admission

    def ask(who: str) -> Any:
        body = {**PLAIN, "stream": True, "messages": [{"role": "user", "content": who}]}
        return proxy.session.post(proxy.url + CHAT, json=body)

    async def a() -> tuple[int, str, bytes]:
        async with ask("A") as r:
            return r.status, r.headers["X-Brownout-Backend"], await r.read()

    async def b() -> int:
        async with ask("B") as r:
            await r.read()
            return r.status

    task_a = asyncio.create_task(a())
    await a_failed.wait()
    await wait_until(lambda: admission.inflight == 0)  # A backs off
    task_b = asyncio.create_task(b())
    await wait_until(lambda: admission.inflight == 1 and calls == ["A", "B"])
    try:
        status, backend, raw = await task_a
    finally:
        gate.set()
    assert (status, backend) == (200, "fallback"), raw
    assert b"fallback" in raw
    assert await task_b == 200


async def test_each_new_path_ends_with_one_metric_update_and_one_log_line(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """A retried request, one whose retry budget is spent, a refusal naming
    unsupported fields, a rescue whose prefill the fallback refuses: each adds
    exactly 1 to brownout_requests_total and writes exactly one `request` line."""
    from tests.integration.test_rescue_capabilities import cut_after, no_prefill

    async def primary(request: web.Request) -> web.StreamResponse:
        what = (await request.json())["messages"][0]["content"]
        if what == "cut":
            return await cut_after(chunk("The quick"))(request)
        return web.json_response(HTTP_500, status=500)

    async def fallback(request: web.Request) -> web.StreamResponse:
        what = (await request.json())["messages"][0]["content"]
        if what == "cut":
            return await no_prefill(request)
        return await stream_words(request, ["from ", "fallback"])

    fake_upstream.handlers[CHAT] = primary
    fallback_upstream.handlers[CHAT] = fallback
    # A budget of one retry (floor 1, no share): the second failing request fails over at once.
    budget = {"failover": {"retry_budget_min": 1, "retry_budget_ratio": 0}}
    proxy = await start_proxy(
        policy(fake_upstream.url, fallback_upstream.url, extra={"ladder": budget})
    )

    def body(text: str, **more: Any) -> dict[str, Any]:
        return {**PLAIN, "stream": True, "messages": [{"role": "user", "content": text}], **more}

    before = total(await metrics(proxy), "brownout_requests_total")
    with structlog.testing.capture_logs() as logs:
        for text, more, status in [
            ("retried", {}, 200),  # 500, retry 500, fallback
            ("budget", {}, 200),  # 500, no budget left: fallback
            ("tools", {"tools": TOOL_BODY["tools"]}, 503),  # 500 ×2, plain fallback refuses
            ("cut", {}, 200),  # cut mid-answer, prefill refused, rescued by prompt
        ]:
            async with proxy.session.post(proxy.url + CHAT, json=body(text, **more)) as r:
                assert r.status == status, (text, await r.text())
                await r.read()
    lines = [e for e in logs if e["event"] == "request"]
    assert len(lines) == 4, lines
    m = await metrics(proxy)
    assert total(m, "brownout_requests_total") - before == 4
    assert total(m, "brownout_retry_budget_exhausted_total", backend="primary") >= 1
    assert total(m, "brownout_stream_rescues_total", outcome="prefill_rejected") == 1
