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

from aiohttp.test_utils import TestClient, TestServer

from proxy.fallback.batched import BatchedEngine
from proxy.fallback.engine import Engine
from proxy.fallback.interface import Finished, GenerationFailed, GenerationSpec
from proxy.fallback.protocol import SamplingParams
from proxy.fallback.server import create_app
from proxy.fallback.state import Settings


class _Quiet:
    def first_token(self) -> None: ...
    def tokens(self, count: int) -> None: ...
    def finished(self, outcome: Finished) -> None: ...


async def test_health_is_503_once_the_batched_loop_has_died(tiny_model_dir: Path) -> None:
    engine = Engine.load(tiny_model_dir, device="cpu", dtype="float32")
    generator = BatchedEngine(
        engine, max_running=2, kv_tokens=4096, max_model_len=512, side_slots=0
    )
    app = create_app(engine, Settings("tiny", 512, max_concurrency=2), generator)
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/health")).status == 200
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
        body = {"prompt": "Hi", "max_tokens": 2}
        async with asyncio.timeout(10):  # the loop thread ends just after failing the request
            for _ in range(1000):
                if (await client.post("/v1/completions", json=body)).status == 503:
                    break
                await asyncio.sleep(0.01)
        assert (await client.get("/health")).status == 503
