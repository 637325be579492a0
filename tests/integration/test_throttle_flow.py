"""Tier 1 against a fake vLLM whose /metrics and latency are scripted."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from aiohttp import web

from tests.integration.conftest import (
    CHAT_BODY,
    FakeUpstream,
    ProxyFactory,
    RunningProxy,
    chunk,
    make_policy,
)

THROTTLE = """
ladder:
  recovery: {window_s: 0.05, min_dwell_s: 0.3, healthy_windows: 2}
  throttle:
    max_inflight: 4
    queue_size: 2
    queue_timeout_s: 2
    mode: fixed
    throttled_limit: 2
    scrape_interval_s: 0.05
    waiting_high: 5
"""


class FakeVLLM:
    def __init__(self, fake: FakeUpstream, service_s: float) -> None:
        self.waiting = 0
        self.running = 0
        self.max_running = 0
        self.service_s = service_s
        fake.handlers["/metrics"] = self.metrics
        fake.handlers["/v1/chat/completions"] = self.chat

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        text = (
            f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {self.waiting}\n'
            f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {self.running}\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.1\n'
        )
        return web.Response(text=text)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(self.service_s)
            await resp.write(chunk("ok", "stop") + b"data: [DONE]\n\n")
            return resp
        finally:
            self.running -= 1


async def status(proxy: RunningProxy) -> dict[str, Any]:
    async with proxy.session.get(proxy.url + "/brownout/status") as resp:
        data: dict[str, Any] = await resp.json()
        return data


async def wait_for(proxy: RunningProxy, pred: Any, limit_s: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + limit_s
    while True:
        st = await status(proxy)
        if pred(st):
            return st
        assert time.monotonic() < deadline, st
        await asyncio.sleep(0.02)


async def post(proxy: RunningProxy, priority: str = "normal") -> tuple[int, dict[str, str], bytes]:
    async with proxy.session.post(
        proxy.url + "/v1/chat/completions", json=CHAT_BODY, headers={"X-Priority": priority}
    ) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def test_rising_queue_throttles_and_sheds_then_recovers(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    vllm = FakeVLLM(fake_upstream, 0.01)
    proxy = await start_proxy(make_policy(fake_upstream.url, extra=THROTTLE))
    assert (await post(proxy, "sheddable"))[0] == 200  # normal tier: everyone served

    vllm.waiting = 12  # the engine's queue grows
    st = await wait_for(proxy, lambda s: s["tier"] == "throttle")
    assert st["history"][-1]["reason"] == "pressure"
    assert "waiting" in st["pressure"]["reason"]
    st = await wait_for(proxy, lambda s: s["concurrency"]["limit"] == 2)
    code, headers, body = await post(proxy, "sheddable")
    assert code == 429
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert b'"rate_limit_exceeded"' in body
    assert (await post(proxy, "normal"))[0] == 200
    assert (await post(proxy, "critical"))[0] == 200
    async with proxy.session.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    assert 'brownout_shed_total{priority="sheddable",reason="shed"} 1.0' in text
    assert "brownout_upstream_num_requests_waiting 12.0" in text
    assert "brownout_admission_limit 2.0" in text

    vllm.waiting = 0  # pressure gone
    st = await wait_for(proxy, lambda s: s["tier"] == "normal")
    st = await wait_for(proxy, lambda s: s["concurrency"]["limit"] == 4)
    assert (await post(proxy, "sheddable"))[0] == 200


async def test_inflight_at_the_engine_never_exceeds_the_limit(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    vllm = FakeVLLM(fake_upstream, 0.3)
    proxy = await start_proxy(make_policy(fake_upstream.url, extra=THROTTLE))
    results = await asyncio.gather(*(post(proxy) for _ in range(10)))
    codes = sorted(r[0] for r in results)
    assert vllm.max_running == 4
    # 4 in flight + 2 queued are served; the other 4 are refused at once.
    assert codes.count(200) == 6
    assert codes.count(429) == 4
    shed = [r for r in results if r[0] == 429]
    assert all(b"wait queue is full" in r[2] for r in shed)


async def test_queue_deadline_refuses_instead_of_waiting_forever(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    FakeVLLM(fake_upstream, 1.0)
    extra = THROTTLE.replace("queue_timeout_s: 2", "queue_timeout_s: 0.2")
    proxy = await start_proxy(make_policy(fake_upstream.url, extra=extra))
    t0 = time.monotonic()
    results = await asyncio.gather(*(post(proxy) for _ in range(6)))
    codes = [r[0] for r in results]
    assert codes.count(200) == 4
    assert codes.count(429) == 2
    timed_out = [r for r in results if r[0] == 429]
    assert all(b"no slot freed up" in r[2] for r in timed_out)
    assert time.monotonic() - t0 < 3


async def test_admission_is_released_on_client_disconnect(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    FakeVLLM(fake_upstream, 5.0)
    proxy = await start_proxy(make_policy(fake_upstream.url, extra=THROTTLE))
    async with aiohttp.ClientSession() as s:
        resp = await s.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY)
        await wait_for(proxy, lambda st: st["concurrency"]["admission"]["inflight"] == 1)
        resp.close()
    await wait_for(proxy, lambda st: st["concurrency"]["admission"]["inflight"] == 0, 2.0)


async def test_x_priority_cannot_raise_a_client_without_an_entry(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    """Issue 14 item 10: a client with no `key_priorities` entry sent
    `X-Priority: critical` and evicted a queued normal request. Now its header
    can only lower its priority; a key whose entry names a ceiling may raise."""
    release = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        await release.wait()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk("ok", "stop") + b"data: [DONE]\n\n")
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = chat
    extra = """
ladder:
  throttle:
    max_inflight: 1
    min_limit: 1
    throttled_limit: 1
    queue_size: 1
    queue_timeout_s: 30
    key_priorities: ["sk-gateway=normal..critical"]
"""
    proxy = await start_proxy(make_policy(fake_upstream.url, extra=extra))

    async def ask(headers: dict[str, str]) -> tuple[int, bytes]:
        async with proxy.session.post(
            proxy.url + "/v1/chat/completions", json=CHAT_BODY, headers=headers
        ) as resp:
            return resp.status, await resp.read()

    async def queued(n: int) -> None:
        await wait_for(proxy, lambda s: sum(s["concurrency"]["admission"]["queued"].values()) == n)

    first = asyncio.create_task(ask({}))
    await wait_for(proxy, lambda s: s["concurrency"]["admission"]["inflight"] == 1)
    waiting = asyncio.create_task(ask({}))
    await queued(1)
    code, body = await ask({"X-Priority": "critical"})
    assert code == 429 and b"wait queue is full" in body  # no eviction
    assert not waiting.done()
    st = await status(proxy)
    assert st["concurrency"]["admission"]["queued"] == {"critical": 0, "normal": 1, "sheddable": 0}

    # A key allowed to raise does evict the newest lower-priority waiter.
    gateway = asyncio.create_task(
        ask({"X-Priority": "critical", "Authorization": "Bearer sk-gateway"})
    )
    code, body = await waiting
    assert code == 429 and b"higher-priority" in body
    release.set()
    assert (await first)[0] == 200
    assert (await gateway)[0] == 200
