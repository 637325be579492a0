"""HTTP handlers: thin adapters from aiohttp requests to the flows.

Completions and every other /v1/* call go through `proxy.pipeline` (ladder,
retries, rescue, maintenance); the rest are operational and admin endpoints.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

import structlog
from aiohttp import web

from proxy.conversation import SessionContext, user_text
from proxy.errors import RequestRejected, error_response
from proxy.keys import STATE
from proxy.ladder import TIERS
from proxy.pipeline import serve_completion, serve_passthrough
from proxy.runtime import Runtime, request_id
from proxy.sessions import SessionIdError, session_key
from proxy.validate import Endpoint, parse_body

log = structlog.get_logger("brownout.request")


def _check_api_key(rt: Runtime, request: web.Request) -> None:
    keys = rt.policy.server.api_keys
    if not keys:
        return
    auth = request.headers.get("Authorization", "")
    token = auth[7:] if auth[:7].lower() == "bearer " else ""
    if token not in keys:
        raise RequestRejected(401, "invalid or missing API key", "invalid_api_key")


async def _read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise RequestRejected(
            413,
            f"request body of {request.content_length} bytes exceeds the {limit}-byte limit",
            "request_too_large",
        )
    try:
        # A client trickling its body (slow-loris) does not hold a handler forever.
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestRejected(
            413, f"request body exceeds the {limit}-byte limit", "request_too_large"
        ) from None
    except TimeoutError:
        raise RequestRejected(
            408, f"request body not received within {timeout_s:g} s", "request_timeout"
        ) from None


def _response_headers(rt: Runtime, rid: str, backend: str) -> dict[str, str]:
    return {"X-Request-Id": rid, "X-Brownout-Tier": rt.tier, "X-Brownout-Backend": backend}


async def forward_completion(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    rt = request.app[STATE].current
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    rid = request_id(request.headers.get("X-Request-Id"))
    base = {"X-Request-Id": rid, "X-Brownout-Tier": rt.tier}
    try:
        _check_api_key(rt, request)
        raw = await _read_body(
            request, rt.policy.server.max_body_bytes, rt.policy.server.body_timeout_s
        )
        parsed = parse_body(raw, endpoint)
    except RequestRejected as rej:
        rt.metrics.bad_requests.labels(rej.code).inc()
        rt.count_request("none", endpoint, rej.status)
        log.info("request_rejected", request_id=rid, status=rej.status, reason=rej.code)
        return rej.response(base)
    if rt.policy.server.log_prompts:
        # Opt-in only: prompts can hold personal data.
        log.info(
            "prompt",
            request_id=rid,
            messages=parsed.body.get("messages"),
            prompt=parsed.body.get("prompt"),
        )
    rt.inflight += 1
    try:
        auth = request.headers.get("Authorization", "")
        api_key = auth[7:] if auth[:7].lower() == "bearer " else None
        priority = rt.priority_for(request.headers.get("X-Priority"), api_key)
        session: SessionContext | None = None
        sid = request.headers.get("X-Session-Id")
        if sid is not None:
            ctx = _session_context(rt, sid, api_key, parsed.body, endpoint)
            if isinstance(ctx, web.Response):
                return ctx
            session = ctx
        return await serve_completion(
            request, rt, endpoint, raw, parsed.body, parsed.stream, rid, t0, priority, session
        )
    finally:
        rt.inflight -= 1


def _session_context(
    rt: Runtime, sid: str, api_key: str | None, body: dict[str, Any], endpoint: Endpoint
) -> SessionContext | web.Response:
    """The session a request belongs to, or the 400 that says why it can't."""
    if endpoint != "chat":
        return error_response(
            400, "X-Session-Id is only supported on /v1/chat/completions", code="invalid_session"
        )
    try:
        # With client keys configured, the key scopes the session.
        key = session_key(rt.policy.sessions.key_prefix, sid, api_key)
    except SessionIdError as exc:
        rt.metrics.bad_requests.labels("invalid_session_id").inc()
        return error_response(400, str(exc), code="invalid_session_id", param="X-Session-Id")
    text = user_text(body)
    if text is None:
        return error_response(
            400,
            "a session request must contain a user message with text (the new question)",
            code="invalid_session",
            param="messages",
        )
    return SessionContext(key=key, user_text=text)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await forward_completion(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await forward_completion(request, "completions")


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Any other /v1/* call (models, embeddings, responses, ...): through the
    pipeline (admission, breakers, tier routing, maintenance), body unchanged."""
    rt = request.app[STATE].current
    t0 = asyncio.get_running_loop().time()
    rid = request_id(request.headers.get("X-Request-Id"))
    base = {"X-Request-Id": rid, "X-Brownout-Tier": rt.tier}
    try:
        _check_api_key(rt, request)
        raw = (
            await _read_body(
                request, rt.policy.server.max_body_bytes, rt.policy.server.body_timeout_s
            )
            if request.can_read_body
            else b""
        )
    except RequestRejected as rej:
        return rej.response(base)
    auth = request.headers.get("Authorization", "")
    api_key = auth[7:] if auth[:7].lower() == "bearer " else None
    priority = rt.priority_for(request.headers.get("X-Priority"), api_key)
    rt.inflight += 1
    try:
        return await serve_passthrough(request, rt, raw, rid, t0, priority)
    finally:
        rt.inflight -= 1


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process and its event loop answer."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: at least one backend passed its last probe (maintenance
    answers would still work, but a load balancer should prefer a replica
    that can reach a model)."""
    rt = request.app[STATE].current
    ready = any(u.health.healthy for u in rt.upstreams.values())
    body = {
        "ready": ready,
        "backends": {n: bool(u.health.healthy) for n, u in rt.upstreams.items()},
    }
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
    state = request.app[STATE]
    denied = _admin_check(state.current, request)
    if denied is not None:
        return denied
    result = await state.reload("api")
    return web.json_response(result, status=200 if result["ok"] else 422)


def _admin_check(rt: Runtime, request: web.Request) -> web.Response | None:
    """Admin endpoints answer only when a token is configured, and only with it."""
    token = rt.policy.server.admin_token
    if not token:
        return error_response(
            403,
            "admin endpoints are disabled: set server.admin_token in the policy",
            type_="permission_error",
            code="admin_disabled",
        )
    auth = request.headers.get("Authorization", "")
    given = auth[7:] if auth[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        return error_response(
            401, "missing or wrong admin token", type_="authentication_error", code="unauthorized"
        )
    return None


async def force_tier(request: web.Request) -> web.Response:
    """POST {"tier": "maintenance"} forces a tier; {"tier": null} releases it."""
    rt = request.app[STATE].current
    denied = _admin_check(rt, request)
    if denied is not None:
        return denied
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError:
        return error_response(400, "body must be JSON", code="invalid_json")
    if not isinstance(body, dict) or not ("tier" in body or body.get("release") is True):
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
