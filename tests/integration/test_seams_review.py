"""Defects found at the seams of the merged pipeline, retry loop, breakers
and ladder (review of main at fd452ac), each reproduced on real sockets: the
real proxy in front of scripted fakes."""

from __future__ import annotations

from aiohttp import web

from tests.integration.conftest import FakeUpstream, ProxyFactory
from tests.integration.test_pipeline import CHAT, metrics, policy, total

VLLM_500 = {"error": {"message": "EngineCore encountered an issue.", "type": "server_error"}}
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
