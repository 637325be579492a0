"""The breaker end to end: what `/brownout/status` and `/metrics` show."""

from __future__ import annotations

import asyncio

from aiohttp import web

from tests.integration.conftest import ProxyFactory
from tests.integration.test_ladder_flow import (
    VLLM_500,
    FakeFactory,
    answering,
    ask,
    failing,
    fakes,  # noqa: F401  (fixture)
    get_status,
    ladder_policy,
    metric,
)


async def test_a_late_success_does_not_close_an_open_breaker(
    fakes: FakeFactory,  # noqa: F811
    start_proxy: ProxyFactory,
) -> None:
    """Defect 15: a request admitted while the breaker was closed finishes
    fine after failures opened it; that success closed the breaker (pybreaker's
    wall-clock timer moved it to half-open behind the proxy's back), with no
    trial call and no recovery probe."""
    primary = await fakes()
    admitted, finish = asyncio.Event(), asyncio.Event()
    ok, fail = answering(["late"]), failing(500, VLLM_500)
    calls = 0

    async def chat(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls > 1:
            return await fail(request)
        admitted.set()
        await finish.wait()
        return await ok(request)

    primary.handlers["/v1/chat/completions"] = chat
    policy = ladder_policy(
        primary.url,
        None,
        "ladder: {breaker: {fail_max: 2, reset_timeout_s: 0.001}}",
        "ladder: {failover: {recovery_probe: false}}",
    )
    proxy = await start_proxy(policy)
    slow = asyncio.create_task(ask(proxy, stream=False))
    await admitted.wait()
    for _ in range(2):
        await ask(proxy, stream=False)
    assert (await get_status(proxy))["backends"]["primary"]["breaker"] == "open"

    finish.set()
    reply = await slow
    assert reply.status == 200 and reply.text() == "late"
    st = await get_status(proxy)
    assert st["backends"]["primary"]["breaker"] == "open"
    labels = {"backend": "primary", "from": "half-open", "to": "closed"}
    assert await metric(proxy, "brownout_breaker_transitions_total", labels) == 0
    assert calls == 3  # no trial call was made
