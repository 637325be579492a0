"""HTTP plumbing shared by the fallback's handlers: JSON in, SSE out, common errors."""

from __future__ import annotations

import json
import re

import orjson
from aiohttp import web

from proxy.fallback.api.errors import APIError, invalid
from proxy.fallback.api.shapes import JSONObject
from proxy.fallback.api.state import ADMISSION, SETTINGS, SIDE_ADMISSION, Settings
from proxy.fallback.engines.admission import Admission
from proxy.openai.errors import error_body

# A UTF-16 surrogate can only reach a parsed string through a \uD800-\uDFFF escape.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_json(request: web.Request) -> object:
    raw = await request.read()
    try:
        data = json.loads(raw)
    # ValueError: bad JSON, bad UTF-8, an integer past Python's digit limit;
    # RecursionError: nesting deeper than the parser's stack.
    except (ValueError, RecursionError) as exc:
        raise APIError(
            400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None
    if _SURROGATE_ESCAPE.search(raw):
        # Paired escapes decode to one character; a lone one stays a surrogate, which
        # no tokenizer, template or grammar compiler can encode (it was a 500).
        where = _lone_surrogate(data)
        if where is not None:
            raise invalid(
                f"'{where}' holds a lone UTF-16 surrogate escape, which is not valid Unicode.",
                where,
            )
    return data


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate(data: object) -> str | None:
    """The path (`messages[0].content`) of the first string or key holding a lone surrogate."""
    stack: list[tuple[str, object]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return path or "body"
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                name = key.encode(errors="backslashreplace").decode()
                sub = f"{path}.{name}" if path else name
                if not _encodable(key):
                    return sub
                items.append((sub, item))
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


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
    """Shed before tokenizing when every queue a request could join is full
    (cheap 503; which lane it takes is known only once it is parsed)."""
    side = app.get(SIDE_ADMISSION)
    if app[ADMISSION].is_full() and (side is None or side.is_full()):
        raise overloaded(app)


def overloaded(app: web.Application, admission: Admission | None = None) -> APIError:
    settings = app[SETTINGS]
    if admission is None:
        admission = app[ADMISSION]
    return APIError(
        503,
        f"The server is overloaded ({admission.running} running, {admission.waiting} "
        "waiting); please retry later.",
        type_="server_error",
        code="overloaded",
        headers={"Retry-After": str(settings.retry_after_s)},
    )


def grammar_busy(app: web.Application, *, timed_out: bool) -> APIError:
    """503 + Retry-After: the grammar lane is full, or the grammar missed its deadline
    (the compile goes on and is cached: a retry may find it ready). Load, not a fault."""
    settings = app[SETTINGS]
    if timed_out:
        message = (
            f"The response_format / tools grammar was not compiled within "
            f"{settings.grammar.timeout_s:g} s; its compile goes on and is cached, please "
            "retry later."
        )
    else:
        message = "Every grammar compile worker is busy; please retry later."
    return APIError(
        503,
        message,
        type_="server_error",
        code="grammar_timeout" if timed_out else "overloaded",
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
