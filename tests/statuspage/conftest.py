"""A proxy with the status page on a real socket, and a scripted LLM server behind it."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from proxy.app import create_app
from proxy.ops.statuspage import STATUS_PAGE, setup_status_page
from proxy.policy import Policy, parse_policy
from tests.integration.conftest import chunk, free_port

ADMIN_TOKEN = "s3cret-status"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class FakeLLM:
    """An OpenAI/vLLM-ish server: streaming chat with a random time to first
    token, `/v1/models` with `max_model_len`, and vLLM gauges on `/metrics`."""

    model: str
    max_model_len: int
    ttft: tuple[float, float] = (0.05, 0.3)
    port: int = field(default_factory=free_port)
    running: int = 0
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def health(self, _r: web.Request) -> web.Response:
        return web.Response()

    async def models(self, _r: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "max_model_len": self.max_model_len}]}
        )

    async def metrics(self, _r: web.Request) -> web.Response:
        label = f'{{model_name="{self.model}"}}'
        text = (
            f"vllm:num_requests_running{label} {self.running}\n"
            f"vllm:num_requests_waiting{label} {max(0, self.running - 3)}\n"
            f"vllm:kv_cache_usage_perc{label} {min(0.9, 0.12 * self.running)}\n"
        )
        return web.Response(text=text)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.running += 1
        try:
            await asyncio.sleep(random.uniform(*self.ttft))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for word in ("Hello", " from", " the", " fake", " model"):
                await resp.write(chunk(word))
                await asyncio.sleep(0.01)
            await resp.write(chunk("", "stop"))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.running -= 1


@pytest.fixture
async def llm() -> AsyncIterator[FakeLLM]:
    fake = FakeLLM("Qwen2.5-7B-Instruct-AWQ", 8192)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def llm_fallback() -> AsyncIterator[FakeLLM]:
    fake = FakeLLM("tiny-llama-fallback", 2048, ttft=(0.02, 0.08))
    await fake.start()
    yield fake
    await fake.stop()


def status_policy(primary: str, fallback: str | None = None, admin: bool = True) -> Policy:
    """Fast probes and a fast ladder, so tier changes show within a second or two."""
    text = "server:\n  heartbeat_s: 0.3\n"
    if admin:
        text += f"  admin_token: {ADMIN_TOKEN}\n"
    text += f"""backends:
  primary:
    url: {primary}
    kind: vllm
    health: {{interval_s: 0.2, timeout_s: 0.5}}
"""
    if fallback:
        text += f"""  fallback:
    url: {fallback}
    kind: transformers
    health: {{interval_s: 0.2, timeout_s: 0.5}}
"""
    text += """ladder:
  throttle:
    max_inflight: 16
    scrape_interval_s: 0.5
  recovery:
    window_s: 0.2
    min_dwell_s: 0.5
    healthy_windows: 1
    ramp_step_s: 0.5
"""
    return parse_policy(text, "status-test-policy.yaml")


@dataclass
class StatusProxy:
    """The proxy (create_app + setup_status_page) on a fixed port, restartable."""

    policy: Policy
    interval_s: float = 1.0
    port: int = field(default_factory=free_port)
    app: web.Application | None = None
    runner: web.AppRunner | None = None
    session: aiohttp.ClientSession = field(default_factory=aiohttp.ClientSession)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = create_app(self.policy)
        setup_status_page(app, interval_s=self.interval_s)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.app, self.runner = app, runner

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def close(self) -> None:
        await self.stop()
        await self.session.close()

    async def force(self, tier: str | None) -> dict[str, object]:
        async with self.session.post(
            self.url + "/brownout/tier", json={"tier": tier}, headers=ADMIN
        ) as resp:
            body: dict[str, object] = await resp.json()
            assert resp.status == 200, body
            return body

    async def status(self) -> dict[str, object]:
        async with self.session.get(self.url + "/brownout/status") as resp:
            body: dict[str, object] = await resp.json()
            return body

    async def chat(self) -> int:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        async with self.session.post(self.url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status


@pytest.fixture
async def status_proxies() -> AsyncIterator[list[StatusProxy]]:
    """Proxies a test starts (`StatusProxy(policy)` + `start()`), all closed after it."""
    made: list[StatusProxy] = []
    yield made
    for p in made:
        await p.close()


async def start_status_proxy(
    made: list[StatusProxy], policy: Policy, interval_s: float = 1.0, **page: float
) -> StatusProxy:
    """Start a proxy (closed by the `status_proxies` fixture); `page` overrides
    attributes of its `StatusPage` (e.g. `heartbeat_s`)."""
    p = StatusProxy(policy, interval_s=interval_s)
    made.append(p)
    await p.start()
    assert p.app is not None
    sp = p.app[STATUS_PAGE]
    for k, v in page.items():
        assert hasattr(sp, k), k
        setattr(sp, k, v)
    return p


async def read_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str, str]]:
    """(event, data) pairs of an SSE response; comments come as ("comment", text)."""
    event, data = "message", list[str]()
    async for raw in resp.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def loads(data: str) -> dict[str, object]:
    obj: dict[str, object] = json.loads(data)
    return obj
