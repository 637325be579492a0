"""The vLLM container's preStop hook in deploy/k8s, run against a real proxy.

On a pod stop the kubelet runs vLLM's preStop before vLLM gets SIGTERM
(Brownout, a native sidecar, is stopped after vLLM). The hook must keep vLLM
up while Brownout has requests in flight — or a stream that Brownout is
relaying would be cut by vLLM's exit — and return as soon as there are none,
or at its deadline (the policy's `shutdown_grace_s`). The script is taken
from the manifest as `kubectl kustomize` renders it.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from aiohttp import web

from proxy.policy import Policy, parse_policy
from tests.deploy.test_k8s import render, vllm
from tests.integration.conftest import CHAT_BODY, FakeUpstream, ProxyFactory, chunk

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def patient_policy(upstream: str) -> Policy:
    """The backend may stay silent mid-stream as long as these tests hold it."""
    return parse_policy(
        f"""
backends:
  primary:
    url: {upstream}
    timeouts: {{connect_s: 1, first_byte_s: 30, idle_s: 30}}
    health: {{interval_s: 0.2, timeout_s: 0.5}}
""",
        "prestop-policy.yaml",
    )


def prestop_script() -> str:
    command = vllm(render("gpu"))["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    script: str = command[2]
    return script


async def run_hook(metrics_url: str, drain_s: float) -> asyncio.subprocess.Process:
    env = {
        **os.environ,
        "BROWNOUT_METRICS_URL": metrics_url,
        "BROWNOUT_DRAIN_S": str(drain_s),
        "BROWNOUT_DRAIN_DELAY_S": "0",
    }
    return await asyncio.create_subprocess_exec(sys.executable, "-c", prestop_script(), env=env)


async def test_the_hook_waits_for_the_stream_in_flight_then_returns(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(chunk("first "))
        await release.wait()
        await resp.write(chunk("last", "stop"))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(patient_policy(fake_upstream.url))
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as stream:
        await stream.content.readuntil(b"\n\n")
        hook = await run_hook(proxy.url + "/metrics", drain_s=30)
        try:
            await asyncio.sleep(1.5)
            assert hook.returncode is None, "the hook returned with a stream in flight"
            release.set()
            body = await stream.content.read()
            t0 = time.monotonic()
            assert await asyncio.wait_for(hook.wait(), 5) == 0
            assert time.monotonic() - t0 < 3, "the hook did not return once the stream ended"
        finally:
            if hook.returncode is None:
                hook.kill()
    assert body.endswith(b"data: [DONE]\n\n")


async def test_the_hook_gives_up_at_its_deadline(
    fake_upstream: FakeUpstream, start_proxy: ProxyFactory
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(chunk("first "))
        await asyncio.sleep(10)
        return resp

    fake_upstream.handlers["/v1/chat/completions"] = handler
    proxy = await start_proxy(patient_policy(fake_upstream.url))
    async with proxy.session.post(proxy.url + "/v1/chat/completions", json=CHAT_BODY) as stream:
        await stream.content.readuntil(b"\n\n")
        t0 = time.monotonic()
        hook = await run_hook(proxy.url + "/metrics", drain_s=1)
        assert await asyncio.wait_for(hook.wait(), 5) == 0
        assert 0.9 <= time.monotonic() - t0 < 3


async def test_the_hook_returns_at_once_without_brownout() -> None:
    t0 = time.monotonic()
    hook = await run_hook("http://127.0.0.1:9/metrics", drain_s=30)
    assert await asyncio.wait_for(hook.wait(), 5) == 0
    assert time.monotonic() - t0 < 3
