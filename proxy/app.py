"""The aiohttp application: routes, and the lifecycles of what they use."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from proxy import handlers
from proxy.keys import STATE
from proxy.loops import wanted_loops
from proxy.metrics import Metrics
from proxy.policy import Policy
from proxy.state import ProxyState
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
    """The background work (`proxy.loops`): ladder windows, vLLM scrapes,
    pending saves, shared state, file watch — supervised, and reconciled
    with the policy on every reload."""
    state = app[STATE]
    state.run_loops(wanted_loops)
    yield
    await state.stop_loops()
