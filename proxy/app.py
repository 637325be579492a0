"""The aiohttp application: routes, and the lifecycles of what they use."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from proxy import handlers
from proxy.config import Policy
from proxy.keys import STATE
from proxy.metrics import Metrics
from proxy.pressure import parse_vllm_metrics
from proxy.state import ProxyState, watch_policy
from proxy.statuspage import setup_status_page


def create_app(policy: Policy, clock: Callable[[], float] = time.monotonic) -> web.Application:
    # Bodies over the limit are refused while reading, before they fill memory.
    app = web.Application(client_max_size=policy.server.max_body_bytes)
    app[STATE] = ProxyState(policy, Metrics(), clock)
    app.cleanup_ctx.append(_state)
    app.cleanup_ctx.append(_loops)

    r = app.router
    r.add_post("/v1/chat/completions", handlers.chat_completions)
    r.add_post("/v1/completions", handlers.completions)
    r.add_route("*", "/v1/{tail:.*}", handlers.passthrough)
    r.add_get("/healthz", handlers.healthz)
    r.add_get("/readyz", handlers.readyz)
    r.add_get("/metrics", handlers.metrics)
    r.add_get("/brownout/status", handlers.status)
    r.add_post("/brownout/tier", handlers.force_tier)
    r.add_post("/brownout/reload", handlers.reload_policy)
    setup_status_page(app)
    return app


async def _state(app: web.Application) -> AsyncIterator[None]:
    """Backends, session store, tokenizers, shared state — and their closing."""
    state = app[STATE]
    await state.start()
    yield
    await state.close()


async def _loops(app: web.Application) -> AsyncIterator[None]:
    """The background work: ladder windows, vLLM scrapes, shared state, file watch.
    Each loop reads `state.current`, so a reload takes effect at its next turn."""
    state = app[STATE]
    pol = state.current.policy
    jobs: list[Coroutine[Any, Any, None]] = [
        _evaluate_forever(state),
        _scrape_forever(state),
        _flush_saves_forever(state),
    ]
    if pol.ladder.shared.redis:
        jobs.append(_sync_forever(state))
    if pol.server.watch_policy:
        jobs.append(watch_policy(state, pol.server.watch_interval_s))
    tasks = [asyncio.create_task(j) for j in jobs]
    yield
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t


async def _evaluate_forever(state: ProxyState) -> None:
    """Evaluate the ladder every window; test open breakers with recovery probes."""
    while True:
        rt = state.current
        await asyncio.sleep(rt.policy.ladder.recovery.window_s)
        rt = state.current
        if rt.policy.ladder.failover.recovery_probe:
            for up in rt.upstreams.values():
                b = up.breaker
                permit = b.allow() if b.state == "open" and rt.clock() >= b.retry_at() else None
                if permit is not None:
                    try:
                        why = await up.recovery_probe()
                        if why is None:
                            rt.report_success(up, permit=permit)
                        else:
                            b.record_failure(permit, f"recovery probe: {why}")
                    finally:
                        b.release_trial(permit)  # no-op once an outcome was recorded
        rt.evaluate(window=True)


async def _scrape_forever(state: ProxyState) -> None:
    """Read vLLM's own load gauges from the primary's /metrics."""
    while True:
        rt = state.current
        interval = rt.policy.ladder.throttle.scrape_interval_s
        up = rt.upstreams.get("primary")
        if up is None or up.policy.kind != "vllm" or interval <= 0:
            await asyncio.sleep(1.0)
            continue
        timeout = aiohttp.ClientTimeout(total=max(0.5, interval))
        try:
            async with up.session.get(up.base.with_path("/metrics"), timeout=timeout) as resp:
                text = await resp.text()
            if resp.status == 200:
                rt.pressure.update_engine(parse_vllm_metrics(text))
            else:
                rt.pressure.engine.error = f"/metrics returned HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError, RuntimeError) as exc:
            rt.pressure.engine.error = type(exc).__name__
        await asyncio.sleep(interval)


async def _sync_forever(state: ProxyState) -> None:
    """Follow the other replicas' breakers and forced tier through Redis."""
    while True:
        rt = state.current
        await rt.sync_shared()
        await asyncio.sleep(rt.policy.ladder.shared.interval_s)


async def _flush_saves_forever(state: ProxyState) -> None:
    """Write turns that waited out a session-store outage, once it answers."""
    while True:
        await asyncio.sleep(1.0)
        rt = state.current
        if len(rt.pending_saves):
            await rt.pending_saves.flush(rt.store)
