"""`GET/POST /brownout/rollout`: the gray release's state, and the
operator's actions on it (admin token, checked by the ingress middleware)."""

from __future__ import annotations

from typing import Any, cast

from aiohttp import web

from proxy.control.rollout import ACTIONS, Action
from proxy.errors import error_response
from proxy.ingress.body import read_body
from proxy.ingress.validate import parse_json_object
from proxy.runtime.generation import Runtime
from proxy.runtime.keys import STATE


def rollout_status(rt: Runtime) -> dict[str, Any]:
    canary = rt.canary
    if canary is None:
        return {"state": "idle", "configured": False}
    snap = canary.snapshot()
    snap["configured"] = True
    cand = rt.upstreams.get("candidate")
    if cand is not None:
        snap["candidate"] = {
            "healthy": cand.health.healthy,
            "down": cand.down,
            "breaker": cand.breaker.state,
        }
    return snap


async def rollout(request: web.Request) -> web.Response:
    if request.method == "POST":
        return await post_rollout(request)
    return web.json_response(rollout_status(request.app[STATE].current))


async def post_rollout(request: web.Request) -> web.Response:
    """{"action": "start" | "pause" | "resume" | "abort" | "promote"}: 200 with
    the new state, 409 when the action does not apply now, 400 when unknown."""
    rt = request.app[STATE].current
    raw = await read_body(request, 64 * 1024, rt.policy.server.body_timeout_s)
    body = parse_json_object(raw or b"{}")
    action = body.get("action")
    if action not in ACTIONS:
        return error_response(
            400,
            f'expected {{"action": one of {", ".join(ACTIONS)}}}',
            code="invalid_action",
            param="action",
        )
    canary = rt.canary
    if canary is None:
        return error_response(
            409,
            "no rollout is configured: set backends.candidate in the policy",
            code="rollout_not_configured",
        )
    why = canary.act(cast(Action, action))
    if why:
        return error_response(409, why, code="rollout_conflict", param="action")
    return web.json_response(rollout_status(rt))
