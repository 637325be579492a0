"""HTTP handlers: the pass-through, operational and admin endpoints.

Completions are `proxy.ingress.completions`, every other /v1/* call
`serve_passthrough`: both go through `proxy.pipeline` (ladder, retries,
rescue, maintenance). The route table, auth and error answers are
`proxy.ingress`; the rest are operational and admin endpoints.
"""

from __future__ import annotations

import structlog
from aiohttp import web

from proxy.control.ladder import TIERS
from proxy.errors import error_response
from proxy.ingress.body import read_body
from proxy.ingress.context import REQUEST_ID, STARTED_AT
from proxy.ingress.validate import parse_json_object
from proxy.openai.auth import bearer_token
from proxy.pipeline import serve_passthrough
from proxy.runtime.generation import Runtime
from proxy.runtime.keys import STATE

log = structlog.get_logger("brownout.request")


def _response_headers(rt: Runtime, rid: str, backend: str) -> dict[str, str]:
    return {"X-Request-Id": rid, "X-Brownout-Tier": rt.tier, "X-Brownout-Backend": backend}


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any other /v1/* call (models, embeddings, responses, ...): through the
    pipeline (admission, breakers, tier routing, maintenance), body unchanged."""
    rt = request.app[STATE].current
    rid = request[REQUEST_ID]
    # (auth and path checks: proxy.ingress.middleware; refusals raise RequestRejected)
    raw = await read_body(request, rt.policy.server.max_body_bytes, rt.policy.server.body_timeout_s)
    api_key = bearer_token(request.headers.get("Authorization"))
    priority = rt.priority_for(request.headers.get("X-Priority"), api_key)
    return await serve_passthrough(request, rt, raw, rid, request[STARTED_AT], priority)


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process and its event loop answer."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: at least one backend passed its last probe (maintenance
    answers would still work, but a load balancer should prefer a replica
    that can reach a model). Never while the process drains on SIGTERM."""
    state = request.app[STATE]
    rt = state.current
    draining = state.shutdown.draining
    ready = not draining and any(u.health.healthy for u in rt.upstreams.values())
    body: dict[str, object] = {
        "ready": ready,
        "backends": {n: bool(u.health.healthy) for n, u in rt.upstreams.items()},
    }
    if draining:
        body["draining"] = True
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    rt = request.app[STATE].current
    for name, up in rt.upstreams.items():
        rt.metrics.backend_up.labels(name).set(1 if up.health.healthy else 0)
    return web.Response(
        body=rt.metrics.exposition(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def status(request: web.Request) -> web.Response:
    body = request.app[STATE].status()
    body["version"] = _version()
    return web.json_response(body)


async def reload_policy(request: web.Request) -> web.Response:
    """Re-read the policy file; 200 with the changes, or 422 with FILE:LINE errors
    (the running policy stays)."""
    state = request.app[STATE]  # admin token: checked by the auth middleware
    result = await state.reload("api")
    return web.json_response(result, status=200 if result["ok"] else 422)


async def force_tier(request: web.Request) -> web.Response:
    """POST {"tier": "maintenance"} forces a tier; {"tier": null} releases it."""
    rt = request.app[STATE].current  # admin token: checked by the auth middleware
    raw = await read_body(request, 64 * 1024, rt.policy.server.body_timeout_s)
    body = parse_json_object(raw or b"{}")
    if not ("tier" in body or body.get("release") is True):
        return error_response(
            400,
            'expected {"tier": "<tier>"}, {"tier": null} or {"release": true}',
            code="invalid_request",
        )
    tier = None if body.get("release") is True else body.get("tier")
    if tier is not None and tier not in TIERS:
        return error_response(
            400, f"tier must be one of {', '.join(TIERS)} or null", code="invalid_tier"
        )
    rt.force_tier(tier)
    log.warning("tier_forced" if tier else "tier_released", tier=tier)
    return web.json_response(rt.status())


def _version() -> str:
    from proxy import __version__

    return __version__
