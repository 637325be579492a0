"""Two replicas sharing ladder state through a private redis-server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.runtime.keys import STATE
from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    ProxyFactory,
    RunningProxy,
    make_policy,
)
from tests.sessions.conftest import PrivateRedis


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[PrivateRedis]:
    r = PrivateRedis(tmp_path)
    r.start()
    try:
        yield r
    finally:
        r.stop()


def shared_policy(upstream: str, redis_url: str) -> Any:
    from dataclasses import replace

    policy = make_policy(
        upstream,
        extra=f"""
ladder:
  breaker: {{fail_max: 2, reset_timeout_s: 30}}
  recovery: {{window_s: 0.05}}
  shared: {{redis: "{redis_url}", interval_s: 0.1, timeout_s: 0.2}}
""",
    )
    return replace(policy, server=replace(policy.server, admin_token="t0ken"))


async def status(p: RunningProxy) -> dict[str, Any]:
    async with p.session.get(p.url + "/brownout/status") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def eventually(p: RunningProxy, pred: Any, limit_s: float) -> float:
    t0 = time.monotonic()
    while True:
        st = await status(p)
        if pred(st):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < limit_s, st
        await asyncio.sleep(0.02)


async def test_breaker_and_forced_tier_reach_the_other_replica(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, redis_server: PrivateRedis
) -> None:
    async def boom(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "boom"}}, status=500)

    fake_upstream.handlers["/v1/chat/completions"] = boom
    a = await start_proxy(shared_policy(fake_upstream.url, redis_server.url))
    b = await start_proxy(shared_policy(fake_upstream.url, redis_server.url))
    await eventually(b, lambda s: s["shared"]["healthy"] is True, 2)
    body = {**CHAT_BODY, "stream": False}
    for _ in range(2):  # opens A's breaker (fail_max 2, once the probe fails too)
        async with a.session.post(a.url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
    await eventually(a, lambda s: s["backends"]["primary"]["breaker"] == "open", 2.0)
    seen = await eventually(b, lambda s: s["backends"]["primary"]["breaker"] == "open", 1.0)
    st = await status(b)
    assert "opened by replica" in st["backends"]["primary"]["breaker_detail"]["last_failure"]
    assert st["tier"] == "maintenance"  # no fallback configured
    assert seen < 1.0

    # A forced tier set on B is followed by A, and so is its release.
    async with b.session.post(
        b.url + "/brownout/tier",
        json={"tier": "maintenance"},
        headers={"Authorization": "Bearer t0ken"},
    ) as resp:
        assert resp.status == 200
    await eventually(a, lambda s: s["ladder"]["forced"] == "maintenance", 1.0)
    async with b.session.post(
        b.url + "/brownout/tier", json={"tier": None}, headers={"Authorization": "Bearer t0ken"}
    ) as resp:
        assert resp.status == 200
    await eventually(a, lambda s: s["ladder"]["forced"] is None, 1.0)


async def test_redis_down_replicas_keep_serving_on_local_state(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, redis_server: PrivateRedis
) -> None:
    async def ok(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "chat.completion", "choices": []})

    fake_upstream.handlers["/v1/chat/completions"] = ok
    a = await start_proxy(shared_policy(fake_upstream.url, redis_server.url))
    b = await start_proxy(shared_policy(fake_upstream.url, redis_server.url))
    await eventually(a, lambda s: s["shared"]["healthy"] is True, 2)
    redis_server.stop()
    for p in (a, b):
        await eventually(p, lambda s: s["shared"]["healthy"] is False, 2)
        async with p.session.post(
            p.url + "/v1/chat/completions", json={**CHAT_BODY, "stream": False}
        ) as resp:
            assert resp.status == 200
        async with p.session.get(p.url + "/metrics") as resp:
            assert "brownout_shared_state_up 0.0" in await resp.text()
    redis_server.start()
    await eventually(a, lambda s: s["shared"]["healthy"] is True, 3)


async def test_a_model_breaker_reaches_the_other_replica_and_only_that_model(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory, redis_server: PrivateRedis
) -> None:
    """Per-model breakers (a multi-model `openai` backend) are shared like the
    backend's own: model-a opened on A is opened on B; model-b stays closed on
    both, and the backend itself stays closed (before, only backend breakers
    were shared and B kept sending model-a's traffic to the failing model)."""
    from tests.integration.test_ladder_flow import ladder_policy
    from tests.integration.test_model_breakers import TWO_MODELS, fail, serve_models

    serve_models(fake_upstream, TWO_MODELS)
    extra = (
        "backends: {primary: {kind: openai}}\n"
        "ladder: {breaker: {fail_max: 2, reset_timeout_s: 30}, "
        f'shared: {{redis: "{redis_server.url}", interval_s: 0.05, timeout_s: 0.2}}}}\n'
    )
    a = await start_proxy(ladder_policy(fake_upstream.url, None, extra))
    b = await start_proxy(ladder_policy(fake_upstream.url, None, extra))
    ups = [p.app[STATE].current.upstreams["primary"] for p in (a, b)]
    for _ in range(300):
        if all(up.served_models for up in ups) and all(
            p.app[STATE].current.shared is not None and p.app[STATE].current.shared.healthy
            for p in (a, b)
        ):
            break
        await asyncio.sleep(0.01)
    up_a, up_b = ups
    fail(a.app[STATE].current, up_a, "model-a", 2)
    assert up_a.model_breakers["model-a"].state == "open"

    def model_state(st: dict[str, Any], model: str) -> str | None:
        mb = st["backends"]["primary"]["model_breakers"].get(model)
        return None if mb is None else mb["state"]

    await eventually(b, lambda s: model_state(s, "model-a") == "open", 1.0)
    st = await status(b)
    assert st["backends"]["primary"]["breaker"] == "closed"
    assert model_state(st, "model-b") in (None, "closed")
    assert up_b.breaker_for("model-b").allow() is not None
