"""Replaying a recording under the policy it was recorded with reproduces
what happened (issue 22, fidelity), on the real proxy in front of two
streaming fakes: the primary dies mid-load (its port closes: streams cut,
connections refused) and comes back; a burst overloads it.

The proxy records (`recorder.enabled`); `brownout replay` then runs the
recording through the control code on a virtual clock. The chaos drills'
recordings are measured by `bench/chaos.py --replay` (heavy, real vLLM)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.replay.main import run_replay
from proxy.replay.trace import Trace, policy_from_knobs
from tests.integration.conftest import chunk, free_port

pytestmark = pytest.mark.slow

SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"


@dataclass
class Streamer:
    """A streaming chat server: `ttft_s`, then `tokens` chunks `tpot_s` apart;
    at most `slots` at once (the rest wait, as vLLM's queue); `stop()`
    closes its port (refused; open streams are cut)."""

    name: str
    port: int
    ttft_s: float
    tpot_s: float
    slots: int
    runner: web.AppRunner | None = None
    sem: asyncio.Semaphore | None = None
    waiting: int = 0
    running: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.sem = asyncio.Semaphore(self.slots)
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/chat/completions", self.chat)
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.1
        )
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.runner = runner

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        self.waiting = self.running = 0

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 4096}]}
        )

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        lab = '{engine="0",model_name="tiny"}'
        return web.Response(
            text=f"vllm:num_requests_running{lab} {float(self.running)}\n"
            f"vllm:num_requests_waiting{lab} {float(self.waiting)}\n"
            f"vllm:kv_cache_usage_perc{lab} {min(1.0, self.running / 8):.3f}\n"
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        n = int(body.get("max_tokens") or 16)
        assert self.sem is not None
        self.waiting += 1
        try:
            await self.sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            await asyncio.sleep(self.ttft_s)
            resp = web.StreamResponse(headers=SSE)
            await resp.prepare(request)
            for _ in range(n):
                await resp.write(chunk("x "))
                await asyncio.sleep(self.tpot_s)
            await resp.write(chunk("", "stop") + DONE)
            return resp
        finally:
            self.running -= 1
            self.sem.release()


def policy_text(primary: str, fallback: str, rec_dir: Path, extra: str = "") -> str:
    return f"""
server:
  heartbeat_s: 0.5
backends:
  primary:
    url: {primary}
    kind: vllm
    timeouts: {{connect_s: 1, first_byte_s: 5, idle_s: 2}}
    health: {{interval_s: 0.2, timeout_s: 0.5}}
  fallback:
    url: {fallback}
    kind: transformers
    timeouts: {{connect_s: 1, first_byte_s: 10, idle_s: 3}}
    health: {{interval_s: 0.2, timeout_s: 0.5}}
ladder:
  throttle: {{max_inflight: 8, waiting_high: 3, scrape_interval_s: 0.5, ttft_factor: 3}}
  breaker: {{fail_max: 2, reset_timeout_s: 1}}
  recovery: {{window_s: 0.2, min_dwell_s: 2, healthy_windows: 2, ramp: [0.5, 1.0],
              ramp_step_s: 1}}
recorder:
  enabled: true
  dir: {rec_dir}
{extra}"""


def check_fidelity(fid: dict[str, Any] | None, trace: Trace) -> None:
    """The replay reproduces the recording — unless this shared host starved
    the recorded proxy (its event loop stood still: every window, probe and
    answer of that stretch came late), and then the report must say so."""
    assert fid is not None
    if fid["trustworthy"]:
        assert fid["tier_agreement"] >= 0.95, fid
        return
    stalls = trace.stalls()
    assert stalls, fid["reasons"]  # untrustworthy on a run the host did not starve
    assert any("stood still" in r for r in fid["reasons"]), fid["reasons"]
    pytest.skip(f"the host starved the recorded proxy ({stalls}): {fid['reasons']}")


@dataclass
class Stack:
    primary: Streamer
    fallback: Streamer
    url: str
    rec_dir: Path


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    primary = Streamer("primary", free_port(), 0.05, 0.01, 8)
    fallback = Streamer("fallback", free_port(), 0.15, 0.02, 4)
    await primary.start()
    await fallback.start()
    rec_dir = tmp_path / "rec"
    pol = parse_policy(policy_text(primary.url, fallback.url, rec_dir), "fid.yaml", env={})
    app = create_app(pol)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield Stack(primary, fallback, f"http://127.0.0.1:{port}", rec_dir)
    finally:
        await runner.cleanup()  # the recorder flushes its last second
        await primary.stop()
        await fallback.stop()


async def load(url: str, clients: int, until: float, tokens: int = 20) -> list[int]:
    statuses: list[int] = []
    body = {
        "model": "tiny",
        "stream": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "hello"}],
    }

    async def client(s: aiohttp.ClientSession, i: int) -> None:
        headers = {"X-Session-Id": f"fid-{i}-{time.monotonic()}"}
        while time.monotonic() < until:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with s.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                    await r.read()
                    statuses.append(r.status)
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        await asyncio.gather(*(client(s, i) for i in range(clients)))
    return statuses


async def test_a_primary_death_replays_as_it_happened(stack: Stack, tmp_path: Path) -> None:
    t0 = time.monotonic()
    task = asyncio.create_task(load(stack.url, 6, t0 + 22))
    await asyncio.sleep(6)
    await stack.primary.stop()  # the engine dies: streams cut, connections refused
    await asyncio.sleep(7)
    await stack.primary.start()
    statuses = await task
    assert statuses.count(200) > 100
    await asyncio.sleep(1.5)  # the recorder's last flush
    trace = Trace.load(stack.rec_dir)
    tiers = [to for _, _, to, _ in trace.tiers]
    assert "failover" in tiers, trace.tiers
    knobs = trace.recorded_policy
    assert knobs is not None
    recorded = policy_from_knobs(knobs)
    out = run_replay(recorded, trace_path=str(stack.rec_dir))
    fid = out.report["fidelity"]
    print("\n" + json.dumps({k: out.report[k] for k in ("fidelity", "model")}, indent=1))
    print(
        json.dumps(
            {
                k: {x: out.report[k][x] for x in ("tier_seconds", "timeline")}
                for k in ("recorded", "baseline")
            },
            indent=1,
        )
    )
    check_fidelity(fid, trace)


async def test_an_overload_burst_replays_as_it_happened(stack: Stack, tmp_path: Path) -> None:
    """Six clients, then twenty more for 8 s: the engine's queue (its
    `waiting` gauge) and the proxy's queue drive the throttle tier."""
    t0 = time.monotonic()
    steady = asyncio.create_task(load(stack.url, 6, t0 + 24, tokens=30))
    await asyncio.sleep(6)
    await load(stack.url, 20, time.monotonic() + 8, tokens=30)
    await steady
    await asyncio.sleep(1.5)
    trace = Trace.load(stack.rec_dir)
    assert "throttle" in [to for _, _, to, _ in trace.tiers], trace.tiers
    knobs = trace.recorded_policy
    assert knobs is not None
    out = run_replay(policy_from_knobs(knobs), trace_path=str(stack.rec_dir))
    fid = out.report["fidelity"]
    print("\n" + json.dumps({k: out.report[k] for k in ("fidelity", "model")}, indent=1))
    for k in ("recorded", "baseline"):
        print(
            k,
            out.report[k]["tier_seconds"],
            out.report[k]["shed"],
            [(x["t"], x["to"]) for x in out.report[k]["timeline"]],
        )
    check_fidelity(fid, trace)
