"""Recovery always comes home, end to end (issue 14, items 1 and 3).

Real sockets: the proxy in front of scripted fakes (a chat-only
OpenAI-compatible primary, a dead or healthy fallback). Times are measured
from the moment the primary is healthy again and checked against the bound
derived from the test policy.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from proxy.control.ladder import recovery_bound
from proxy.policy import Policy
from tests.integration.conftest import ProxyFactory
from tests.integration.test_ladder_flow import (
    FALLBACK_TEXT,
    PRIMARY_TEXT,
    VLLM_500,
    Fake,
    FakeFactory,
    Reply,
    answering,
    ask,
    edges,
    failing,
    fakes,
    get_status,
    ladder_policy,
    metric,
    refused_url,
    wait_status,
    wait_tier,
)

__all__ = ["fakes"]  # the fixture, imported for pytest

MODELS = {"object": "list", "data": [{"id": "chat-model", "object": "model"}]}


def serve_models(fake: Fake) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(MODELS)

    fake.handlers["/v1/models"] = handler


def probe_bodies(fake: Fake) -> list[dict[str, Any]]:
    return [
        json.loads(b)
        for p, _, b in fake.requests
        if p == "/v1/chat/completions" and json.loads(b)["messages"][0]["content"] == "ping"
    ]


async def until_primary(proxy: Any, within: float) -> tuple[float, list[Reply]]:
    """Ask until an answer comes from the primary: (seconds taken, replies)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    replies: list[Reply] = []
    while True:
        r = await ask(proxy)
        replies.append(r)
        assert r.status == 200, r.raw
        if r.backend == "primary":
            return loop.time() - t0, replies
        assert loop.time() - t0 < within, f"not back on the primary: {await get_status(proxy)}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("with_fallback", [True, False], ids=["fallback-dead", "no-fallback"])
async def test_primary_back_while_the_fallback_stays_down(
    fakes: FakeFactory, start_proxy: ProxyFactory, with_fallback: bool
) -> None:
    # Issue 14 item 1: on main the ladder flapped maintenance ↔ failover
    # (a ramp towards the dead fallback, rolled back by its first failure).
    primary = await fakes()
    primary.handlers["/v1/chat/completions"] = answering(PRIMARY_TEXT)
    await primary.stop()  # both down from the start
    policy: Policy = ladder_policy(primary.url, refused_url() if with_fallback else None)
    proxy = await start_proxy(policy)
    await wait_tier(proxy, "maintenance")
    r = await ask(proxy)
    assert (r.status, r.backend) == (200, "maintenance")

    await primary.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    back, replies = await until_primary(proxy, within=5)
    counts = {"maintenance": 0, "primary": 0}
    while True:
        st = await get_status(proxy)
        if st["tier"] == "normal" and st["ladder"]["ramp"] is None:
            break
        r = await ask(proxy)
        assert r.status == 200 and r.backend in counts, (r.backend, r.raw)
        counts[r.backend] += 1
        assert loop.time() - t0 < recovery_bound(policy.ladder.recovery) + 1.0, st
    home = loop.time() - t0
    assert edges(st) == [
        ("normal", "maintenance", "fallback_down"),
        ("maintenance", "throttle", "recovered"),
        ("throttle", "normal", "recovered"),
    ]
    assert not any(b.backend == "fallback" for b in replies)
    r = await ask(proxy)
    assert (r.status, r.backend, r.tier, r.text()) == (200, "primary", "normal", "from the primary")
    print(f"back on the primary after {back:.2f} s, home (normal, no ramp) after {home:.2f} s")


async def test_chat_only_primary_is_probed_on_chat_and_comes_back(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    # Issue 14 item 3: main probed POST /v1/completions; a chat-only upstream
    # (the fake answers 404 there) never closed its breaker again.
    primary, fallback = await fakes(), await fakes()
    serve_models(primary)
    primary.handlers["/v1/chat/completions"] = failing(500, VLLM_500)
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    extra = "backends: {primary: {kind: openai}}"
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url, extra))
    await wait_status(proxy, lambda s: s["backends"]["primary"]["model"] == "chat-model", "models")
    for _ in range(3):
        r = await ask(proxy)
        assert (r.status, r.backend) == (200, "fallback")
    await wait_tier(proxy, "failover")
    await wait_status(proxy, lambda s: len(probe_bodies(primary)) >= 1, "a failed recovery probe")

    primary.handlers["/v1/chat/completions"] = answering(PRIMARY_TEXT)
    back, _ = await until_primary(proxy, within=5)
    body = probe_bodies(primary)[-1]
    assert body == {
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
        "temperature": 0,
        "model": "chat-model",
    }
    assert [p for p, _, _ in primary.requests if p == "/v1/completions"] == []
    st = await get_status(proxy)
    assert st["backends"]["primary"]["probe"] == {
        "path": "/v1/chat/completions",
        "misconfigured": None,
    }
    ok = {"backend": "primary", "outcome": "ok"}
    assert await metric(proxy, "brownout_recovery_probes_total", ok) == 1
    print(f"back on the primary {back:.2f} s after it recovered (test policy)")


async def test_a_probe_the_backend_does_not_serve_makes_real_traffic_the_trial(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    primary, fallback = await fakes(), await fakes()
    primary.handlers["/v1/chat/completions"] = failing(500, VLLM_500)
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    # The operator points the probe at an endpoint this chat-only server lacks.
    extra = """
backends:
  primary:
    kind: openai
    probe: {path: /v1/completions, body: '{"prompt": "hi", "max_tokens": 1}'}
"""
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url, extra))
    for _ in range(3):
        await ask(proxy)
    await wait_tier(proxy, "failover")
    st = await wait_status(
        proxy,
        lambda s: s["backends"]["primary"]["probe"]["misconfigured"] is not None,
        "the misconfigured probe to show",
    )
    assert st["backends"]["primary"]["probe"]["misconfigured"] == (
        "POST /v1/completions answered HTTP 404"
    )
    bad = {"backend": "primary", "outcome": "misconfigured"}
    assert await metric(proxy, "brownout_recovery_probes_total", bad) == 1
    probes = [json.loads(b) for p, _, b in primary.requests if p == "/v1/completions"]
    assert probes == [{"prompt": "hi", "max_tokens": 1}]

    # Still failing: a real request is the trial, fails, and is answered by the fallback.
    r = await ask(proxy)
    assert (r.status, r.backend) == (200, "fallback")
    primary.handlers["/v1/chat/completions"] = answering(PRIMARY_TEXT)
    back, _ = await until_primary(proxy, within=5)
    st = await get_status(proxy)
    assert st["backends"]["primary"]["breaker"] == "closed"
    # The probe is not retried once known to be wrong: one count, one request.
    assert await metric(proxy, "brownout_recovery_probes_total", bad) == 1
    assert len([p for p, _, _ in primary.requests if p == "/v1/completions"]) == 1
    print(f"back on the primary {back:.2f} s after it recovered (real-traffic trial)")


async def test_from_maintenance_a_real_request_is_the_trial_when_no_probe_works(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    # Both chat-only backends' breakers open and their probes point at a path
    # they lack: without a real request as the trial, maintenance would hold
    # for ever (the ladder sends maintenance answers, nothing reaches them).
    primary, fallback = await fakes(), await fakes()
    for fake in (primary, fallback):
        fake.handlers["/v1/chat/completions"] = failing(500, VLLM_500)
    extra = """
backends:
  primary: {kind: openai, probe: {path: /v1/completions}}
  fallback: {kind: openai, probe: {path: /v1/completions}}
"""
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url, extra))
    st: dict[str, Any] = {}
    for _ in range(20):
        await ask(proxy)
        st = await get_status(proxy)
        if st["tier"] == "maintenance":
            break
    assert st["tier"] == "maintenance", st
    await wait_status(
        proxy,
        lambda s: all(b["probe"]["misconfigured"] for b in s["backends"].values()),
        "both probes known misconfigured",
    )
    r = await ask(proxy)
    assert (r.status, r.backend) == (200, "maintenance")  # a failed trial: maintenance answer

    primary.handlers["/v1/chat/completions"] = answering(PRIMARY_TEXT)
    back, _ = await until_primary(proxy, within=5)
    await wait_tier(proxy, "normal")
    print(f"back on the primary {back:.2f} s after it recovered (from maintenance)")


async def test_a_probe_body_the_backend_rejects_is_a_misconfiguration(
    fakes: FakeFactory, start_proxy: ProxyFactory
) -> None:
    # A base model without a chat template: vLLM answers chat requests 400.
    primary, fallback = await fakes(), await fakes()
    state = {"failing": True}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["messages"][0]["content"] == "ping":
            return web.json_response({"error": {"message": "no chat template"}}, status=400)
        if state["failing"]:
            return web.json_response(VLLM_500, status=500)
        return await answering(PRIMARY_TEXT)(request)

    primary.handlers["/v1/chat/completions"] = chat
    fallback.handlers["/v1/chat/completions"] = answering(FALLBACK_TEXT)
    proxy = await start_proxy(ladder_policy(primary.url, fallback.url))
    for _ in range(3):
        await ask(proxy)
    await wait_tier(proxy, "failover")
    st = await wait_status(
        proxy,
        lambda s: s["backends"]["primary"]["probe"]["misconfigured"] is not None,
        "the misconfigured probe to show",
    )
    assert st["backends"]["primary"]["probe"]["misconfigured"] == (
        "POST /v1/chat/completions answered HTTP 400"
    )
    assert st["backends"]["primary"]["breaker"] == "half-open"  # no outcome: the slot is free
    state["failing"] = False
    back, _ = await until_primary(proxy, within=5)
    print(f"back on the primary {back:.2f} s after it recovered (400 on the probe)")
