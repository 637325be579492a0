"""Tier 1 against the real vLLM (`--max-num-seqs 8`): 64 concurrent streams,
direct and through the proxy, in one run."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import replace

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.vllm import VLLMServer
from tests.integration.conftest import RANDOM_MODEL_GUARD, ProxyFactory, make_policy

pytestmark = [pytest.mark.real, pytest.mark.slow]

STREAMS = 64
BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
    # Long enough that vLLM's queue lasts a few of the sampler's /metrics reads
    # (at 48 tokens a fast engine drained 64 requests between two reads).
    "max_tokens": 128,
    "temperature": 1.0,
    "stream": True,
    "ignore_eos": True,
}
THROTTLE = """
ladder:
  throttle:
    max_inflight: 8      # vLLM's --max-num-seqs
    queue_size: 64
    queue_timeout_s: 60
    scrape_interval_s: 0.2
"""


# brownout_upstream_ttft_seconds' buckets (proxy/telemetry/metrics.py).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, math.inf)


def p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]


async def one(session: aiohttp.ClientSession, url: str) -> tuple[float, int]:
    """(client TTFT, HTTP status) of one streaming request."""
    t0 = time.monotonic()
    async with session.post(url, json=BODY) as resp:
        if resp.status != 200:
            await resp.read()
            return math.inf, resp.status
        ttft = math.inf
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":"' in line:
                ttft = time.monotonic() - t0
                break
        async for _ in resp.content.iter_any():
            pass
        return ttft, resp.status


async def engine_load(session: aiohttp.ClientSession, base: str) -> tuple[float, float]:
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    running = waiting = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:num_requests_running":
                running += s.value
            elif s.name == "vllm:num_requests_waiting":
                waiting += s.value
    return running, waiting


async def run_load(url: str, vllm: str) -> tuple[list[float], float]:
    """Client TTFTs of 64 concurrent streams, and the most requests vLLM held."""
    peak = 0.0
    done = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def sample() -> None:
            nonlocal peak
            while not done.is_set():
                running, waiting = await engine_load(s, vllm)
                peak = max(peak, running + waiting)
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        results = await asyncio.gather(*(one(s, url) for _ in range(STREAMS)))
        done.set()
        await sampler
    assert all(status == 200 for _, status in results), results
    return [t for t, _ in results], peak


async def queued_in_vllm(base: str) -> float:
    """Requests so far that spent longer than the first bucket of
    `vllm:request_queue_time_seconds` waiting in vLLM's queue (cumulative, so
    nothing is missed between samples)."""
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
        text = await resp.text()
    buckets: list[tuple[float, float]] = []
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name == "vllm:request_queue_time_seconds_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
    if not buckets:
        return 0.0
    buckets.sort()
    return buckets[-1][1] - buckets[0][1]


def histogram_p95(text: str, name: str, backend: str) -> float:
    """P95 upper bound from a Prometheus histogram's buckets."""
    buckets: list[tuple[float, float]] = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name + "_bucket" and s.labels.get("backend") == backend:
                buckets.append((float(s.labels["le"]), s.value))
    buckets.sort()
    total = buckets[-1][1]
    for le, count in buckets:
        if count >= 0.95 * total:
            return le
    return math.inf


async def test_64_streams_direct_vs_through_the_proxy(
    live_vllm_server: VLLMServer, start_proxy: ProxyFactory
) -> None:
    policy = make_policy(live_vllm_server.base_url, extra=THROTTLE + RANDOM_MODEL_GUARD)
    policy = replace(
        policy,
        backends=replace(
            policy.backends,
            primary=replace(
                policy.backends.primary,
                timeouts=replace(policy.backends.primary.timeouts, first_byte_s=60, idle_s=30),
            ),
        ),
    )
    proxy = await start_proxy(policy)
    vllm = live_vllm_server.base_url
    # Warm up both paths (first-request compilation, connection pools).
    await run_load(vllm + "/v1/chat/completions", vllm)

    before = await queued_in_vllm(vllm)
    direct, direct_peak = await run_load(vllm + "/v1/chat/completions", vllm)
    after_direct = await queued_in_vllm(vllm)
    proxied, proxied_peak = await run_load(proxy.url + "/v1/chat/completions", vllm)
    after_proxied = await queued_in_vllm(vllm)
    direct_queued = after_direct - before
    proxied_queued = after_proxied - after_direct
    async with proxy.session.get(proxy.url + "/metrics") as resp:
        metrics = await resp.text()
    engine_p95 = histogram_p95(metrics, "brownout_upstream_ttft_seconds", "primary")
    summary = {
        "direct_client_ttft_p95_s": round(p95(direct), 3),
        "direct_engine_peak_requests": direct_peak,
        "proxied_client_ttft_p95_s": round(p95(proxied), 3),
        "proxied_engine_ttft_p95_s_upper_bound": engine_p95,
        "proxied_engine_peak_requests": proxied_peak,
        "direct_requests_queued_in_vllm": direct_queued,
        "proxied_requests_queued_in_vllm": proxied_queued,
    }
    print("\n" + json.dumps(summary))
    # The proxy held the line: vLLM never saw more than the limit at once...
    assert proxied_peak <= 8
    # Direct, vLLM held more than its 8 slots: the sampled gauges can miss
    # the peak on a busy machine (seen: 3 of 64), so the proof is vLLM's own
    # queue-time histogram — requests that waited in its queue at all.
    assert direct_peak > 8 or direct_queued >= STREAMS // 2, summary
    assert proxied_queued < direct_queued, summary
    # ...so the requests it admitted started no slower than direct ones did,
    # compared at the histogram's resolution (the engine side is only known
    # by buckets; a loaded 2-core machine can put both in the same one).
    direct_bound = min(b for b in BUCKETS if b >= p95(direct))
    assert engine_p95 <= direct_bound
