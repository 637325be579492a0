"""The batched engine's generation loop dying is visible on /health, as vLLM's engine is.

Transformers' continuous batching runs one loop thread; any exception in a
generation step ends it for good (the requests in flight get an error, every
later one a 503). The server then cannot serve, so /health must say 503, not
200: the proxy's health probe and any orchestrator read it. The loop is
killed the way a request did before temperatures below 1e-5 became greedy:
a temperature that rounds to 0 in float32 makes the logits nan.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

import proxy.fallback.api.server as server_module
from proxy.fallback.api.server import create_app, serve
from proxy.fallback.api.state import Settings
from proxy.fallback.engines.batched import BatchedEngine
from proxy.fallback.engines.engine import Engine
from proxy.fallback.engines.interface import Finished, GenerationFailed, GenerationSpec
from proxy.fallback.protocol import SamplingParams
from tests.harness.procs import free_port


class _Quiet:
    def first_token(self) -> None: ...
    def tokens(self, count: int) -> None: ...
    def finished(self, outcome: Finished) -> None: ...


def _batched(tiny_model_dir: Path) -> tuple[Engine, BatchedEngine]:
    engine = Engine.load(tiny_model_dir, device="cpu", dtype="float32")
    generator = BatchedEngine(
        engine, max_running=2, kv_tokens=4096, max_model_len=512, side_slots=0
    )
    return engine, generator


async def _kill_the_loop(engine: Engine, generator: BatchedEngine) -> None:
    ids = engine.encode("Hello", add_special_tokens=True)
    # Bypasses the request parser, which now makes such a temperature greedy.
    spec = GenerationSpec(tuple(ids), SamplingParams(temperature=1e-300), 4)
    generation = generator.submit(spec, _Quiet())
    try:
        async with asyncio.timeout(30):
            while True:
                await generation.next_event()
    except GenerationFailed:
        pass  # the request in flight gets the loop's error


async def test_health_is_503_once_the_batched_loop_has_died(tiny_model_dir: Path) -> None:
    engine, generator = _batched(tiny_model_dir)
    app = create_app(engine, Settings("tiny", 512, max_concurrency=2), generator)
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/health")).status == 200
        await _kill_the_loop(engine, generator)
        body = {"prompt": "Hi", "max_tokens": 2}
        async with asyncio.timeout(10):  # the loop thread ends just after failing the request
            for _ in range(1000):
                if (await client.post("/v1/completions", json=body)).status == 503:
                    break
                await asyncio.sleep(0.01)
        # A request can be refused while the loop thread is still on its way
        # out (CI 2026-12-05: the 503 came, /health still said 200 a moment
        # later); the thread's end is the death /health reports.
        async with asyncio.timeout(5):
            for _ in range(500):
                if (await client.get("/health")).status == 503:
                    break
                await asyncio.sleep(0.01)
        assert (await client.get("/health")).status == 503


async def test_the_server_stops_once_the_batched_loop_has_died(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM exits within seconds of its engine dying (connection refused next, and its
    supervisor restarts it); the fallback served 503s for good."""
    monkeypatch.setattr(server_module, "_ENGINE_CHECK_S", 0.05, raising=False)
    engine, generator = _batched(tiny_model_dir)
    app = create_app(engine, Settings("tiny", 512, max_concurrency=2), generator)
    port = free_port()
    serving = asyncio.create_task(serve(app, "127.0.0.1", port))
    async with aiohttp.ClientSession() as session:
        async with asyncio.timeout(10):
            while True:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                        assert resp.status == 200
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.02)
        await _kill_the_loop(engine, generator)
        async with asyncio.timeout(10):
            assert await serving is True  # main() exits 1
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"http://127.0.0.1:{port}/health")
