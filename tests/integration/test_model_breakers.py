"""Breakers keyed by (backend, model) for multi-model backends (issue 14 item 6).

A backend of kind `openai` that lists several models in /v1/models (and has
no `model` rewrite) gets one breaker per model: failures of one model open
only that model's breaker, the ladder stays where it is, and the other
models' requests are still admitted. Single-model backends (vLLM,
transformers, or any `model` rewrite) keep one breaker. Outcomes are
reported the way the attempt stage reports them: `breaker_for(model).allow()`
then `Runtime.report_failure/report_success` with that permit.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.backends.upstream import Upstream
from proxy.runtime.generation import Runtime
from proxy.runtime.keys import STATE
from proxy.runtime.loops import Evaluator
from tests.integration.conftest import FakeUpstream, ProxyFactory, RunningProxy
from tests.integration.test_ladder_flow import ladder_policy
from tests.integration.test_pipeline import fallback_upstream as fallback_upstream

TWO_MODELS = {"object": "list", "data": [{"id": "model-a"}, {"id": "model-b"}]}


def serve_models(fake: FakeUpstream, listing: dict[str, Any]) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(listing)

    fake.handlers["/v1/models"] = handler


async def started(
    fake: FakeUpstream, start_proxy: ProxyFactory, extra: str
) -> tuple[RunningProxy, Runtime, Upstream]:
    serve_models(fake, TWO_MODELS)
    proxy = await start_proxy(ladder_policy(fake.url, None, extra or "{}"))
    rt = proxy.app[STATE].current
    up = rt.upstreams["primary"]
    for _ in range(200):
        if up.served_models:
            break
        await asyncio.sleep(0.01)
    assert up.served_models == ("model-a", "model-b")
    return proxy, rt, up


def fail(rt: Runtime, up: Upstream, model: str, times: int) -> None:
    for _ in range(times):
        permit = up.breaker_for(model).allow()
        assert permit is not None
        rt.report_failure(up, "http_500", permit=permit)


async def samples(proxy: RunningProxy, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    async with proxy.session.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


async def test_one_models_failures_do_not_divert_another_models_traffic(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    extra = "backends: {primary: {kind: openai}}\nladder: {breaker: {fail_max: 3}}\n"
    proxy, rt, up = await started(fake_upstream, start_proxy, extra)
    a, b = up.breaker_for("model-a"), up.breaker_for("model-b")
    assert a is not b and up.breaker not in (a, b)
    assert up.breaker_for("not-listed") is up.breaker  # unknown names share the backend's

    fail(rt, up, "model-a", 3)
    await asyncio.sleep(0)  # evaluate_soon
    assert (a.state, b.state, up.breaker.state) == ("open", "closed", "closed")
    assert b.allow() is not None and a.allow() is None
    assert up.available
    assert rt.tier == "normal"
    assert rt.route()[0] == "primary"

    async with proxy.session.get(proxy.url + "/brownout/status") as resp:
        st = await resp.json()
    p = st["backends"]["primary"]
    assert p["breaker"] == "closed"
    assert {m: d["state"] for m, d in p["model_breakers"].items()} == {
        "model-a": "open",
        "model-b": "closed",
    }
    assert p["model_breakers"]["model-a"]["last_failure"] == "http_500"
    state = await samples(proxy, "brownout_model_breaker_state")
    assert state == {
        (("backend", "primary"), ("model", "model-a")): 2.0,
        (("backend", "primary"), ("model", "model-b")): 0.0,
    }
    moves = await samples(proxy, "brownout_model_breaker_transitions_total")
    key = (("backend", "primary"), ("from", "closed"), ("model", "model-a"), ("to", "open"))
    assert moves == {key: 1.0}

    # Every model out: the backend as a whole cannot serve, the ladder fails over.
    fail(rt, up, "model-b", 3)
    await asyncio.sleep(0)
    assert not up.available
    assert rt.tier == "maintenance"  # no fallback configured

    # A success of a half-open model's trial closes only that model's breaker.
    a._opened_at = rt.clock() - rt.policy.ladder.breaker.reset_timeout_s - 1  # due now
    permit = a.allow()
    assert permit is not None and a.state == "half-open"
    rt.report_success(up, permit=permit)
    assert (a.state, b.state) == ("closed", "open")
    assert up.available


async def test_the_recovery_probe_tests_an_open_model_breaker_with_its_model(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    proxy, rt, up = await started(fake_upstream, start_proxy, "backends: {primary: {kind: openai}}")
    seen: list[str | None] = []

    async def probe(model: str | None = None) -> str | None:
        seen.append(model)
        return None

    up.recovery_probe = probe  # type: ignore[method-assign]
    b = up.breaker_for("model-b")
    b.force_open("test")
    b._opened_at -= rt.policy.ladder.breaker.reset_timeout_s + 1
    Evaluator(proxy.app[STATE]).tick()
    for _ in range(50):
        await asyncio.sleep(0)
    assert seen == ["model-b"]
    assert b.state == "closed"
    # The probe's body names the model under test.
    assert up.probe_request("model-b")["model"] == "model-b"
    assert up.probe_request()["model"] == "model-a"  # the first of /v1/models


async def test_release_trial_goes_to_the_breaker_that_issued_the_permit(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    _, _, up = await started(fake_upstream, start_proxy, "backends: {primary: {kind: openai}}")
    b = up.breaker_for("model-a")
    b.force_open("test")
    b._opened_at -= b.policy.reset_timeout_s + 1
    permit = b.allow()
    assert permit is not None and b.allow() is None  # one trial slot
    up.breaker.release_trial(permit)  # the backend's own breaker: not its permit
    assert b.allow() is None
    up.release_trial(permit)
    assert b.allow() is not None


async def test_single_model_backends_keep_one_breaker(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    # vLLM lists LoRA adapters next to its base model: still one breaker.
    _, _, up = await started(fake_upstream, start_proxy, "")
    assert up.policy.kind == "vllm"
    assert up.breaker_for("model-a") is up.breaker
    assert up.breaker_for("model-b") is up.breaker
    assert up.model_breakers == {}


async def test_a_model_rewrite_keeps_one_breaker(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    extra = "backends: {primary: {kind: openai, model: model-b}}"
    _, _, up = await started(fake_upstream, start_proxy, extra)
    assert up.breaker_for("model-a") is up.breaker
    assert up.probe_request()["model"] == "model-b"


async def test_real_requests_open_only_their_models_breaker(
    fake_upstream: FakeUpstream, fallback_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Through the pipeline: model-a's 500s open model-a's breaker and move
    model-a to the fallback, while model-b keeps being answered by the primary."""
    serve_models(fake_upstream, TWO_MODELS)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["model"] == "model-a":
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    fake_upstream.handlers["/v1/chat/completions"] = chat
    fallback_upstream.handlers["/v1/chat/completions"] = chat_fallback
    extra = "backends: {primary: {kind: openai}}\nladder: {breaker: {fail_max: 3}}\n"
    proxy = await start_proxy(ladder_policy(fake_upstream.url, fallback_upstream.url, extra))
    up = proxy.app[STATE].current.upstreams["primary"]
    for _ in range(200):
        if up.served_models:
            break
        await asyncio.sleep(0.01)

    async def ask(model: str) -> str:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        async with proxy.session.post(proxy.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return r.headers["X-Brownout-Backend"]

    for _ in range(3):
        assert await ask("model-a") == "fallback"  # the primary's 500, retried there
    # The third failure sends the recovery probe (for model-a: 500 too), which opens it.
    for _ in range(200):
        if up.breaker_for("model-a").state == "open":
            break
        await asyncio.sleep(0.01)
    assert up.breaker_for("model-a").state == "open"
    before = len([p for p, _, _ in fake_upstream.requests if p == "/v1/chat/completions"])
    assert await ask("model-a") == "fallback"  # not even tried on the primary now
    after = len([p for p, _, _ in fake_upstream.requests if p == "/v1/chat/completions"])
    assert after == before
    for _ in range(5):
        assert await ask("model-b") == "primary"
    assert up.breaker.state == "closed"
    assert proxy.app[STATE].current.tier == "normal"


async def chat_fallback(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    return web.json_response(
        {
            "id": "fb",
            "object": "chat.completion",
            "model": body.get("model", "tiny"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "from the fallback"},
                    "finish_reason": "stop",
                }
            ],
        }
    )
