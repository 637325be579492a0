"""The aiohttp application: routes, and the lifecycles of what they use."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from proxy import handlers
from proxy.config import Policy
from proxy.keys import RUNTIME
from proxy.metrics import TIER_VALUES, Metrics
from proxy.pressure import parse_vllm_metrics
from proxy.runtime import Runtime
from proxy.sessions import make_store
from proxy.shared import SharedState
from proxy.trim import HFTokenCounter
from proxy.upstream import Upstream, running_upstream


def create_app(policy: Policy) -> web.Application:
    # Bodies over the limit are refused while reading, before they fill memory.
    app = web.Application(client_max_size=policy.server.max_body_bytes)
    metrics = Metrics()
    rt = Runtime(policy=policy, metrics=metrics)
    metrics.inflight.set_function(lambda: rt.inflight)
    metrics.tier.set_function(lambda: TIER_VALUES[rt.tier])
    app[RUNTIME] = rt
    app.cleanup_ctx.append(_upstreams)
    app.cleanup_ctx.append(_sessions)
    app.cleanup_ctx.append(_ladder_loop)
    app.cleanup_ctx.append(_engine_scrape)
    app.cleanup_ctx.append(_shared_state)

    r = app.router
    r.add_post("/v1/chat/completions", handlers.chat_completions)
    r.add_post("/v1/completions", handlers.completions)
    r.add_route("*", "/v1/{tail:.*}", handlers.passthrough)
    r.add_get("/healthz", handlers.healthz)
    r.add_get("/readyz", handlers.readyz)
    r.add_get("/metrics", handlers.metrics)
    r.add_get("/brownout/status", handlers.status)
    r.add_post("/brownout/tier", handlers.force_tier)
    return app


async def _upstreams(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]
    pol = rt.policy
    async with contextlib.AsyncExitStack() as stack:
        for name, bp in (("primary", pol.backends.primary), ("fallback", pol.backends.fallback)):
            if bp is None:
                continue
            up = await stack.enter_async_context(
                running_upstream(
                    name,
                    bp,
                    pol.ladder.breaker,
                    rt.clock,
                    rt.on_breaker_change,
                    pol.ladder.failover.probe_failures,
                )
            )
            rt.add_upstream(up)
        yield


async def _sessions(app: web.Application) -> AsyncIterator[None]:
    """The session store, and the local tokenizers the policy names (loaded
    off the event loop, once)."""
    rt = app[RUNTIME]
    rt.store = make_store(rt.policy.sessions)
    for name, up in rt.upstreams.items():
        if up.policy.tokenizer:
            rt.counters[name] = await HFTokenCounter.load(up.policy.tokenizer)
    yield
    await rt.store.close()


async def _ladder_loop(app: web.Application) -> AsyncIterator[None]:
    """Evaluate the ladder every window; test open breakers with recovery probes."""
    rt = app[RUNTIME]
    task = asyncio.create_task(_evaluate_forever(rt), name="ladder")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _evaluate_forever(rt: Runtime) -> None:
    window = rt.policy.ladder.recovery.window_s
    while True:
        await asyncio.sleep(window)
        if rt.policy.ladder.failover.recovery_probe:
            for up in rt.upstreams.values():
                b = up.breaker
                if b.state == "open" and rt.clock() >= b.retry_at() and b.allow():
                    why = await up.recovery_probe()
                    if why is None:
                        rt.report_success(up)
                    else:
                        up.breaker.record_failure(f"recovery probe: {why}")
        rt.evaluate(window=True)


async def _engine_scrape(app: web.Application) -> AsyncIterator[None]:
    """Read vLLM's own load gauges from the primary's /metrics."""
    rt = app[RUNTIME]
    interval = rt.policy.ladder.throttle.scrape_interval_s
    primary = rt.upstreams.get("primary")
    if primary is None or primary.policy.kind != "vllm" or interval <= 0:
        yield
        return
    task = asyncio.create_task(_scrape_forever(rt, primary, interval), name="engine-scrape")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _scrape_forever(rt: Runtime, up: Upstream, interval: float) -> None:
    url = up.base.with_path("/metrics")
    timeout = aiohttp.ClientTimeout(total=max(0.5, interval))
    while True:
        try:
            async with up.session.get(url, timeout=timeout) as resp:
                text = await resp.text()
            if resp.status == 200:
                rt.pressure.update_engine(parse_vllm_metrics(text))
            else:
                rt.pressure.engine.error = f"/metrics returned HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
            rt.pressure.engine.error = f"{type(exc).__name__}"
        await asyncio.sleep(interval)


async def _shared_state(app: web.Application) -> AsyncIterator[None]:
    """Follow the other replicas' breakers and forced tier through Redis."""
    rt = app[RUNTIME]
    pol = rt.policy.ladder.shared
    if not pol.redis:
        yield
        return
    rt.shared = SharedState(pol)
    task = asyncio.create_task(_sync_forever(rt, pol.interval_s), name="shared-state")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await rt.shared.close()


async def _sync_forever(rt: Runtime, interval: float) -> None:
    while True:
        await rt.sync_shared()
        await asyncio.sleep(interval)
