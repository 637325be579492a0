"""The aiohttp application: routes, and the lifecycles of what they use."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from proxy.ingress import middleware
from proxy.ingress.routes import add_routes
from proxy.ops.statuspage import setup_status_page
from proxy.policy import Policy
from proxy.runtime.keys import STATE
from proxy.runtime.loops import wanted_loops
from proxy.runtime.state import ProxyState
from proxy.telemetry.metrics import Metrics


def create_app(policy: Policy, clock: Callable[[], float] = time.monotonic) -> web.Application:
    # Bodies over the limit are refused while reading, before they fill memory.
    app = web.Application(client_max_size=policy.server.max_body_bytes)
    app[STATE] = ProxyState(policy, Metrics(), clock)
    app.cleanup_ctx.append(_state)
    app.cleanup_ctx.append(_loops)

    middleware.install(app)
    add_routes(app)  # every route is a row of proxy.ingress.routes.ROUTES
    setup_status_page(app)
    return app


async def _state(app: web.Application) -> AsyncIterator[None]:
    """Backends, session store, tokenizers, shared state — and their closing."""
    state = app[STATE]
    await state.start()
    yield
    await state.close()


async def _loops(app: web.Application) -> AsyncIterator[None]:
    """The background work (`proxy.runtime.loops`): ladder windows, vLLM scrapes,
    pending saves, shared state, file watch — supervised, and reconciled
    with the policy on every reload."""
    state = app[STATE]
    state.run_loops(wanted_loops)
    yield
    await state.stop_loops()
