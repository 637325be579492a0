"""The one table of every route: the router is built from it, the README
shows it, and the middlewares read a request's row (its auth).

Known paths get exactly their methods: any other method is a 405 with
`Allow`, answered by the proxy (aiohttp's router would otherwise let a
catch-all route take it, around the protections). Under `/v1/` every other
path goes to the pass-through; sub-paths of the two guarded endpoints are
404s, as are paths with a trailing slash (`proxy.ingress.paths`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from aiohttp import web

from proxy.ingress.completions import chat_completions, completions
from proxy.ops import handlers, recording, rollout

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Auth = Literal["client", "admin", "none"]

# The stages, as the README names them.
_COMPLETION = (
    "ingress → session load → route → attempts [admission → adapt → backend call → "
    "relay + guard → rescue] → session save → finish"
)
_PASS = (
    "ingress → route (tier, maintenance) → attempts [admission → backend call (breaker) → "
    "relay (+ guard on chat-chunk SSE)] → finish; body passed through"
)
_INGRESS_ONLY = "ingress (answered by the proxy, nothing forwarded)"
_OPS = "answered by the proxy"


@dataclass(frozen=True, slots=True)
class Route:
    name: str  # the aiohttp resource name and the `endpoint` label of refusals
    path: str
    methods: tuple[str, ...]
    handler: Handler
    auth: Auth
    stages: str
    doc: str


async def _no_such_route(request: web.Request) -> web.StreamResponse:
    raise web.HTTPNotFound()


# fmt: off
ROUTES: tuple[Route, ...] = (
    Route("chat", "/v1/chat/completions", ("POST",), chat_completions, "client", _COMPLETION,
          "Chat completions, streamed or not; sessions with `X-Session-Id`."),
    Route("completions", "/v1/completions", ("POST",), completions, "client", _COMPLETION,
          "Text completions, streamed or not."),
    Route("chat_subpath", "/v1/chat/completions/{tail:.*}", ("*",), _no_such_route, "none",
          _INGRESS_ONLY, "404: no sub-path or trailing slash reaches a backend."),
    Route("completions_subpath", "/v1/completions/{tail:.*}", ("*",), _no_such_route, "none",
          _INGRESS_ONLY, "404: no sub-path or trailing slash reaches a backend."),
    Route("models", "/v1/models", ("GET",), handlers.passthrough, "client", _PASS,
          "The backend's model list."),
    Route("model", "/v1/models/{model}", ("GET",), handlers.passthrough, "client", _PASS,
          "One model."),
    Route("responses", "/v1/responses", ("POST",), handlers.passthrough, "client", _PASS,
          "The Responses API."),
    Route("response", "/v1/responses/{response_id}", ("GET", "DELETE"), handlers.passthrough,
          "client", _PASS, "One stored response."),
    Route("response_cancel", "/v1/responses/{response_id}/cancel", ("POST",),
          handlers.passthrough, "client", _PASS, "Cancel a background response."),
    Route("embeddings", "/v1/embeddings", ("POST",), handlers.passthrough, "client", _PASS,
          "Embeddings."),
    Route("transcriptions", "/v1/audio/transcriptions", ("POST",), handlers.passthrough,
          "client", _PASS, "Speech to text (multipart body)."),
    Route("translations", "/v1/audio/translations", ("POST",), handlers.passthrough,
          "client", _PASS, "Speech to English text (multipart body)."),
    Route("rerank", "/v1/rerank", ("POST",), handlers.passthrough, "client", _PASS,
          "Rerank (vLLM)."),
    Route("score", "/v1/score", ("POST",), handlers.passthrough, "client", _PASS,
          "Score (vLLM)."),
    Route("v1_other", "/v1/{tail:.+}", ("GET", "POST", "DELETE"), handlers.passthrough,
          "client", _PASS, "Any other /v1/* path (canonical paths only)."),
    Route("healthz", "/healthz", ("GET", "HEAD"), handlers.healthz, "none", _OPS,
          "Liveness."),
    Route("readyz", "/readyz", ("GET", "HEAD"), handlers.readyz, "none", _OPS,
          "Readiness: a backend passed its last probe."),
    Route("metrics", "/metrics", ("GET",), handlers.metrics, "none", _OPS,
          "Prometheus exposition."),
    Route("status", "/brownout/status", ("GET",), handlers.status, "none", _OPS,
          "Tier, backends, breakers, limits (JSON)."),
    Route("tier", "/brownout/tier", ("POST",), handlers.force_tier, "admin", _OPS,
          "Force or release a tier."),
    Route("reload", "/brownout/reload", ("POST",), handlers.reload_policy, "admin", _OPS,
          "Re-read the policy file."),
    Route("rollout", "/brownout/rollout", ("GET", "POST"), rollout.rollout, "admin", _OPS,
          "The gray release (GET: state, step, share, gates, bundles; POST "
          '{"action": ...}: start, pause, resume, abort, promote).'),
    Route("recording", "/brownout/recording", ("GET",), recording.recording, "admin", _OPS,
          "A window of the flight recording as JSON lines (`?since=&until=`: Unix "
          "seconds, ISO 8601 or -15m; default the last 15 minutes)."),
)
# fmt: on

_BY_NAME = MappingProxyType({r.name: r for r in ROUTES})


def _not_allowed(methods: tuple[str, ...]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        raise web.HTTPMethodNotAllowed(request.method, methods)

    return handler


def add_routes(app: web.Application) -> None:
    """Register every row of `ROUTES`, each path with exactly its methods."""
    for route in ROUTES:
        resource = app.router.add_resource(route.path, name=route.name)
        for method in route.methods:
            resource.add_route(method, route.handler)
        if route.methods != ("*",):
            resource.add_route("*", _not_allowed(route.methods))


def route_of(request: web.Request) -> Route | None:
    """The table row a request was routed to (None: no route, or one added
    outside the table, like the status page's)."""
    resource = request.match_info.route.resource
    name = resource.name if resource is not None else None
    return _BY_NAME.get(name) if name is not None else None


def markdown_table() -> str:
    """The table as the README shows it."""
    lines = [
        "| path | methods | handler | auth | stages | what |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in ROUTES:
        methods = "any" if r.methods == ("*",) else ", ".join(r.methods)
        handler = f"`{r.handler.__module__.removeprefix('proxy.')}.{r.handler.__name__}`"
        lines.append(f"| `{r.path}` | {methods} | {handler} | {r.auth} | {r.stages} | {r.doc} |")
    return "\n".join(lines)
