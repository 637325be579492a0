"""HTTP handlers of the fallback server and its error middleware.

The generation endpoints live in `generate` (re-exported here for the
router); this module has the middleware and the small endpoints.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from functools import partial

import jinja2
import structlog
from aiohttp import web

from proxy.fallback.api.errors import APIError, invalid
from proxy.fallback.api.fields import advertise
from proxy.fallback.api.generate import chat_completions, completions
from proxy.fallback.api.httpio import check_model, read_json
from proxy.fallback.api.metrics import CONTENT_TYPE
from proxy.fallback.api.parsing import check_prompt_size, parse_tokenize
from proxy.fallback.api.state import ENGINE, METRICS, SETTINGS, WORKERS
from proxy.fallback.engines.engine import Engine
from proxy.fallback.features.support import API_SUPPORT, ApiSupport
from proxy.fallback.protocol import TokenizeRequest

__all__ = [
    "chat_completions",
    "completions",
    "error_middleware",
    "health",
    "metrics",
    "models",
    "tokenize",
]

log = structlog.get_logger("brownout.fallback.http")


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error leaves as an OpenAI error object; every request is counted."""
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    metrics = request.app[METRICS]
    try:
        response = await handler(request)
    except APIError as exc:
        response = exc.response()
    except web.HTTPException as exc:  # routing: unknown path, wrong method
        kept = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        response = APIError(exc.status, exc.reason, headers=kept).response()
    except asyncio.CancelledError:
        metrics.http_request(endpoint, 499)  # client closed the connection (nginx's 499)
        raise
    except Exception:
        log.exception("handler_failed", endpoint=endpoint)
        response = APIError(500, "Internal server error.", type_="server_error").response()
    metrics.http_request(endpoint, response.status)
    return response


async def health(request: web.Request) -> web.Response:
    # The model is loaded before the port opens, so answering means ready; 503 once the
    # engine can serve no more (as vLLM's /health when its engine is dead).
    return web.Response(status=200 if request.app[WORKERS].alive() else 503)


async def models(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    card = {
        "id": settings.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "brownout",
        "root": str(request.app[ENGINE].path),
        "parent": None,
        "max_model_len": settings.max_model_len,
        # What a request may ask of this server, for the engine in use (see `fields`).
        "capabilities": advertise(
            request.app[WORKERS].capabilities, grammar=request.app[API_SUPPORT].grammar
        ),
    }
    return web.json_response({"object": "list", "data": [card]})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def tokenize(request: web.Request) -> web.Response:
    req = parse_tokenize(await read_json(request))
    app = request.app
    settings = app[SETTINGS]
    check_model(req.model, settings)
    # A prompt that cannot fit the context is refused without tokenizing it.
    check_prompt_size(req, settings.max_model_len, app[API_SUPPORT].max_token_chars)
    ids = await app[WORKERS].tokenize(partial(_tokenize_ids, app[ENGINE], app[API_SUPPORT], req))
    return web.json_response(
        {"count": len(ids), "max_model_len": settings.max_model_len, "tokens": ids}
    )


def _tokenize_ids(engine: Engine, support: ApiSupport, req: TokenizeRequest) -> list[int]:
    """On the tokenizer thread; a template error is the request's fault (400)."""
    if req.messages is None:
        return engine.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
    try:
        text = support.template.render(
            req.messages,
            req.tools,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
    except (ValueError, jinja2.TemplateError) as exc:
        raise invalid(f"Cannot apply the chat template: {exc}", "messages") from exc
    return engine.encode(text, add_special_tokens=req.add_special_tokens)
