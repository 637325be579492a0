"""What cuts across every route, as one aiohttp middleware (`ingress`), in
this order:

1. the request context — the request id (the client's sane `X-Request-Id`,
   or a fresh one) bound into structlog's contextvars once, so every log
   line of the request carries `request_id`; sent back on every response.
2. OpenAI errors — whatever the steps below or a handler raise becomes an
   OpenAI error object: `RequestRejected` (4xx), aiohttp's `HTTPException`s
   (404, 405 with `Allow`, 413, ...), and any other exception (500
   `internal_error`). No input gets a plain-text error from the app.
3. the path check — a path not in canonical form is refused before anything
   is routed on or forwarded (`proxy.ingress.paths`).
4. the method — a method the route does not take is a 405 with `Allow`,
   before any credential is asked for (`GET /brownout/tier`: 405, never 401).
5. authentication — the route's credential: client keys (`server.api_keys`)
   or the admin token, each compared in constant time.

One middleware, not five: each aiohttp middleware is another coroutine
frame and handler wrapper on every request.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Mapping

import structlog
from aiohttp import web

from proxy.errors import RequestRejected, error_response
from proxy.ingress import listen
from proxy.ingress.context import BODY_ABANDONED, REQUEST_ID, STARTED_AT
from proxy.ingress.paths import path_problem
from proxy.ingress.routes import Route, route_of
from proxy.openai.auth import bearer_token, is_valid_utf8, key_matches
from proxy.openai.errors import HTTP_CODES, error_body, error_type_for
from proxy.runtime import shutdown
from proxy.runtime.generation import request_id
from proxy.runtime.keys import STATE
from proxy.runtime.shutdown import Draining

log = structlog.get_logger("brownout.request")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# structlog's context variable for `request_id` (what bind_contextvars sets),
# set directly: bind_contextvars and clear_contextvars cost ~10,000
# instructions a request (a context copy and a walk over it), this ~4,000.
_REQUEST_ID_VAR: contextvars.ContextVar[object] = structlog.contextvars.bind_contextvars(
    request_id=...
)["request_id"].var

# The response once its headers are on their way (set by `stamp_response`).
_PREPARED: web.RequestKey[web.StreamResponse] = web.RequestKey(
    "brownout_prepared", web.StreamResponse
)


async def stamp_response(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: every response carries the request's id."""
    rid = request.get(REQUEST_ID)
    if rid is not None:
        response.headers["X-Request-Id"] = rid
        request[_PREPARED] = response


@web.middleware
async def ingress(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request_id(request.headers.get("X-Request-Id"))
    request[REQUEST_ID] = rid
    request[STARTED_AT] = asyncio.get_running_loop().time()
    # One connection's task serves its keep-alive requests one after the
    # other, each leaving an empty log context (the `finally` below; nothing
    # else binds one), so the next starts from an empty one.
    _REQUEST_ID_VAR.set(rid)  # structlog's bind_contextvars(request_id=rid)
    deadline = listen.request_started(request)
    counted: Draining | None = None
    try:
        route = route_of(request)
        _check_path(request.rel_url.raw_path)
        if route is not None and route.auth != "none":
            if route.methods != ("*",) and request.method not in route.methods:
                # The method decides before the credential: `GET /brownout/tier`
                # is a 405 with `Allow: POST` for everyone, not a 401 that
                # suggests the right token would make it work.
                raise web.HTTPMethodNotAllowed(request.method, route.methods)
            _authenticate(request, route)
            if route.auth == "client":
                # An API request: SIGTERM's drain waits for it, or turns it away.
                drain = request.app[STATE].shutdown
                if drain.draining:
                    return _shutting_down(request)
                drain.active += 1
                counted = drain
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects stay as aiohttp makes them
        if _PREPARED in request:
            return await _internal_error(request, exc)
        return reject(request, _from_http(request, exc), exc.headers)
    except asyncio.CancelledError:
        if request.get(BODY_ABANDONED):
            # No answer can reach the client; the request still gets its one
            # line and count (a disconnect later is the pipeline's to log).
            reject(
                request, RequestRejected(499, "client closed the connection", "client_disconnect")
            )
        raise
    except Exception as exc:
        if isinstance(exc, RequestRejected) and _PREPARED not in request:
            return reject(request, exc)
        return await _internal_error(request, exc)
    finally:
        if counted is not None:
            counted.active -= 1
        listen.request_finished(request, deadline)
        # structlog's clear_contextvars(): request_id is the only variable bound.
        _REQUEST_ID_VAR.set(...)


def _shutting_down(request: web.Request) -> web.Response:
    """A new API request while the process drains (proxy.runtime.shutdown):
    503 with `Retry-After`, and the connection closed so the retry opens a
    new one (to another replica)."""
    rej = RequestRejected(
        503,
        "This replica is shutting down; retry (another replica will answer).",
        "shutting_down",
        type_="server_error",
    )
    response = reject(request, rej, {"Retry-After": str(shutdown.RETRY_AFTER_S)})
    response.force_close()  # `Connection: close`
    return response


def reject(
    request: web.Request, rej: RequestRejected, extra: Mapping[str, str] | None = None
) -> web.Response:
    """The answer to a request refused before (or outside) the pipeline:
    counted, logged once, an OpenAI error object."""
    route = route_of(request)
    headers: dict[str, str] = {}
    if extra is not None:
        headers.update(
            (k, v) for k, v in extra.items() if k.lower() not in ("content-type", "content-length")
        )
    state = request.app.get(STATE)
    if state is not None:
        rt = state.current
        rt.metrics.bad_requests.labels(rej.code).inc()
        rt.count_request("none", route.name if route else "unknown", rej.status)
        if request.path.startswith("/v1/"):
            headers["X-Brownout-Tier"] = rt.tier
    log.info(
        "request_rejected",
        status=rej.status,
        reason=rej.code,
        method=request.method,
        path=request.rel_url.raw_path[:200],  # ASCII: aiohttp refuses raw non-ASCII targets
    )
    return error_response(
        rej.status,
        rej.message,
        type_=rej.type_,
        code=rej.code,
        param=rej.param,
        headers=headers,
    )


def _from_http(request: web.Request, exc: web.HTTPException) -> RequestRejected:
    status = exc.status
    where = f"{request.method} {request.rel_url.raw_path}"
    if status == 404:
        message = f"Invalid URL ({where}): no such route"
    elif status == 405:
        allowed = exc.headers.get("Allow", "")
        message = f"Method not allowed ({where}); allowed: {allowed}"
    else:
        message = exc.text if exc.text and exc.content_type == "text/plain" else exc.reason
    code = HTTP_CODES.get(status, f"http_{status}")
    return RequestRejected(status, message, code, type_=error_type_for(status))


async def _internal_error(request: web.Request, exc: Exception) -> web.StreamResponse:
    """A bug, not the client's fault: logged with its traceback, answered 500
    (or, once a stream's 200 went out, ended with an in-band error event)."""
    log.error("internal_error", error=type(exc).__name__, exc_info=exc)
    state = request.app.get(STATE)
    route = route_of(request)
    if state is not None:
        state.current.count_request("none", route.name if route else "unknown", 500)
    body = error_body(
        "internal error in the proxy (logged with this request's id)",
        "server_error",
        HTTP_CODES[500],
    )
    prepared: web.StreamResponse | None = request.get(_PREPARED)
    if prepared is None:
        return web.Response(status=500, body=body, content_type="application/json")
    ctype = prepared.headers.get("Content-Type", "")
    if not ctype.startswith("text/event-stream"):
        raise exc  # a body is half sent: only closing the connection says so
    # A stream already under way ends with an in-band error event, which the
    # OpenAI SDKs raise as an APIError (an end without one looks like success).
    try:
        await prepared.write(b"data: " + body + b"\n\ndata: [DONE]\n\n")
        await prepared.write_eof()
    except (ConnectionError, RuntimeError):
        pass
    return prepared


def _check_path(raw_path: str) -> None:
    problem = path_problem(raw_path)
    if problem is None:
        return
    message = problem.message
    if problem.suggestion is not None:
        message += f" (did you mean {problem.suggestion}?)"
    code = "invalid_path" if problem.status == 400 else HTTP_CODES[404]
    raise RequestRejected(problem.status, message, code)


def _authenticate(request: web.Request, route: Route) -> None:
    header = request.headers.get("Authorization")
    if header is not None and not is_valid_utf8(header):
        raise RequestRejected(
            400, "the Authorization header is not valid UTF-8", "invalid_header", "Authorization"
        )
    _check_credential(request, route, bearer_token(header))


def _check_credential(request: web.Request, route: Route, token: str | None) -> None:
    policy = request.app[STATE].current.policy.server
    if route.auth == "admin":
        if not policy.admin_token:
            raise RequestRejected(
                403,
                "admin endpoints are disabled: set server.admin_token in the policy",
                "admin_disabled",
                type_="permission_error",
            )
        if not key_matches(token, (policy.admin_token,)):
            raise RequestRejected(
                401, "missing or wrong admin token", "unauthorized", type_="authentication_error"
            )
    elif policy.api_keys and not key_matches(token, policy.api_keys):
        raise RequestRejected(401, "invalid or missing API key", "invalid_api_key")


def install(app: web.Application) -> None:
    """The middleware and the response stamp."""
    app.middlewares.append(ingress)
    app.on_response_prepare.append(stamp_response)
