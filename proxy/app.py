"""The aiohttp application: routes, and the lifecycles of what they use."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from proxy import handlers
from proxy.config import Policy
from proxy.keys import RUNTIME
from proxy.metrics import TIER_VALUES, Metrics
from proxy.runtime import Runtime
from proxy.upstream import running_upstream


def create_app(policy: Policy) -> web.Application:
    # Bodies over the limit are refused while reading, before they fill memory.
    app = web.Application(client_max_size=policy.server.max_body_bytes)
    metrics = Metrics()
    rt = Runtime(policy=policy, metrics=metrics)
    metrics.inflight.set_function(lambda: rt.inflight)
    metrics.tier.set_function(lambda: TIER_VALUES[rt.tier])
    app[RUNTIME] = rt
    app.cleanup_ctx.append(_upstreams)

    r = app.router
    r.add_post("/v1/chat/completions", handlers.chat_completions)
    r.add_post("/v1/completions", handlers.completions)
    r.add_route("*", "/v1/{tail:.*}", handlers.passthrough)
    r.add_get("/healthz", handlers.healthz)
    r.add_get("/readyz", handlers.readyz)
    r.add_get("/metrics", handlers.metrics)
    r.add_get("/brownout/status", handlers.status)
    return app


async def _upstreams(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]
    backends = rt.policy.backends
    async with contextlib.AsyncExitStack() as stack:
        rt.add_upstream(
            await stack.enter_async_context(running_upstream("primary", backends.primary))
        )
        if backends.fallback is not None:
            rt.add_upstream(
                await stack.enter_async_context(running_upstream("fallback", backends.fallback))
            )
        yield
