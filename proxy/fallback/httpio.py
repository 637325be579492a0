"""HTTP plumbing shared by the fallback's handlers: JSON in, SSE out, common errors."""

from __future__ import annotations

import json

import orjson
from aiohttp import web

from proxy.fallback.errors import APIError
from proxy.fallback.shapes import JSONObject
from proxy.fallback.state import ADMISSION, SETTINGS, Settings
from proxy.openai.errors import error_body


async def read_json(request: web.Request) -> object:
    raw = await request.read()
    try:
        return json.loads(raw)
    # ValueError: bad JSON, bad UTF-8, an integer past Python's digit limit;
    # RecursionError: nesting deeper than the parser's stack.
    except (ValueError, RecursionError) as exc:
        raise APIError(
            400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None


def check_model(requested: str | None, settings: Settings) -> None:
    # Absent is fine (vLLM serves its one model); a wrong name is a client bug.
    if requested is not None and requested != settings.served_model_name:
        raise APIError(
            404,
            f"The model `{requested}` does not exist.",
            param="model",
            code="model_not_found",
        )


def check_capacity(app: web.Application) -> None:
    """Shed before tokenizing when the queue is already full (cheap 503)."""
    if app[ADMISSION].is_full():
        raise overloaded(app)


def overloaded(app: web.Application) -> APIError:
    admission, settings = app[ADMISSION], app[SETTINGS]
    return APIError(
        503,
        f"The server is overloaded ({admission.running} running, {admission.waiting} "
        "waiting); please retry later.",
        type_="server_error",
        code="overloaded",
        headers={"Retry-After": str(settings.retry_after_s)},
    )


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down.", type_="server_error", code="shutdown")


async def send(response: web.StreamResponse, obj: JSONObject) -> None:
    # orjson: compact, UTF-8 as is (like json.dumps(ensure_ascii=False)), a few
    # times cheaper per chunk; its bytes go out without a str round trip.
    await response.write(b"data: " + orjson.dumps(obj) + b"\n\n")


async def send_error(response: web.StreamResponse, exc: APIError) -> None:
    # In-band error after the 200: what vLLM sends and the OpenAI SDK raises on.
    body = error_body(exc.message, "server_error" if exc.status >= 500 else exc.type_, exc.status)
    await response.write(b"data: " + body + b"\n\n")
